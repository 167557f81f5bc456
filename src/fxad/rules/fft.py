"""Rules for Fourier transforms: ``fft.fft``/``ifft``/``fft2``/``ifft2``/``fftn``/``ifftn``
(complex to complex), ``fft.rfft``/``rfft2``/``rfftn`` and ``fft.ihfft``/``ihfft2``/``ihfftn``
(real to one-sided complex), ``fft.irfft``/``irfft2``/``irfftn`` and ``fft.hfft``/``hfft2``/
``hfftn`` (one-sided complex to real), ``fft.fftshift``/``ifftshift`` and ``stft``.

Every transform is linear, so its JVP is the transform of the tangent and its VJP is its
adjoint under PyTorch's complex convention: for a map ``y = A x`` the cotangent of ``x`` is
the adjoint of ``A`` for the real inner product ``<a, b> = Re(sum conj(a) b)`` (of a real
input: the real part of the conjugate-linear adjoint).  The adjoints are written with
``torch.fft`` itself (derivatives.yaml ``_fft_c2c``, ``_fft_r2c``, ``_fft_c2r`` with the
helpers ``fft_r2c_backward`` / ``fft_c2r_backward``), derived as follows:

* c2c: the adjoint of ``fftn(norm=N)`` is ``ifftn(norm=N*)`` where ``N*`` is the dual
  normalization (``"backward"`` <-> ``"forward"``, ``"ortho"`` fixed), and vice versa.
  A length ``n``/``s`` that pads (or trims) the input is undone by trimming (or zero
  padding) the cotangent back to the input's size.
* r2c (``rfftn``): the one-sided output keeps bins ``0..n//2`` of the full transform, so the
  adjoint zero-extends the cotangent to ``n`` bins, applies the c2c adjoint and keeps the
  real part.
* c2r (``irfftn``): the output is ``Re(A h)`` where ``A`` rebuilds the Hermitian spectrum,
  i.e. weights bin ``k`` by 2 for the interior bins ``1 <= k < (n+1)//2`` that stand for a
  conjugate pair (1 for bin 0 and the Nyquist bin).  The adjoint is
  ``rfftn(g, norm=N*)`` with those interior bins doubled.
* ``hfftn(x, norm=N) = irfftn(conj(x), norm=N*)`` and ``ihfftn(x, norm=N) =
  conj(rfftn(x, norm=N*))`` (checked numerically), so their adjoints conjugate the ones above.

``fftshift``/``ifftshift`` are rolls, each the other's adjoint.  ``stft`` is pad + frame +
window + fft: its adjoint is the fft adjoint above, times the conjugate window, scattered
back (overlap-add) through an index map that folds in the padding (see the rule's
docstring).

The rules accept complex inputs wherever the op does (c2c and c2r transforms, shifts); their
``samples`` are real because the rule tests differentiate floating-point inputs.  Building
complex tensors (``complex``, ``polar``, ``view_as_complex``) is in
:mod:`fxad.rules.complex_ops`.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ._base import randn
from .registry import register_vjp


_DUAL = {None: "forward", "backward": "forward", "forward": "backward", "ortho": "ortho"}


def _fit(t: Any, dim: int, size: int) -> Any:
    """``t`` trimmed or zero-padded at the end of ``dim`` to length ``size``."""
    cur = t.shape[dim]
    if cur == size:
        return t
    if cur > size:
        return torch.narrow(t, dim, 0, size)
    pad = [0, 0] * (t.dim() - 1 - dim) + [0, size - cur]
    return F.pad(t, pad)


def _fit_all(t: Any, dims: list[int], sizes: list[int]) -> Any:
    for d, n in zip(dims, sizes):
        t = _fit(t, d, n)
    return t


def _nd_dims(ndim: int, s: Any, dim: Any) -> list[int]:
    """The transformed dims of an n-D transform (``fftn`` semantics), non-negative, in order."""
    if dim is None:
        k = ndim if s is None else len(s)
        return list(range(ndim - k, ndim))
    if isinstance(dim, int):
        dim = [dim]
    return [d % ndim for d in dim]


def _double_interior(t: Any, dim: int, n: int) -> Any:
    """Weight the one-sided bins 1 .. (n+1)//2 - 1 (the ones standing for a conjugate pair) by 2."""
    k = (n + 1) // 2 - 1
    if k <= 0:
        return t
    parts = [torch.narrow(t, dim, 0, 1), 2 * torch.narrow(t, dim, 1, k)]
    rest = t.shape[dim] - 1 - k
    if rest > 0:
        parts.append(torch.narrow(t, dim, 1 + k, rest))
    return torch.cat(parts, dim)


