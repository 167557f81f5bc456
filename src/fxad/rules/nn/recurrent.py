"""Rules for the recurrent networks, written out as torch-level code.

* ``torch.rnn_tanh``, ``torch.rnn_relu``, ``torch.lstm``, ``torch.gru``: what ``nn.RNN``,
  ``nn.LSTM`` and ``nn.GRU`` call (``torch._VF``), on a padded batch (``batch_first`` or not)
  or on a ``PackedSequence`` (the overload taking ``data, batch_sizes``), with layers,
  bidirectional, initial states, LSTM ``proj_size`` and dropout between layers.
* ``torch.rnn_tanh_cell``, ``torch.rnn_relu_cell``, ``torch.lstm_cell``, ``torch.gru_cell``:
  what ``nn.RNNCell``, ``nn.LSTMCell`` and ``nn.GRUCell`` call.

**Forward.**  The time loop is unrolled: the sequence length, and for a packed sequence the
batch size of every step, are fixed at capture.  Per layer and direction the input
projection of all time steps is one matmul before the loop (``x @ W_ih^T + b``, rows of all
steps stacked time-major: ``(T*B, F)``, or the packed rows), then one cell per step with
PyTorch's gate conventions (``torch/nn/modules/rnn.py`` docstrings, ATen ``RNN.cpp``)::

    LSTM  gates = x_proj[t] + h @ W_hh^T;  i, f, g, o = gates.chunk(4, 1)
          c = f * c + i * g  (with sigmoid i, f, o and tanh g);  h = o * tanh(c)  [@ W_hr^T]
    GRU   gh = h @ W_hh^T + b_hh;  r, z = sigmoid(x_rz[t] + gh_rz).chunk(2, 1)
          n = tanh(x_n[t] + r * gh_n)  (b_hn inside the reset product);  h = lerp(n, h, z)
    RNN   h = tanh(x_proj[t] + h @ W_hh^T)   (or relu)

The reverse direction of a bidirectional layer runs the same cell from the last step to the
first; the two directions' outputs are concatenated on the feature dimension and feed the
next layer.  Dropout between layers (training, ``dropout > 0``) draws its mask as eager
PyTorch does on the CPU (``empty_like(y).bernoulli_(1 - p) / (1 - p)``, ATen's
``dropout``), so the same seed gives the same mask.  With a packed sequence only the first
``batch_sizes[t]`` rows are active at step ``t`` (sequences sorted by decreasing length):
rows leave the loop when their sequence ends (their last state is their ``h_n``), and, in
the reverse direction, join it from ``h_0`` at their last element.

**Backward** (backpropagation through time, the same loop reversed).  The per-step gate
activations are saved; the derivative factors of all steps (``sigmoid' = s (1 - s)``,
``tanh' = 1 - t^2``, and their products with the other gates) are computed at once before
the reverse loop, whose per-step work is the recurrent matmul and a few products carrying
``(d_h, d_c)``; the weight and bias gradients are one matmul (one sum) over all steps
after it: ``d_W_hh = d_gates^T @ h_prev`` with the gate cotangents of every step stacked.
The input cotangent is ``d_gates @ W_ih``, also for all steps at once.  Forward mode
transposes the backward (see :mod:`fxad.rules.registry`).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from .._base import _add, _error, builtin, randn
from ..registry import needs_cotangent

_GATES = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}
_OPS = {"lstm": "torch.lstm", "gru": "torch.gru", "rnn_tanh": "torch.rnn_tanh",
        "rnn_relu": "torch.rnn_relu"}


# ---------------------------------------------------------------------------------------------
# Layout helpers
# ---------------------------------------------------------------------------------------------

def _is_packed(second: Any) -> bool:
    """The ``(data, batch_sizes, hx, ...)`` overload: the second argument is the int64
    ``batch_sizes`` tensor (the padded overload has ``hx`` there)."""
    v = second.node.meta.get("val") if isinstance(second, fx.Proxy) else second
    return isinstance(v, torch.Tensor) and not (v.is_floating_point() or v.is_complex())


def _constant_ints(t: Any, op: str) -> list[int]:
    """The values of a packed sequence's ``batch_sizes``: the unrolled loop needs them at
    transform time.  Read from a real tensor, a graph constant (``get_attr``), or the value
    capture recorded for it (``meta['fxad_value']``)."""
    if isinstance(t, torch.Tensor) and not isinstance(t, fx.Proxy) \
            and type(t).__name__ != "FakeTensor":
        return [int(v) for v in t.tolist()]
    node = getattr(t, "node", None)
    if node is not None:
        known = node.meta.get("fxad_value")
        if isinstance(known, torch.Tensor):
            return [int(v) for v in known.tolist()]
        if node.op == "get_attr":
            obj: Any = getattr(t.tracer, "root", None)
            try:
                for atom in str(node.target).split("."):
                    obj = getattr(obj, atom)
            except AttributeError:
                obj = None
            if isinstance(obj, torch.Tensor) and type(obj).__name__ != "FakeTensor":
                return [int(v) for v in obj.tolist()]
    raise _error(op, "the batch sizes of the packed sequence are not known when the code is "
                 "generated (fxad unrolls the time loop, one step per batch size)",
                 "pack the sequence with lengths fxad can read at capture: a Python list "
                 "(pack_padded_sequence(x, [5, 3, 2])) or a CPU tensor constant, not a "
                 "tensor input of the traced function")


def _rows(x: Any, sizes: list[int]) -> tuple:
    """``x`` (rows of all time steps, time-major) split into one block per step."""
    if len(sizes) == 1:
        return (x,)
    if all(s == sizes[0] for s in sizes):
        return x.split(sizes[0])
    return x.split(sizes)


def _cat_rows(parts: list) -> Any:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _linear(x: Any, w: Any, b: Any) -> Any:
    """``x @ w^T + b`` for 2-D ``x`` (one addmm)."""
    return torch.mm(x, w.t()) if b is None else torch.addmm(b, x, w.t())


def _pad_rows(top: Any, bottom: Any, n_top: int, n_bottom: int, like: Any) -> Any:
    """``cat([top, bottom])`` along rows, ``None`` standing for zeros (``None`` if both)."""
    if top is None and bottom is None:
        return None
    if top is None:
        return F.pad(bottom, (0, 0, n_top, 0))
    if bottom is None:
        return F.pad(top, (0, 0, 0, n_bottom))
    return torch.cat([top, bottom])


def _zeros_rows(n: int, like: Any) -> Any:
    return torch.zeros((n, like.shape[1]), dtype=like.dtype, device=like.device)


# ---------------------------------------------------------------------------------------------
# One direction of one layer
# ---------------------------------------------------------------------------------------------

class _Direction:
    """The forward of one layer-direction (its code written into the graph) and what its
    backward reads."""

    def __init__(self, kind: str, weights: tuple, sizes: list[int], reverse: bool) -> None:
        self.kind = kind
        self.w_ih, self.w_hh, self.b_ih, self.b_hh, self.w_hr = weights
        self.sizes = sizes
        self.order = list(range(len(sizes)))[::-1] if reverse else list(range(len(sizes)))
        self.hidden = self.w_hh.shape[1] if kind != "lstm" or self.w_hr is None \
            else self.w_hr.shape[1]
        self.saved: dict[str, dict[int, Any]] = {}
        self.h_prev: dict[int, Any] = {}
        self.c_prev: dict[int, Any] = {}

    def save(self, t: int, **values: Any) -> None:
        for k, v in values.items():
            self.saved.setdefault(k, {})[t] = v

    def all_steps(self, name: str, source: dict[int, Any] | None = None) -> Any:
        """The per-step values ``name`` of every step, in time order (rows like the input)."""
        d = self.saved[name] if source is None else source
        return _cat_rows([d[t] for t in range(len(self.sizes))])

    # -- forward ------------------------------------------------------------------------------
    def forward(self, x: Any, h0: Any, c0: Any) -> tuple[Any, Any, Any]:
        """``x``: ``(rows, features)`` input of all steps; returns the outputs of all steps
        ``(rows, hidden)``, and the final ``h`` (and ``c``) of every sequence."""
        self.x = x
        kind, sizes = self.kind, self.sizes
        if kind == "gru":
            proj = _linear(x, self.w_ih, self.b_ih)
            hs = self.w_hh.shape[1]
            x_rz, x_n = proj.split([2 * hs, hs], 1)
            steps = list(zip(_rows(x_rz, sizes), _rows(x_n, sizes)))
        else:
            bias = _add(self.b_ih, self.b_hh)
            steps = _rows(_linear(x, self.w_ih, bias), sizes)
        w_hh_t = self.w_hh.t()
        w_hr_t = self.w_hr.t() if self.w_hr is not None else None
        full = h0.shape[0]
        n = sizes[self.order[0]]
        h = h0 if n == full else h0[:n]
        c = None if c0 is None else (c0 if n == full else c0[:n])
        final: list[tuple[int, Any, Any]] = []  # (first row, h, c) of sequences that ended
        outputs: dict[int, Any] = {}
        for t in self.order:
            b = sizes[t]
            if b < n:  # sequences b..n ended at the previous step
                final.append((b, h[b:n], None if c is None else c[b:n]))
                h = h[:b]
                c = None if c is None else c[:b]
            elif b > n:  # (reverse direction) sequences n..b start here, from h_0
                h = torch.cat([h, h0[n:b]])
                c = None if c is None else torch.cat([c, c0[n:b]])
            n = b
            self.h_prev[t], self.c_prev[t] = h, c
            if kind == "lstm":
                h, c = self._lstm_step(t, steps[t], h, c, w_hh_t, w_hr_t)
            elif kind == "gru":
                h = self._gru_step(t, steps[t], h, w_hh_t)
            else:
                h = self._rnn_step(t, steps[t], h, w_hh_t)
            outputs[t] = h
        self.outputs = outputs
        self.n_end = n
        self.entered = sizes[self.order[0]]
        if final:
            final.sort(key=lambda e: e[0])
            h = torch.cat([h] + [e[1] for e in final])
            if c is not None:
                c = torch.cat([c] + [e[2] for e in final])
        y = self.all_steps("", outputs)
        return y, h, c

    def _lstm_step(self, t: int, x_t: Any, h: Any, c: Any, w_hh_t: Any, w_hr_t: Any) -> tuple:
        gates = torch.addmm(x_t, h, w_hh_t)
        i, f, g, o = gates.chunk(4, 1)
        i, f, g, o = torch.sigmoid(i), torch.sigmoid(f), torch.tanh(g), torch.sigmoid(o)
        c = torch.addcmul(f * c, i, g)  # f * c + i * g
        h = o * torch.tanh(c)
        if w_hr_t is not None:
            h = torch.mm(h, w_hr_t)
        self.save(t, i=i, f=f, g=g, o=o, c=c)
        return h, c

    def _gru_step(self, t: int, x_t: tuple, h: Any, w_hh_t: Any) -> Any:
        x_rz, x_n = x_t
        hs = h.shape[1]
        gh = torch.mm(h, w_hh_t) if self.b_hh is None else torch.addmm(self.b_hh, h, w_hh_t)
        gh_rz, gh_n = gh.split([2 * hs, hs], 1)
        r, z = torch.sigmoid(x_rz + gh_rz).chunk(2, 1)
        n = torch.tanh(x_n + r * gh_n)
        self.save(t, r=r, z=z, n=n, gh_n=gh_n)
        return torch.lerp(n, h, z)  # (1 - z) * n + z * h

    def _rnn_step(self, t: int, x_t: Any, h: Any, w_hh_t: Any) -> Any:
        pre = torch.addmm(x_t, h, w_hh_t)
        return torch.tanh(pre) if self.kind == "rnn_tanh" else torch.relu(pre)

    # -- backward -----------------------------------------------------------------------------
    def backward(self, d_y: Any, d_hn: Any, d_cn: Any) -> dict[str, Any]:
        """Cotangents of the input rows, ``h_0``/``c_0`` and the weights from those of the
        outputs of all steps (``d_y``), ``h_n`` and ``c_n`` (each may be ``None``)."""
        sizes, kind = self.sizes, self.kind
        T = len(sizes)
        d_ys = _rows(d_y, sizes) if d_y is not None else (None,) * T
        step = {"lstm": self._lstm_factors, "gru": self._gru_factors}.get(
            kind, self._rnn_factors)()
        n = self.n_end
        dh = None if d_hn is None else (d_hn if n == d_hn.shape[0] else d_hn[:n])
        dc = None if d_cn is None else (d_cn if n == d_cn.shape[0] else d_cn[:n])
        started: list[tuple[int, Any, Any]] = []  # cotangents of h_0 rows that joined later
        for k in range(T - 1, -1, -1):
            t = self.order[k]
            b = sizes[t]
            dh, dc = step(t, d_ys[t], dh, dc)
            before = sizes[self.order[k - 1]] if k > 0 else b
            if before > b:  # rows b..before ended at step k-1: their h_n / c_n cotangent
                like = self.h_prev[t]
                dh = _pad_rows(dh, None if d_hn is None else d_hn[b:before], b, before - b, like)
                dc = _pad_rows(dc, None if d_cn is None else d_cn[b:before], b, before - b,
                               like)
            elif before < b:  # rows before..b started at step k, from h_0 / c_0
                started.append((before, None if dh is None else dh[before:b],
                                None if dc is None else dc[before:b]))
                dh = None if dh is None else dh[:before]
                dc = None if dc is None else dc[:before]
        out = self._weight_grads()
        if started:
            started.sort(key=lambda e: e[0])
            rows = [self.entered] + [e[0] for e in started]
            dh = self._join(dh, [e[1] for e in started], rows)
            dc = self._join(dc, [e[2] for e in started], rows)
        out["h0"], out["c0"] = dh, dc
        return out

    def _join(self, first: Any, pieces: list, starts: list[int]) -> Any:
        if first is None and all(p is None for p in pieces):
            return None
        like = self.h_prev[self.order[-1]]
        ends = starts[1:] + [like.shape[0]]
        parts = [p if p is not None else _zeros_rows(e - s, like)
                 for p, s, e in zip([first] + pieces, starts, ends)]
        return torch.cat(parts)

    def _gate_grads(self, t: int, d: Any) -> None:
        self.d_gates[t] = d

    def _weight_grads(self) -> dict[str, Any]:
        """Weight and bias cotangents of all steps at once, and the cotangent of the input
        projection ``d_proj`` (rows of all steps)."""
        T = len(self.sizes)
        for t in range(T):  # steps no cotangent reached
            if self.d_gates.get(t) is None:
                self.d_gates[t] = torch.zeros_like(self.gate_like[t])
        d_gh = self.all_steps("", self.d_gates)  # cotangent of h @ W_hh^T (+ b_hh)
        h_prev = self.all_steps("", self.h_prev)
        out: dict[str, Any] = {"w_hh": torch.mm(d_gh.t(), h_prev)}
        if self.kind == "gru":
            hs = h_prev.shape[1] if self.w_hr is None else self.w_hh.shape[1]
            d_n = self.all_steps("", self.d_n)
            out["proj"] = torch.cat([d_gh[:, :2 * hs], d_n], 1)
            out["b_hh"] = d_gh.sum(0) if self.b_hh is not None else None
        else:
            out["proj"] = d_gh
            out["b_hh"] = torch.clone(d_gh.sum(0)) if self.b_hh is not None else None
        if self.w_hr is not None:
            d_h = self.all_steps("", self.d_h)
            m = self.all_steps("o") * torch.tanh(self.all_steps("c"))
            out["w_hr"] = torch.mm(d_h.t(), m)
        return out

    def _lstm_factors(self) -> Any:
        i, f, g, o = (self.all_steps(k) for k in "ifgo")
        c = self.all_steps("c")
        c_prev = self.all_steps("", self.c_prev)
        tc = torch.tanh(c)
        sizes = self.sizes
        dc_dh = _rows(o * (1 - tc * tc), sizes)  # d_c += d_h * o * tanh'(c)
        # d(gate pre-activations) = [d_c, d_c, d_c, d_h] * factor
        factor = _rows(torch.cat([g * i * (1 - i), c_prev * f * (1 - f), i * (1 - g * g),
                                  tc * o * (1 - o)], 1), sizes)
        forget = self.saved["f"]
        self.d_gates, self.d_h, self.gate_like = {}, {}, factor
        w_hh, w_hr = self.w_hh, self.w_hr

        def step(t: int, d_y: Any, dh: Any, dc: Any) -> tuple[Any, Any]:
            dh = _add(d_y, dh)
            if w_hr is not None:
                self.d_h[t] = dh if dh is not None else torch.zeros_like(self.h_prev[t][:, :0]
                                                                         ).new_zeros(())
                dh = None if dh is None else torch.mm(dh, w_hr)
            if dh is None and dc is None:
                return None, None
            dc = torch.addcmul(dc, dh, dc_dh[t]) if dc is not None and dh is not None \
                else (dc if dh is None else dh * dc_dh[t])
            dm = dh if dh is not None else torch.zeros_like(dc)
            d_gates = torch.cat([dc, dc, dc, dm], 1) * factor[t]
            self.d_gates[t] = d_gates
            return torch.mm(d_gates, w_hh), dc * forget[t]

        return step

    def _gru_factors(self) -> Any:
        r, z, n, gh_n = (self.all_steps(k) for k in ("r", "z", "n", "gh_n"))
        h_prev = self.all_steps("", self.h_prev)
        sizes = self.sizes
        d_n = (1 - z) * (1 - n * n)  # d(n pre-activation) = d_h * d_n
        d_r = d_n * gh_n * r * (1 - r)
        d_z = (h_prev - n) * z * (1 - z)
        factor = _rows(torch.cat([d_r, d_z, d_n * r], 1), sizes)  # d(h @ W_hh^T + b_hh)
        d_n_t = _rows(d_n, sizes)
        update = self.saved["z"]
        self.d_gates, self.d_n, self.gate_like = {}, {}, factor
        w_hh = self.w_hh

        def step(t: int, d_y: Any, dh: Any, dc: Any) -> tuple[Any, Any]:
            dh = _add(d_y, dh)
            if dh is None:
                self.d_n[t] = torch.zeros_like(d_n_t[t])
                return None, None
            d_gh = torch.cat([dh, dh, dh], 1) * factor[t]
            self.d_gates[t] = d_gh
            self.d_n[t] = dh * d_n_t[t]
            return torch.addmm(dh * update[t], d_gh, w_hh), None

        return step

    def _rnn_factors(self) -> Any:
        h = self.all_steps("", self.outputs)
        deriv = 1 - h * h if self.kind == "rnn_tanh" else (h > 0).to(h.dtype)
        factor = _rows(deriv, self.sizes)
        self.d_gates, self.gate_like = {}, factor
        w_hh = self.w_hh

        def step(t: int, d_y: Any, dh: Any, dc: Any) -> tuple[Any, Any]:
            dh = _add(d_y, dh)
            if dh is None:
                return None, None
            d_pre = dh * factor[t]
            self.d_gates[t] = d_pre
            return torch.mm(d_pre, w_hh), None

        return step


# ---------------------------------------------------------------------------------------------
# The layer stack (torch.lstm / gru / rnn_tanh / rnn_relu)
# ---------------------------------------------------------------------------------------------

def _split_weights(kind: str, params: list, has_biases: bool, num_layers: int,
                   bidirectional: bool) -> list[tuple]:
    """``(w_ih, w_hh, b_ih, b_hh, w_hr)`` per layer-direction, from the flat list in
    ``nn.RNNBase._flat_weights`` order."""
    dirs = 2 if bidirectional else 1
    per = len(params) // (num_layers * dirs)
    base = 4 if has_biases else 2
    if per not in (base, base + 1) or per * num_layers * dirs != len(params) \
            or (per == base + 1 and kind != "lstm"):
        raise _error(_OPS[kind], f"{len(params)} weights for {num_layers} layer(s) x {dirs} "
                     "direction(s) do not match the layout nn.RNNBase uses",
                     "call it through nn.RNN / nn.LSTM / nn.GRU")
    out = []
    for k in range(num_layers * dirs):
        w = params[k * per:(k + 1) * per]
        if has_biases:
            out.append((w[0], w[1], w[2], w[3], w[4] if per == 5 else None))
        else:
            out.append((w[0], w[1], None, None, w[2] if per == 3 else None))
    return out


def _dropout_mask(y: Any, p: float) -> Any:
    """ATen's CPU ``dropout`` between layers: ``empty_like(y).bernoulli_(1 - p) / (1 - p)``
    (the same random stream as eager PyTorch)."""
    if p >= 1.0:
        return torch.zeros_like(y)
    return torch.empty_like(y).bernoulli_(1.0 - p) / (1.0 - p)


class _Stack:
    """Normalized arguments of a layer-stack call (both overloads)."""

    def __init__(self, kind: str, args: tuple) -> None:
        self.kind = kind
        self.packed = _is_packed(args[1])
        if self.packed:
            (self.input, batch_sizes, self.hx, self.params, self.has_biases, self.num_layers,
             self.dropout, self.train, self.bidirectional) = args[:9]
            self.batch_first = False
            self.sizes = _constant_ints(batch_sizes, _OPS[kind])
        else:
            (self.input, self.hx, self.params, self.has_biases, self.num_layers,
             self.dropout, self.train, self.bidirectional, self.batch_first) = args[:9]
        self.params = list(self.params)


def _stack_fwd(kind: str, args: tuple) -> tuple[Any, Any]:
    s = _Stack(kind, args)
    dirs = 2 if s.bidirectional else 1
    weights = _split_weights(kind, s.params, s.has_biases, s.num_layers, s.bidirectional)
    x = s.input
    if s.packed:
        sizes = s.sizes
        rows = x
    else:
        if x.dim() != 3:
            raise _error(_OPS[kind], f"expected a 3-D input, got {x.dim()}-D",
                         "call it through nn.RNN / nn.LSTM / nn.GRU (which batch an "
                         "unbatched input)")
        if s.batch_first:
            x = x.transpose(0, 1)
        T, B = x.shape[0], x.shape[1]
        sizes = [B] * T
        rows = torch.reshape(x, (T * B, x.shape[2]))
    if kind == "lstm":
        h0s, c0s = s.hx[0].unbind(0), s.hx[1].unbind(0)
    else:
        h0s, c0s = s.hx.unbind(0), [None] * (s.num_layers * dirs)
    layers, masks, h_n, c_n = [], [], [], []
    p = float(s.dropout)
    for layer in range(s.num_layers):
        if layer > 0 and s.train and p > 0:
            mask = _dropout_mask(rows, p)
            rows = rows * mask
            masks.append(mask)
        else:
            masks.append(None)
        outs, ds = [], []
        for d in range(dirs):
            k = layer * dirs + d
            dr = _Direction(kind, weights[k], sizes, reverse=d == 1)
            y, h, c = dr.forward(rows, h0s[k], c0s[k])
            outs.append(y)
            ds.append(dr)
            h_n.append(h)
            c_n.append(c)
        layers.append(ds)
        rows = outs[0] if dirs == 1 else torch.cat(outs, 1)
    out = rows
    if not s.packed:
        out = torch.reshape(rows, (len(sizes), sizes[0], rows.shape[1]))
        if s.batch_first:
            out = out.transpose(0, 1)
    h_n_all = torch.stack(h_n)
    value = (out, h_n_all, torch.stack(c_n)) if kind == "lstm" else (out, h_n_all)
    aux = (s.packed, s.batch_first, sizes, layers, masks, dirs)
    return value, aux


def _stack_bwd(kind: str, aux: Any, d: Any) -> tuple:
    packed, batch_first, sizes, layers, masks, dirs = aux
    d_out, d_hn = d[0], d[1]
    d_cn = d[2] if kind == "lstm" else None
    if d_out is not None and not packed:
        if batch_first:
            d_out = d_out.transpose(0, 1)
        d_out = torch.reshape(d_out, (-1, d_out.shape[2]))
    d_hns = d_hn.unbind(0) if d_hn is not None else None
    d_cns = d_cn.unbind(0) if d_cn is not None else None
    n_dirs = len(layers) * dirs
    d_h0: list[Any] = [None] * n_dirs
    d_c0: list[Any] = [None] * n_dirs
    d_w: list[list[Any]] = [[None] * 5 for _ in range(n_dirs)]
    idx_input = 0
    for layer in range(len(layers) - 1, -1, -1):
        ds = layers[layer]
        d_rows = None
        for dd, dr in enumerate(ds):
            k = layer * dirs + dd
            dy = d_out
            if d_out is not None and dirs > 1:
                width = d_out.shape[1] // dirs
                dy = d_out[:, dd * width:(dd + 1) * width]
            g = dr.backward(dy, None if d_hns is None else d_hns[k],
                            None if d_cns is None else d_cns[k])
            d_h0[k], d_c0[k] = g["h0"], g["c0"]
            d_proj = g["proj"]
            d_w[k] = [torch.mm(d_proj.t(), dr.x), g["w_hh"],
                      d_proj.sum(0) if dr.b_ih is not None else None, g["b_hh"],
                      g.get("w_hr")]
            if layer > 0 or needs_cotangent("input"):
                dx = torch.mm(d_proj, dr.w_ih)
                d_rows = dx if d_rows is None else d_rows + dx
        if masks[layer] is not None and d_rows is not None:
            d_rows = d_rows * masks[layer]
        d_out = d_rows
    d_input = d_out
    if d_input is not None and not packed:
        T, B = len(sizes), sizes[0]
        d_input = torch.reshape(d_input, (T, B, d_input.shape[1]))
        if batch_first:
            d_input = d_input.transpose(0, 1)
    # flat weight cotangents, in params order
    ref = layers[0][0]
    has_b, has_r = ref.b_ih is not None, ref.w_hr is not None
    d_params: list[Any] = []
    for k in range(n_dirs):
        w_ih, w_hh, b_ih, b_hh, w_hr = d_w[k]
        d_params += [w_ih, w_hh] + ([b_ih, b_hh] if has_b else []) + ([w_hr] if has_r else [])

    def hidden(ds: list) -> Any:
        if all(v is None for v in ds):
            return None
        like = [dr for ls in layers for dr in ls]
        parts = [v if v is not None else torch.zeros_like(dr.h_prev[dr.order[0]][:0]).new_zeros(
            (sizes[0], dr.hidden)) for v, dr in zip(ds, like)]
        return torch.stack(parts)

    d_hx: Any = (hidden(d_h0), _stack_c(d_c0, layers)) if kind == "lstm" else hidden(d_h0)
    if packed:
        return (d_input, None, d_hx, d_params)
    return (d_input, d_hx, d_params)


def _stack_c(d_c0: list, layers: list) -> Any:
    if all(v is None for v in d_c0):
        return None
    drs = [dr for ls in layers for dr in ls]
    parts = [v if v is not None else torch.zeros_like(dr.c_prev[dr.order[0]]).new_zeros(
        (dr.h_prev[dr.order[0]].shape[0], dr.w_hh.shape[1])) for v, dr in zip(d_c0, drs)]
    return torch.stack(parts)
