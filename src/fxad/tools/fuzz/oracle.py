"""The fuzzer's oracle: eager PyTorch (autograd, forward-mode AD) against fxad, in float64.

This module is self-contained (it imports only torch and fxad) because its source is copied
verbatim into every reproducer the fuzzer writes: a reproducer runs exactly these checks.

Each mode has three steps, kept apart so that the fuzzer can tell what failed:
``eager_*`` (the reference; an exception there means the program is invalid), ``fxad_*``
(build and run fxad's code; an exception there is a refusal or a crash), ``compare_*``
(raises :class:`Mismatch` on any wrong value, shape, dtype or missing derivative).
"""
import random

import torch
import fxad
from torch.autograd import forward_ad as fwAD

RTOL = 1e-7  # relative tolerance (float64)
ATOL = 1e-9  # absolute tolerance, plus RTOL times the largest |entry| of the reference


class Mismatch(AssertionError):
    """fxad's result differs from the reference."""


def _flat(out):
    return list(out) if isinstance(out, tuple) else [out]


def _is_float(t):
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def cotangents(outs, seed):
    """One random cotangent per floating output (None for the others)."""
    gen = torch.Generator().manual_seed(seed + 1)
    return [torch.randn(o.shape, dtype=o.dtype, generator=gen) if _is_float(o) else None
            for o in outs]


def tangents(inputs, seed):
    """One random tangent per floating input (None for the others)."""
    gen = torch.Generator().manual_seed(seed + 2)
    return [torch.randn(x.shape, dtype=x.dtype, generator=gen) if _is_float(x) else None
            for x in inputs]


def eager_reverse(f, inputs, seed):
    """Reference outputs, cotangents and input gradients (torch.autograd.grad)."""
    leaves = [x.detach().clone().requires_grad_(True) if _is_float(x) else x for x in inputs]
    out = f(*leaves)
    outs = _flat(out)
    cots = cotangents(outs, seed)
    diff = [(o, c) for o, c in zip(outs, cots) if c is not None and o.requires_grad]
    wrt = [x for x in leaves if _is_float(x)]
    grads = [None] * len(wrt)
    if diff and wrt:
        grads = list(torch.autograd.grad([o for o, _ in diff], wrt, [c for _, c in diff],
                                         allow_unused=True))
    it = iter(grads)
    grads = [next(it) if _is_float(x) else None for x in inputs]
    return {"outputs": [o.detach().clone() for o in outs], "cotangents": cots,
            "grads": grads, "single": not isinstance(out, tuple)}


def fxad_reverse(f, inputs, expected):
    """fxad.vjp's outputs and input gradients, for the reference's cotangents."""
    g = fxad.vjp(f, *inputs)
    return run_vjp(g, inputs, expected)


def run_vjp(g, inputs, expected):
    saved = [x.clone() for x in inputs]
    cots = expected["cotangents"]
    out, grads = g(*inputs, cots[0] if expected["single"] else tuple(cots))
    for k, (x, s) in enumerate(zip(inputs, saved)):
        if not torch.equal(x, s):
            raise Mismatch(f"reverse: fxad's generated code modified input {k}")
    return {"outputs": _flat(out), "grads": list(grads)}


def eager_forward(f, inputs, seed):
    """Reference outputs and output tangents (torch.autograd.forward_ad)."""
    tans = tangents(inputs, seed)
    with fwAD.dual_level():
        duals = [fwAD.make_dual(x, t) if t is not None else x for x, t in zip(inputs, tans)]
        out = f(*duals)
        outs = []
        for o in _flat(out):
            if isinstance(o, torch.Tensor):
                p, t = fwAD.unpack_dual(o)
                outs.append((p.clone(), None if t is None else t.clone()))
            else:
                outs.append((o, None))
    return {"outputs": [p for p, _ in outs], "tangents": [t for _, t in outs],
            "input_tangents": tans, "single": not isinstance(out, tuple)}


def fxad_forward(f, inputs, expected):
    """fxad.jvp's outputs and output tangents, for the reference's input tangents."""
    j = fxad.jvp(f, *inputs)
    return run_jvp(j, inputs, expected)


def run_jvp(j, inputs, expected):
    saved = [x.clone() for x in inputs]
    out, tan = j(*inputs, *expected["input_tangents"])
    for k, (x, s) in enumerate(zip(inputs, saved)):
        if not torch.equal(x, s):
            raise Mismatch(f"forward: fxad's generated code modified input {k}")
    if expected["single"]:
        return {"outputs": [out], "tangents": [tan]}
    if not isinstance(out, tuple) or not isinstance(tan, tuple):
        raise Mismatch(f"forward: expected tuples of outputs and tangents, got "
                       f"{type(out).__name__} and {type(tan).__name__}")
    return {"outputs": list(out), "tangents": list(tan)}