def _real_if(t: Any, real: bool) -> Any:
    return torch.real(t) if real else t


def _c2c(g: Any, dims: list[int], norm: Any, inverse: bool) -> Any:
    """The c2c transform of ``g`` over ``dims`` (inverse or forward), 1-D spelling for one dim."""
    if len(dims) == 1:
        f = torch.fft.ifft if inverse else torch.fft.fft
        return f(g, dim=dims[0], norm=norm)
    f = torch.fft.ifftn if inverse else torch.fft.fftn
    return f(g, dim=dims, norm=norm)


def _r2c(g: Any, dims: list[int], norm: Any) -> Any:
    if len(dims) == 1:
        return torch.fft.rfft(g, dim=dims[0], norm=norm)
    return torch.fft.rfftn(g, dim=dims, norm=norm)


# ---------------------------------------------------------------------------------------------
# complex to complex
# ---------------------------------------------------------------------------------------------

class C2C:
    """fft / ifft / fft2 / ifft2 / fftn / ifftn (norm N): the cotangent is the opposite
    transform with the dual norm, trimmed or zero-padded back to the input's sizes, real part
    for a real input (derivatives.yaml `_fft_c2c`: the adjoint of a c2c transform is the
    c2c transform in the other direction with the dual normalization)."""

    @staticmethod
    def bwd(aux: Any, d: Any) -> tuple:
        dims, sizes, norm, inverse, real = aux
        g = _c2c(d, dims, _DUAL[norm], not inverse)
        return (_real_if(_fit_all(g, dims, sizes), real),)


def _transform_rule(op: Any, kind: str, aux_of: Any, back: Any, doc: str,
                    sampler: Any) -> type:
    """The rule class of a torch.fft transform: ``kind`` "1" (``n``, ``dim``), "2" or "n"
    (``s``, ``dim``).  Forward: the op, with ``aux_of(input, dims, n_or_s, norm)`` as
    residuals; JVP: the op applied to the tangent (the transforms are linear); backward
    ``back``."""
    if kind == "1":
        class Transform:
            def fwd(input, n=None, dim=-1, norm=None):
                out = op(input, n=n, dim=dim, norm=norm)
                return out, aux_of(input, [dim % input.dim()], n, norm)

            def jvp(primals, tangents):
                x, n, dim, norm = primals
                t = tangents[0]
                return op(x, n=n, dim=dim, norm=norm), \
                    (None if t is None else op(t, n=n, dim=dim, norm=norm))
    else:
        default_dim = (-2, -1) if kind == "2" else None

        class Transform:  # type: ignore[no-redef]
            def fwd(input, s=None, dim=default_dim, norm=None):
                out = op(input, s=s, dim=dim, norm=norm)
                return out, aux_of(input, _nd_dims(input.dim(), s, dim), s, norm)

            def jvp(primals, tangents):
                x, s, dim, norm = primals
                t = tangents[0]
                return op(x, s=s, dim=dim, norm=norm), \
                    (None if t is None else op(t, s=s, dim=dim, norm=norm))

    Transform.bwd = back
    Transform.source = doc
    Transform.samples = sampler
    return Transform


def _c2c_rule(op: Any, inverse: bool, kind: str) -> type:
    def aux_of(input, dims, size, norm):
        return (dims, [input.shape[k] for k in dims], norm, inverse, not input.is_complex())

    if kind == "1":
        def samples(dtype):
            yield (randn(5, 6, 7, dtype=dtype),), {}
            yield (randn(5, 6, 7, dtype=dtype),), {"n": 10, "dim": 1, "norm": "ortho"}
            yield (randn(5, 6, 7, dtype=dtype),), {"n": 4, "dim": 0, "norm": "forward"}
            yield (randn(6, dtype=dtype), 6, 0, "backward"), {}
            yield (randn(1, dtype=dtype),), {}
            yield (randn(4, 5, dtype=dtype),), {"n": 7, "norm": "ortho"}
    else:
        def samples(dtype):
            yield (randn(5, 6, 7, dtype=dtype),), {}
            yield (randn(5, 6, 7, dtype=dtype),), {"s": (3, 10), "dim": (1, 2), "norm": "ortho"}
            yield (randn(5, 6, 7, dtype=dtype),), {"s": (6, 8), "norm": "forward"}
            yield (randn(5, 6, 7, dtype=dtype),), {"dim": (0, -1)}
            yield (randn(5, 6, 7, dtype=dtype),), {"dim": 0}
            yield (randn(1, 1, dtype=dtype),), {}
            yield (randn(4, 5, dtype=dtype),), {"s": (3, 7), "norm": "backward"}
            if kind == "n":
                yield (randn(5, 6, 7, dtype=dtype),), {"s": (8,)}
                yield (randn(5, 6, 7, dtype=dtype),), {"dim": (-3, -2, -1)}

    return _transform_rule(op, kind, aux_of, C2C.bwd, C2C.__doc__, samples)


for _op, _inv, _kind in ((torch.fft.fft, False, "1"), (torch.fft.ifft, True, "1"),
                         (torch.fft.fft2, False, "2"), (torch.fft.ifft2, True, "2"),
                         (torch.fft.fftn, False, "n"), (torch.fft.ifftn, True, "n")):
    register_vjp(_op)(_c2c_rule(_op, _inv, _kind))


# ---------------------------------------------------------------------------------------------
# real to one-sided complex: rfft*, ihfft*
# ---------------------------------------------------------------------------------------------

class R2C:
    """rfft / rfft2 / rfftn (norm N): the cotangent zero-extends the one-sided bins to the
    full length n along the last transformed dim, applies ifft with the dual norm, keeps the
    real part and trims or pads back to the input's sizes (derivatives.yaml `_fft_r2c`:
    fft_r2c_backward).  ihfft* = conj(rfft*(norm=N*)): the same on conj(d) with norm N."""

    @staticmethod
    def bwd(aux: Any, d: Any) -> tuple:
        dims, sizes, n_last, norm, conj = aux
        if conj:
            d = torch.conj(d)
        g = _fit(d, dims[-1], n_last)
        g = torch.real(_c2c(g, dims, _DUAL[norm], True))
        return (_fit_all(g, dims, sizes),)


def _n_last(x: Any, dims: list[int], size: Any) -> int:
    """Signal length along the last transformed dim: ``n`` (an int), ``s[-1]`` unless -1,
    else the input's size."""
    if isinstance(size, int):
        return size
    if size is not None and size[-1] != -1:
        return size[-1]
    return x.shape[dims[-1]]


def _r2c_rule(op: Any, conj: bool, kind: str) -> type:
    def aux_of(input, dims, size, norm):
        return (dims, [input.shape[k] for k in dims], _n_last(input, dims, size),
                _DUAL[norm] if conj else norm, conj)

    if kind == "1":
        def samples(dtype):
            yield (randn(5, 6, 7, dtype=dtype),), {}
            yield (randn(5, 6, 7, dtype=dtype),), {"n": 10, "dim": 1, "norm": "ortho"}
            yield (randn(5, 6, 7, dtype=dtype),), {"n": 5, "dim": 0, "norm": "forward"}
            yield (randn(5, 6, 7, dtype=dtype),), {"n": 3, "norm": "backward"}
            yield (randn(6, dtype=dtype), 9, 0), {}
            yield (randn(1, dtype=dtype),), {}
    else:
        def samples(dtype):
            yield (randn(5, 6, 7, dtype=dtype),), {}
            yield (randn(5, 6, 7, dtype=dtype),), {"s": (3, 10), "dim": (1, 2), "norm": "ortho"}
            yield (randn(5, 6, 7, dtype=dtype),), {"s": (6, 5), "norm": "forward"}
            yield (randn(5, 6, 7, dtype=dtype),), {"dim": (-1, 0)}
            yield (randn(5, 6, 7, dtype=dtype),), {"dim": 0}
            yield (randn(1, 1, dtype=dtype),), {}
            if kind == "n":
                yield (randn(5, 6, 7, dtype=dtype),), {"s": (8,)}
                yield (randn(5, 6, 7, dtype=dtype),), {"dim": (-3, -2, -1)}

    return _transform_rule(op, kind, aux_of, R2C.bwd, R2C.__doc__, samples)