def _close(what, got, want, *, derivative):
    """``got`` (fxad) against ``want`` (reference).  For a derivative, None on either side
    means zero; a missing (None) fxad derivative where the reference is nonzero is wrong."""
    if derivative and want is None and got is None:
        return
    if not isinstance(got, torch.Tensor) and got is not None:
        raise Mismatch(f"{what}: fxad returned {type(got).__name__}, expected a tensor")
    if want is None:  # the reference has no derivative here: fxad's must be zero
        if got is not None and got.is_floating_point() and got.abs().max() > ATOL:
            raise Mismatch(f"{what}: expected zero (no dependence), fxad gives max "
                           f"|value| {got.abs().max().item():.3g}")
        return
    if got is None:
        if not derivative:
            raise Mismatch(f"{what}: fxad returned None, expected {tuple(want.shape)}")
        if want.numel() and want.abs().max() > ATOL:
            raise Mismatch(f"{what}: fxad returned None (zero), expected max |value| "
                           f"{want.abs().max().item():.3g}")
        return
    if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
        raise Mismatch(f"{what}: fxad gives {got.dtype} {tuple(got.shape)}, expected "
                       f"{want.dtype} {tuple(want.shape)}")
    if not got.is_floating_point():
        if not torch.equal(got, want):
            raise Mismatch(f"{what}: integer values differ")
        return
    # absolute tolerance scaled by the tensor's largest entry: an entry that cancels to ~0
    # keeps the rounding of its terms (PyTorch's own float64 kernels are not all exact: its
    # vectorized leaky_relu backward multiplies by a float32 slope, 1.5e-8 relative)
    scale = want.abs().nan_to_num(0.0, 0.0, 0.0).max().item() if want.numel() else 0.0
    try:
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL + RTOL * scale,
                                   equal_nan=True)
    except AssertionError as e:
        raise Mismatch(f"{what}: values differ\n{e}") from None


def compare_reverse(expected, got, input_names):
    outs_w, outs_g = expected["outputs"], got["outputs"]
    if len(outs_g) != len(outs_w):
        raise Mismatch(f"reverse: {len(outs_g)} outputs, expected {len(outs_w)}")
    for k, (g, w) in enumerate(zip(outs_g, outs_w)):
        _close(f"reverse: output {k}", g, w, derivative=False)
    if len(got["grads"]) != len(input_names):
        raise Mismatch(f"reverse: {len(got['grads'])} input gradients, expected "
                       f"{len(input_names)}")
    for name, g, w in zip(input_names, got["grads"], expected["grads"]):
        _close(f"reverse: gradient d_{name}", g, w, derivative=True)


def compare_forward(expected, got):
    outs_w, outs_g = expected["outputs"], got["outputs"]
    if len(outs_g) != len(outs_w):
        raise Mismatch(f"forward: {len(outs_g)} outputs, expected {len(outs_w)}")
    for k, (g, w) in enumerate(zip(outs_g, outs_w)):
        _close(f"forward: output {k}", g, w, derivative=False)
    for k, (g, w, o) in enumerate(zip(got["tangents"], expected["tangents"], outs_w)):
        if not _is_float(o):
            continue
        _close(f"forward: tangent of output {k}", g, w, derivative=True)


DYNAMIC_SIZES = 3  # other sizes the dynamic mode checks a symbolic build at


def _same(a, b):
    """Two fxad results equal to 1e-12 (NaN equal to NaN)."""
    for x, y in zip(a["outputs"] + a["grads"], b["outputs"] + b["grads"]):
        if (x is None) != (y is None):
            return False
        if isinstance(x, torch.Tensor) and not torch.allclose(x, y, rtol=1e-12, atol=1e-12,
                                                              equal_nan=True):
            return False
    return True


def check_other_sizes(f, built, inputs, seed, names):
    """Check ``built`` (fxad.vjp on symbolic sizes) at DYNAMIC_SIZES other sizes its guards
    admit (size 1 first, then each symbolic size moved up by 1..4).  Raises
    :class:`Mismatch` on a wrong value (one that differs from eager PyTorch's and, beyond
    rounding, from a build at those sizes).  Sizes where eager PyTorch itself fails are
    skipped.  Returns how many sizes were checked (fewer where the guards admit no other
    size)."""
    spec = built.meta["fxad_input_spec"]
    symbols = spec.symbols
    if not symbols:
        return 0
    rng = random.Random(seed * 7919 + len(symbols))
    checked = 0
    for attempt in range(4 * DYNAMIC_SIZES):
        if checked == DYNAMIC_SIZES:
            break
        new: dict[tuple[int, int], int] = {}
        for members in symbols.values():
            i, _, d = members[0]
            old = inputs[i].shape[d]
            size = 1 if attempt == 0 and old != 1 else old + rng.randint(1, 4)
            new.update({(i2, d2): size for i2, _, d2 in members})
        gen = torch.Generator().manual_seed(seed + 100 + attempt)
        resized = []
        for i, x in enumerate(inputs):
            shape = tuple(new.get((i, d), n) for d, n in enumerate(x.shape))
            if x.is_floating_point():
                resized.append(torch.randn(shape, dtype=x.dtype, generator=gen))
            elif x.dtype == torch.bool:
                resized.append(torch.randint(0, 2, shape, generator=gen).bool())
            else:
                lo, hi = (int(x.min()), int(x.max())) if x.numel() else (0, 0)
                resized.append(torch.randint(lo, hi + 1, shape, generator=gen, dtype=x.dtype))
        resized = tuple(resized)
        if spec.admits(resized) is not None:
            continue
        try:
            expected = eager_reverse(f, resized, seed)
        except Exception:  # noqa: BLE001 - no reference at these sizes (an index past the
            continue       # end of a shrunk dimension); code fxad drops may not even run it
        got = run_vjp(built, resized, expected)
        try:
            compare_reverse(expected, got, names)
        except Mismatch as e:
            # a float32 step in a float64 program rounds differently from eager's order of
            # accumulation; that is the same in a build at these sizes (what the reverse
            # mode checks), so the symbolic build must then agree with that build exactly
            static = run_vjp(fxad.vjp(f, *resized), resized, expected)
            if not _same(got, static):
                raise Mismatch(f"dynamic, at shapes {[tuple(x.shape) for x in resized]}: "
                               f"{e}") from None
        checked += 1
    return checked