for _op, _cj, _kind in ((torch.fft.rfft, False, "1"), (torch.fft.ihfft, True, "1"),
                        (torch.fft.rfft2, False, "2"), (torch.fft.ihfft2, True, "2"),
                        (torch.fft.rfftn, False, "n"), (torch.fft.ihfftn, True, "n")):
    register_vjp(_op)(_r2c_rule(_op, _cj, _kind))


# ---------------------------------------------------------------------------------------------
# one-sided complex to real: irfft*, hfft*
# ---------------------------------------------------------------------------------------------

class C2R:
    """irfft / irfft2 / irfftn (norm N, output length n along the last transformed dim): the
    cotangent is rfftn(d, norm=N*) with the interior bins 1 <= k < (n+1)//2 doubled, trimmed
    or zero-padded back to the input's sizes, real part for a real input (derivatives.yaml
    `_fft_c2r`: fft_c2r_backward).  hfft* = irfft*(conj(x), norm=N*): the conjugate of the
    same with norm N."""

    @staticmethod
    def bwd(aux: Any, d: Any) -> tuple:
        dims, sizes, norm, conj, real = aux
        g = _r2c(d, dims, _DUAL[norm])
        g = _double_interior(g, dims[-1], d.shape[dims[-1]])
        g = _fit_all(g, dims, sizes)
        if real:
            return (torch.real(g),)
        return (torch.conj(g) if conj else g,)


def _c2r_rule(op: Any, conj: bool, kind: str) -> type:
    def aux_of(input, dims, size, norm):
        return (dims, [input.shape[k] for k in dims], _DUAL[norm] if conj else norm, conj,
                not input.is_complex())

    if kind == "1":
        def samples(dtype):
            yield (randn(5, 6, 7, dtype=dtype),), {}
            yield (randn(5, 6, 7, dtype=dtype),), {"n": 10, "dim": 1, "norm": "ortho"}
            yield (randn(5, 6, 7, dtype=dtype),), {"n": 5, "dim": 0, "norm": "forward"}
            yield (randn(5, 6, 7, dtype=dtype),), {"n": 3}
            yield (randn(5, 6, 7, dtype=dtype),), {"n": 20}
            yield (randn(4, 6, dtype=dtype),), {"n": 7, "norm": "backward"}
            yield (randn(6, dtype=dtype), 9, 0), {}
            yield (randn(2, dtype=dtype),), {}
    else:
        def samples(dtype):
            yield (randn(5, 6, 7, dtype=dtype),), {}
            yield (randn(5, 6, 7, dtype=dtype),), {"s": (3, 10), "dim": (1, 2), "norm": "ortho"}
            yield (randn(5, 6, 7, dtype=dtype),), {"s": (6, 5), "norm": "forward"}
            yield (randn(5, 6, 7, dtype=dtype),), {"dim": (-1, 0)}
            yield (randn(5, 6, 7, dtype=dtype),), {"dim": 0}
            yield (randn(5, 6, 7, dtype=dtype),), {"s": (4, 9), "norm": "backward"}
            yield (randn(1, 2, dtype=dtype),), {}
            if kind == "n":
                yield (randn(5, 6, 7, dtype=dtype),), {"s": (8,)}
                yield (randn(5, 6, 7, dtype=dtype),), {"dim": (-3, -2, -1)}

    return _transform_rule(op, kind, aux_of, C2R.bwd, C2R.__doc__, samples)


for _op, _cj, _kind in ((torch.fft.irfft, False, "1"), (torch.fft.hfft, True, "1"),
                        (torch.fft.irfft2, False, "2"), (torch.fft.hfft2, True, "2"),
                        (torch.fft.irfftn, False, "n"), (torch.fft.hfftn, True, "n")):
    register_vjp(_op)(_c2r_rule(_op, _cj, _kind))


# ---------------------------------------------------------------------------------------------
# shifts
# ---------------------------------------------------------------------------------------------

class Shift:
    """fftshift / ifftshift (rolls by half the size over dims): each is the other's adjoint,
    so d_x = ifftshift(d, dim) resp. fftshift(d, dim) (derivatives.yaml via `roll`)."""


def _shift_rule(op: Any, adjoint: Any) -> type:
    class ShiftRule:
        source = Shift.__doc__

        def fwd(input, dim=None):
            return op(input, dim=dim), dim

        def bwd(aux, d):
            return (adjoint(d, dim=aux),)

        def jvp(primals, tangents):
            x, dim = primals
            t = tangents[0]
            return op(x, dim=dim), (None if t is None else op(t, dim=dim))

        def samples(dtype):
            yield (randn(9, 10, dtype=dtype),), {}
            yield (randn(5, dtype=dtype), 0), {}
            yield (randn(5, 11, dtype=dtype),), {"dim": (1,)}
            yield (randn(5, 6, 3, dtype=dtype),), {"dim": (0, 2)}
            yield (randn(5, 7, dtype=dtype),), {"dim": -1}

    return ShiftRule


register_vjp(torch.fft.fftshift)(_shift_rule(torch.fft.fftshift, torch.fft.ifftshift))
register_vjp(torch.fft.ifftshift)(_shift_rule(torch.fft.ifftshift, torch.fft.fftshift))


# ---------------------------------------------------------------------------------------------
# short-time Fourier transform
# ---------------------------------------------------------------------------------------------

def _frame_index(length: int, n_fft: int, hop: int, pad: int, mode: str, like: Any) -> Any:
    """(frames, n_fft) index into the signal (with one zero slot appended at ``length``) of
    each frame sample of the padded signal: frame t, sample k reads padded position
    t*hop + k, i.e. signal position s = t*hop + k - pad folded back by the pad mode."""
    n_frames = 1 + (length + 2 * pad - n_fft) // hop
    s = (torch.unsqueeze(torch.arange(n_frames, device=like.device) * hop, -1)
         + torch.arange(n_fft, device=like.device) - pad)
    if pad == 0:
        return s
    if mode == "reflect":
        s = torch.abs(s)
        return torch.where(s >= length, 2 * (length - 1) - s, s)
    if mode == "replicate":
        return torch.clamp(s, 0, length - 1)
    if mode == "circular":
        return torch.remainder(s, length)
    # constant (zero) padding: out-of-range samples read the zero slot
    return torch.where((s < 0) | (s >= length), length, s)


@register_vjp(torch.stft)
class Stft:
    """stft(x, n_fft, hop, win, window, ...): with frames f[t, k] = x_pad[t*hop + k] and the
    window w zero-padded to n_fft, out[f, t] = fft_k(w[k] f[t, k]) (one-sided: bins
    0..n_fft//2; normalized: norm="ortho").  Backward: D = adjoint of the fft on the
    transposed cotangent (zero-extend the one-sided bins, ifft with the dual norm, as for
    `_fft_r2c`/`_fft_c2c`); d_x = overlap-add (index_add through the framing/padding index
    map) of D conj(w); d_w = sum over frames of D conj(f), cropped to win_length (real parts
    for real inputs).  The padding (center, align_to_window, pad_mode) is folded into the
    index map, so every pad mode's adjoint is the same scatter-add (derivatives.yaml `stft`
    is a composite of pad, unfold, mul and `_fft_r2c`/`_fft_c2c`; this is the adjoint of that
    composition)."""

    def fwd(input, n_fft, hop_length=None, win_length=None, window=None, center=True,
            pad_mode="reflect", normalized=False, onesided=None, return_complex=None,
            align_to_window=None):
        out = torch.stft(input, n_fft, hop_length=hop_length, win_length=win_length,
                         window=window, center=center, pad_mode=pad_mode,
                         normalized=normalized, onesided=onesided,
                         return_complex=return_complex, align_to_window=align_to_window)
        hop = n_fft // 4 if hop_length is None else hop_length
        win = n_fft if win_length is None else win_length
        cplx = input.is_complex() or (window is not None and window.is_complex())
        if center:
            pad = n_fft // 2
        elif align_to_window:
            pad = (n_fft - win) // 2
        else:
            pad = 0
        side = not cplx if onesided is None else onesided
        ret_c = cplx if return_complex is None else return_complex
        return out, (input, window, n_fft, hop, win, pad, pad_mode,
                     "ortho" if normalized else "backward", side, ret_c)

    def bwd(aux, d):
        x, window, n_fft, hop, win, pad, mode, norm, side, ret_c = aux
        if not ret_c:  # a real view (..., 2) of the complex result
            d = torch.complex(torch.select(d, -1, 0), torch.select(d, -1, 1))
        g = torch.transpose(d, -1, -2)  # (..., frames, bins)
        if side:
            g = _fit(g, -1 % g.dim(), n_fft)
        dframes = torch.fft.ifft(g, dim=-1, norm=_DUAL[norm])  # cotangent of windowed frames
        length = x.shape[-1]
        idx = _frame_index(length, n_fft, hop, pad, mode, x)
        left = (n_fft - win) // 2
        d_x = d_w = None
        if window is not None:
            w = torch.conj(window) if window.is_complex() else window
            d_fx = dframes * (w if win == n_fft else F.pad(w, [left, n_fft - win - left]))
        elif win < n_fft:  # no window but a shorter win_length: a zero-padded box window
            box = torch.ones(win, dtype=x.real.dtype if x.is_complex() else x.dtype,
                             device=x.device)
            d_fx = dframes * F.pad(box, [left, n_fft - win - left])
        else:
            d_fx = dframes
        if not x.is_complex():
            d_fx = torch.real(d_fx)
        slots = torch.zeros(x.shape[:-1] + (length + 1,), dtype=d_fx.dtype, device=d_fx.device)
        d_x = torch.narrow(torch.index_add(slots, -1, torch.flatten(idx),
                                           torch.flatten(d_fx, -2)), -1, 0, length)
        if window is not None:
            frames = torch.index_select(F.pad(x, [0, 1]), -1, torch.flatten(idx))
            frames = torch.unflatten(frames, -1, tuple(idx.shape))  # (..., frames, n_fft)
            frames = torch.conj(frames) if x.is_complex() else frames
            dims = tuple(range(dframes.dim() - 1))
            d_w = torch.sum(dframes * frames, dims)
            if not window.is_complex():
                d_w = torch.real(d_w)
            if win < n_fft:
                d_w = torch.narrow(d_w, 0, left, win)
        return {"input": d_x, "window": d_w}

    def jvp(primals, tangents):
        x, n_fft, hop, win, window, center, mode, normalized, onesided, ret_c, align = primals
        t_x, t_w = tangents[0], tangents[4]

        def stft(a, w):
            return torch.stft(a, n_fft, hop_length=hop, win_length=win, window=w,
                              center=center, pad_mode=mode, normalized=normalized,
                              onesided=onesided, return_complex=ret_c, align_to_window=align)

        out = stft(x, window)
        t = None if t_x is None else stft(t_x, window)
        if t_w is not None:
            tw = stft(x, t_w)
            t = tw if t is None else t + tw
        return out, t

    def samples(dtype):
        yield (randn(40, dtype=dtype), 10), {"return_complex": True}
        yield (randn(40, dtype=dtype), 10), {"return_complex": False}
        yield (randn(10, dtype=dtype), 7), {"center": False, "return_complex": True}
        yield (randn(3, 50, dtype=dtype), 16), {"hop_length": 4, "center": False,
                                                "return_complex": True}
        yield (randn(2, 50, dtype=dtype), 16), {"window": randn(16, dtype=dtype),
                                                "return_complex": True, "normalized": True}
        yield (randn(2, 50, dtype=dtype), 16), {"window": randn(16, dtype=dtype),
                                                "onesided": False, "return_complex": True}
        yield (randn(2, 50, dtype=dtype), 16), {"window": randn(10, dtype=dtype),
                                                "win_length": 10, "hop_length": 3,
                                                "return_complex": True}
        yield (randn(30, dtype=dtype), 12), {"win_length": 7, "return_complex": True}
        for mode in ("constant", "replicate", "circular"):
            yield (randn(30, dtype=dtype), 12), {"pad_mode": mode, "hop_length": 5,
                                                 "return_complex": True}
        yield (randn(30, dtype=dtype), 12), {"window": randn(8, dtype=dtype),
                                             "win_length": 8, "center": False,
                                             "align_to_window": True, "return_complex": True}
