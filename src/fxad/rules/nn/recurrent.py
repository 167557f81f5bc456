"""Rules for the recurrent networks, written out as torch-level code.

* ``torch.rnn_tanh``, ``torch.rnn_relu``, ``torch.lstm``, ``torch.gru``: what ``nn.RNN``,
  ``nn.LSTM`` and ``nn.GRU`` call (``torch._VF``), on a padded batch (``batch_first`` or not)
  or on a ``PackedSequence`` (the overload taking ``data, batch_sizes``), with layers,
  bidirectional, initial states, LSTM ``proj_size`` and dropout between layers.
* ``torch.rnn_tanh_cell``, ``torch.rnn_relu_cell``, ``torch.lstm_cell``, ``torch.gru_cell``:
  what ``nn.RNNCell``, ``nn.LSTMCell`` and ``nn.GRUCell`` call.

**Forward.**  The time loop is unrolled: the sequence length, and for a packed sequence the
batch size of every step, are fixed when the code is written.  Per layer and direction the
input projection of all time steps is one matmul before the loop (``x @ W_ih^T + b`` on the
rows of all steps, time-major: ``(T*B, F)``, or the packed rows), then one cell per step with
PyTorch's gate conventions (``torch/nn/modules/rnn.py``, ATen ``RNN.cpp``)::

    LSTM  gates = x_proj[t] + h @ W_hh^T;  i, f, g, o = gates.chunk(4, 1)
          c = f * c + i * g  (sigmoid i, f, o; tanh g);  h = o * tanh(c)  [@ W_hr^T]
    GRU   gh = h @ W_hh^T + b_hh;  r, z = sigmoid(x_rz[t] + gh_rz).chunk(2, 1)
          n = tanh(x_n[t] + r * gh_n)  (b_hn inside the reset product);  h = lerp(n, h, z)
    RNN   h = tanh(x_proj[t] + h @ W_hh^T)   (or relu)

Without an initial state (zeros, as ``nn.RNNBase`` makes them) the first step skips its
products with ``h_0``.  The reverse direction of a bidirectional layer runs the same cell
from the last step to the first; the two directions' outputs are concatenated on the
feature dimension and feed the next layer.  Dropout between layers (training,
``dropout > 0``) draws its mask as eager PyTorch does on the CPU
(``empty_like(y).bernoulli_(1 - p) / (1 - p)``, ATen's ``dropout``), so the same seed gives
the same masks.  With a packed sequence only the first ``batch_sizes[t]`` rows are active
at step ``t`` (sequences sorted by decreasing length): rows leave the loop when their
sequence ends (their last state is their ``h_n``) and, in the reverse direction, join it
from ``h_0`` at their last element.

**Backward** (backpropagation through time, the loop reversed).  The forward saves each
step's gate activations; the derivative factors of all steps (``sigmoid' = s (1 - s)``,
``tanh' = 1 - t^2`` and their products with the other gates) are computed at once before
the reverse loop, whose per-step work is the recurrent matmul (which also adds the previous
step's output cotangent: ``d_h = d_y[t-1] + d_gates @ W_hh``, one addmm) and a few products
carrying ``(d_h, d_c)``; the weight and bias cotangents are one matmul (one sum) over all
steps after it: ``d_W_hh = d_gates^T @ h_prev`` with the gate cotangents of every step
stacked, and the input's is ``d_gates @ W_ih``.  Forward mode (``jvp``) writes the tangents
step by step beside the values.

**Code built to run** (fused kernels at level ``"all"``: ``fxad.compile``,
``fxad.joint_step``; :mod:`fxad.rules.fused`): the gate factors use
``torch.ops.aten.sigmoid_backward`` / ``tanh_backward``, and a float32 CPU LSTM without
projections on a padded batch runs oneDNN's LSTM layer and its backward
(:func:`onednn_lstm_layer`, :func:`onednn_lstm_layer_backward`: ``aten.mkldnn_rnn_layer``
and ``aten.mkldnn_rnn_layer_backward``), exactly where eager ``nn.LSTM`` runs them (ATen
``use_mkldnn``), with autograd's values bit for bit; the unrolled Python-level loop cannot
match that fused kernel's speed on the CPU.

**Packed sequences need their batch sizes when the code is written**: a real or constant
(``get_attr``) ``batch_sizes`` tensor, or one whose node carries the value capture recorded
(``meta['fxad_value']``); otherwise the rule raises a :class:`~fxad.errors.RuleError`
saying so.  (Capture does not record ``pack_padded_sequence`` yet: its output shape depends
on the lengths' values.)
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable

import torch
import torch.fx as fx

from .. import fused
from .._base import _add, _error, randn, value_of
from ..registry import needs_cotangent, register_vjp
from ...naming import code_builtin

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
    """The values of a packed sequence's ``batch_sizes``: the unrolled loop needs them when
    the code is written.  Read from a real tensor, a graph constant (``get_attr``), or the
    value capture recorded for the node (``meta['fxad_value']``)."""
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
                 "written (fxad unrolls the time loop, one step per batch size): they must be a "
                 "constant of the program or values capture recorded",
                 "run the network on the padded batch instead; for a unidirectional network "
                 "the outputs of each sequence's steps, and its final state "
                 "(out[lengths - 1, arange(B)]), are the packed run's")


def _is_zeros(t: Any) -> bool:
    """``t`` is made by ``torch.zeros`` in the graph (what ``nn.RNNBase`` and the cells use
    when no initial state is given)."""
    node = getattr(t, "node", None)
    zeros = getattr(torch.zeros, "__wrapped__", torch.zeros)
    return node is not None and node.op == "call_function" and node.target is zeros


def _rows(x: Any, sizes: list[int]) -> tuple:
    """``x`` (rows of all time steps, time-major) split into one block of rows per step."""
    if len(sizes) == 1:
        return (x,)
    if all(s == sizes[0] for s in sizes):
        return x.split(sizes[0])
    return x.split(sizes)


def _linear(x: Any, w: Any, b: Any) -> Any:
    """``x @ w^T + b`` for a 2-D ``x`` (one addmm)."""
    return torch.mm(x, w.t()) if b is None else torch.addmm(b, x, w.t())


def _mm_t(a: Any, w: Any) -> Any:
    """``a @ w^T``, ``None`` (zero) if either is."""
    return None if a is None or w is None else torch.mm(a, w.t())


def _mm_add(c: Any, a: Any, b: Any) -> Any:
    """``c + a @ b`` (one addmm), ``a @ b`` when ``c`` is ``None``."""
    return torch.mm(a, b) if c is None else torch.addmm(c, a, b)


def _sigmoid_grad(d: Any, s: Any) -> Any:
    """``d * s * (1 - s)`` for ``s = sigmoid(x)``: in code built to run (fused level
    ``"all"``) one kernel, ``torch.ops.aten.sigmoid_backward``."""
    if fused.enabled("all"):
        return torch.ops.aten.sigmoid_backward(d, s)
    return d * (s * (1 - s))


def _tanh_grad(d: Any, t: Any) -> Any:
    """``d * (1 - t^2)`` for ``t = tanh(x)`` (level ``"all"``: ``aten.tanh_backward``; ``d``
    may be the number 1)."""
    if isinstance(d, (int, float)) and d == 1:
        return 1 - t * t
    if fused.enabled("all"):
        return torch.ops.aten.tanh_backward(d, t)
    return d * (1 - t * t)


def _zeros(rows: int, cols: int, like: Any) -> Any:
    return torch.zeros((rows, cols), dtype=like.dtype, device=like.device)


def _join_rows(parts: list, starts: list[int], total: int, cols: int, like: Any) -> Any:
    """``cat(parts)`` along rows, part ``k`` holding rows ``starts[k]`` to the next start (or
    ``total``); ``None`` parts are zeros; ``None`` when every part is."""
    if all(p is None for p in parts):
        return None
    ends = starts[1:] + [total]
    full = [p if p is not None else _zeros(e - s, cols, like)
            for p, s, e in zip(parts, starts, ends)]
    return full[0] if len(full) == 1 else torch.cat(full)


# ---------------------------------------------------------------------------------------------
# One direction of one layer
# ---------------------------------------------------------------------------------------------

class _Direction:
    """One layer-direction: its forward (the unrolled loop, written into the graph by
    :meth:`forward`) and its backward (:meth:`backward`, reading what the forward saved).

    Per-step values are kept by time step ``t``; "all steps" means their rows concatenated
    in time order, the layout of the input rows (``(T*B, .)`` time-major, or packed).

    Why a hand-written loop and not the generic ``scan`` machinery
    (:mod:`fxad.ad.control_flow`), which differentiates any recurrence: the scan's reverse
    mode calls the body's generated VJP once per step, recomputing the step's forward inside
    it, through a Python loop over two GraphModule calls per step; this class writes the
    unrolled loop into the code, saves the gates of each step and batches the weight
    gradients of all steps into one matmul.  ``benchmarks/bench_rnn_scan.py`` (an LSTM layer,
    seq 32, batch 16, 64→128, float32, forward+backward, 1 thread; 2-core x86-64 CPU, torch
    2.13.0, 2026-11-25): autograd on ``nn.LSTM`` 8.5 ms, this rule 9.4 ms, the same cell as a
    ``scan`` body 33.8 ms (3.6× this rule's time, paired median), with equal gradients."""

    def __init__(self, kind: str, weights: tuple, sizes: list[int], reverse: bool,
                 prefix: str | None = "") -> None:
        self.kind = kind
        # names of the values in the code: ``h_t3``, ``rev_c_t0``, ``l1_gates_t5``,
        # ``d_h_t2``; ``prefix=None``: one step (a cell), named ``h``, ``gates``...
        self.prefix = prefix
        self.w_ih, self.w_hh, self.b_ih, self.b_hh, self.w_hr = weights
        self.sizes = sizes
        steps = list(range(len(sizes)))
        self.order = steps[::-1] if reverse else steps   # processing order of the time steps
        self.saved: dict[str, dict[int, Any]] = {}
        self.stacked: dict[str, Any] = {}  # per-step values of all steps in one tensor

    def name(self, value: Any, what: str, t: int) -> Any:
        """Name the node of ``value`` (a proxy this rule just wrote) after ``what`` at step
        ``t``; returns ``value``."""
        node = getattr(value, "node", None)
        if node is not None and node.op in ("placeholder", "get_attr"):
            return value
        if node is not None and self.prefix is not None:
            node._rename(f"{self.prefix}{what}" + (f"_t{t}" if t >= 0 else "_all"))
        elif node is not None:
            node._rename(what)
        return value

    def save(self, t: int, **values: Any) -> None:
        for k, v in values.items():
            self.saved.setdefault(k, {})[t] = v

    def all_steps(self, name: str) -> Any:
        """The saved values ``name`` of all steps, one tensor (named ``<name>_all``)."""
        if name in self.stacked:
            return self.stacked[name]
        sizes = self.sizes
        uniform = all(b == sizes[0] for b in sizes)
        if name in ("h_prev", "c_prev") and uniform and len(sizes) > 1:
            # the states each step read: the first step's initial state and the outputs of
            # all but the last step, in time order
            first = self.saved[name][self.order[0]]
            outs = self.all_steps(name[0])
            b = sizes[0]
            out = torch.cat([first, outs[:-b]] if self.order[0] == 0 else [outs[b:], first])
        else:
            out = self.cat_steps(self.saved[name], None)
        if len(sizes) > 1 and self.prefix is not None:
            out.node._rename(f"{self.prefix}{name}_all")
        self.stacked[name] = out
        return out

    def cat_steps(self, per_step: dict[int, Any], cols: int | None) -> Any:
        """Rows of all steps in time order; a missing step (``None``) is zeros of ``cols``
        columns."""
        parts = [per_step.get(t) for t in range(len(self.sizes))]
        if any(p is None for p in parts):
            parts = [p if p is not None else _zeros(b, cols, self.like)
                     for p, b in zip(parts, self.sizes)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    # -- forward ------------------------------------------------------------------------------
    def forward(self, x: Any, h0: Any, c0: Any, zero: bool = False,
                tan: tuple | None = None) -> tuple:
        """``x``: the input rows of all steps; ``zero``: ``h_0`` (and ``c_0``) are zeros (the
        first step then skips its products with them).  Returns the output rows of all
        steps, and the final ``h`` (and ``c``) of every sequence.

        Forward mode: ``tan = (t_x, t_h0, t_c0, t_weights)`` (``None`` for zero tangents)
        also writes the tangents, step by step beside the values, and returns
        ``(y, h, c, t_y, t_h, t_c)``."""
        kind, sizes = self.kind, self.sizes
        self.x, self.like = x, h0
        self.batch, self.h_size = h0.shape[0], h0.shape[1]
        self.c_size = None if c0 is None else c0.shape[1]
        hs = self.h_size
        pre = "" if self.prefix is None else self.prefix
        if kind == "gru":
            proj = _linear(x, self.w_ih, self.b_ih)
            proj.node._rename(f"{pre}x_proj")  # the input projection of all steps
            x_rz, x_n = proj.split([2 * hs, hs], 1)
            steps: Any = list(zip(_rows(x_rz, sizes), _rows(x_n, sizes)))
        else:
            proj = _linear(x, self.w_ih, _add(self.b_ih, self.b_hh))
            proj.node._rename(f"{pre}x_proj")
            steps = _rows(proj, sizes)
        w_hh_t = self.w_hh.t()
        w_hr_t = None if self.w_hr is None else self.w_hr.t()
        t_steps: Any = [None] * len(sizes)
        th = tc = th0 = tc0 = None
        if tan is not None:
            tx, th0, tc0, tw = tan
            self.tw = tw
            t_proj = _add(_add(_mm_t(tx, self.w_ih), _mm_t(x, tw[0])),
                          tw[2] if kind == "gru" else _add(tw[2], tw[3]))
            if t_proj is not None:
                if kind == "gru":
                    t_rz, t_n = t_proj.split([2 * hs, hs], 1)
                    t_steps = list(zip(_rows(t_rz, sizes), _rows(t_n, sizes)))
                else:
                    t_steps = list(_rows(t_proj, sizes))
        n = sizes[self.order[0]]
        h = h0 if n == self.batch else h0[:n]
        c = None if c0 is None else (c0 if n == self.batch else c0[:n])
        if tan is not None:
            th = None if th0 is None else (th0 if n == self.batch else th0[:n])
            tc = None if tc0 is None else (tc0 if n == self.batch else tc0[:n])
        ended: list[tuple] = []  # (first row, h, c, t_h, t_c) of sequences that ended
        t_out: dict[int, Any] = {}
        for t in self.order:
            b = sizes[t]
            if b < n:  # sequences b..n ended at the previous step
                ended.append((b, h[b:n], None if c is None else c[b:n],
                              None if th is None else th[b:n], None if tc is None else tc[b:n]))
                h, c = h[:b], None if c is None else c[:b]
                th, tc = None if th is None else th[:b], None if tc is None else tc[:b]
            elif b > n:  # (reverse direction, packed) sequences n..b start here, from h_0
                h = torch.cat([h, h0[n:b]])
                c = None if c is None else torch.cat([c, c0[n:b]])
                if tan is not None:
                    th = _join_rows([th, None if th0 is None else th0[n:b]], [0, n], b, hs, h0)
                    if c is not None:
                        tc = _join_rows([tc, None if tc0 is None else tc0[n:b]], [0, n], b,
                                        self.c_size, h0)
            n = b
            self.save(t, h_prev=h, c_prev=c)
            first_zero = zero and t == self.order[0]
            h_prev, c_prev = h, c
            x_t = tuple(self.name(v, w, t) for v, w in zip(steps[t], ("x_rz", "x_n"))) \
                if kind == "gru" else self.name(steps[t], "x_proj", t)
            if kind == "lstm":
                h, c = self._lstm_step(t, x_t, h, c, w_hh_t, w_hr_t, first_zero)
            elif kind == "gru":
                h = self._gru_step(t, x_t, h, w_hh_t, first_zero)
            else:
                h = self._rnn_step(t, x_t, h, w_hh_t, first_zero)
            self.save(t, h=h)
            if tan is not None:
                th, tc = self._tangent_step(t, t_steps[t], th, tc, h_prev, c_prev, first_zero)
                if th is not None and tuple(th.shape) != (b, hs):  # (a broadcast bias tangent)
                    th = th.expand(b, hs)
                t_out[t] = th
        self.last_rows = n
        if ended:
            ended.sort(key=lambda e: e[0])
            starts = [0] + [e[0] for e in ended]
            h = torch.cat([h] + [e[1] for e in ended])
            c = None if c is None else torch.cat([c] + [e[2] for e in ended])
            if tan is not None:
                th = _join_rows([th] + [e[3] for e in ended], starts, self.batch, hs, h0)
                if c is not None:
                    tc = _join_rows([tc] + [e[4] for e in ended], starts, self.batch,
                                    self.c_size, h0)
        y = self.all_steps("h")
        if tan is None:
            # what the backward reads, stacked here in the forward (saved as a few tensors
            # rather than a few per step)
            for name in {"lstm": "ifgoc", "gru": ("r", "z", "n", "gh_n")}.get(kind, ()):
                self.all_steps(name)
            return y, h, c
        t_y = None if all(v is None for v in t_out.values()) else self.cat_steps(t_out, hs)
        return y, h, c, t_y, th, tc

    def _tangent_step(self, t: int, tx: Any, th: Any, tc: Any, h: Any, c: Any,
                      zero: bool) -> tuple[Any, Any]:
        """Tangents of the new ``h`` (and ``c``) of step ``t`` from those of the input
        projection ``tx``, of the previous ``h`` / ``c`` and of the weights (``self.tw``);
        ``h``, ``c``: the previous state."""
        tw_ih, tw_hh, tb_ih, tb_hh, tw_hr = self.tw
        sv = {k: v[t] for k, v in self.saved.items()}
        hs = self.h_size
        if self.kind == "gru":
            tx_rz, tx_n = (None, None) if tx is None else tx
            t_gh = _add(tb_hh, None if zero else _add(_mm_t(th, self.w_hh), _mm_t(h, tw_hh)))
            t_gh_rz = None if t_gh is None else t_gh[..., :2 * hs]
            t_gh_n = None if t_gh is None else t_gh[..., 2 * hs:]
            r, z, n, gh_n = sv["r"], sv["z"], sv["n"], sv["gh_n"]
            t_rz = _add(tx_rz, t_gh_rz)
            tr, tz = (None, None) if t_rz is None else t_rz.chunk(2, -1)
            tr = None if tr is None else r * (1 - r) * tr
            tz = None if tz is None else z * (1 - z) * tz
            t_np = _add(tx_n, _add(None if tr is None else tr * gh_n,
                                   None if t_gh_n is None else r * t_gh_n))
            tn = None if t_np is None else (1 - n * n) * t_np
            t_h = _add(None if tn is None else (1 - z) * tn,
                       _add(None if th is None or zero else z * th,
                            None if tz is None else tz * (h - n)))
            return t_h, None
        t_pre = _add(tx, None if zero else _add(_mm_t(th, self.w_hh), _mm_t(h, tw_hh)))
        if self.kind != "lstm":
            h_new = sv["h"]
            if t_pre is None:
                return None, None
            d = 1 - h_new * h_new if self.kind == "rnn_tanh" else (h_new > 0).to(h_new.dtype)
            return d * t_pre, None
        i, f, g, o, c_new = sv["i"], sv["f"], sv["g"], sv["o"], sv["c"]
        if t_pre is None:
            ti = tf = tg = to = None
        else:
            ti, tf, tg, to = t_pre.chunk(4, 1)
            ti, tf = i * (1 - i) * ti, f * (1 - f) * tf
            tg, to = (1 - g * g) * tg, o * (1 - o) * to
        t_c = _add(_add(None if tf is None or zero else tf * c,
                        None if tc is None or zero else f * tc),
                   _add(None if ti is None else ti * g, None if tg is None else i * tg))
        tanh_c = torch.tanh(c_new)
        t_h = _add(None if to is None else to * tanh_c,
                   None if t_c is None else o * (1 - tanh_c * tanh_c) * t_c)
        if self.w_hr is not None:
            t_h = _add(_mm_t(t_h, self.w_hr), _mm_t(o * tanh_c, tw_hr))
        return t_h, t_c

    def _lstm_step(self, t: int, x_t: Any, h: Any, c: Any, w_hh_t: Any, w_hr_t: Any,
                   zero: bool) -> tuple:
        gates = x_t if zero else self.name(torch.addmm(x_t, h, w_hh_t), "gates", t)
        i, f, g, o = gates.chunk(4, 1)
        i, f = self.name(torch.sigmoid(i), "i", t), self.name(torch.sigmoid(f), "f", t)
        g, o = self.name(torch.tanh(g), "g", t), self.name(torch.sigmoid(o), "o", t)
        c = self.name(i * g if zero else torch.addcmul(f * c, i, g), "c", t)  # f * c + i * g
        h = o * torch.tanh(c)
        if w_hr_t is not None:
            h = torch.mm(h, w_hr_t)
        self.save(t, i=i, f=f, g=g, o=o, c=c)
        return self.name(h, "h", t), c

    def _gru_step(self, t: int, x_t: tuple, h: Any, w_hh_t: Any, zero: bool) -> Any:
        x_rz, x_n = x_t
        hs = self.h_size
        if zero and self.b_hh is None:  # h @ W_hh^T = 0
            r, z = torch.sigmoid(x_rz).chunk(2, 1)
            n = self.name(torch.tanh(x_n), "n", t)
            self.save(t, r=r, z=z, n=n, gh_n=torch.zeros_like(n))
            return self.name((1 - z) * n, "h", t)
        if zero:  # h @ W_hh^T + b_hh = b_hh
            gh_rz, gh_n = self.b_hh.split([2 * hs, hs])
            r, z = self.name(torch.sigmoid(x_rz + gh_rz), "rz", t).chunk(2, 1)
            n = self.name(torch.tanh(x_n + r * gh_n), "n", t)
            self.save(t, r=r, z=z, n=n, gh_n=gh_n.expand(n.shape))
            return self.name((1 - z) * n, "h", t)
        gh = torch.mm(h, w_hh_t) if self.b_hh is None else torch.addmm(self.b_hh, h, w_hh_t)
        gh_rz, gh_n = self.name(gh, "gh", t).split([2 * hs, hs], 1)
        r, z = self.name(torch.sigmoid(x_rz + gh_rz), "rz", t).chunk(2, 1)
        n = self.name(torch.tanh(x_n + r * gh_n), "n", t)
        self.save(t, r=r, z=z, n=n, gh_n=gh_n)
        return self.name(torch.lerp(n, h, z), "h", t)  # (1 - z) * n + z * h

    def _rnn_step(self, t: int, x_t: Any, h: Any, w_hh_t: Any, zero: bool) -> Any:
        pre = x_t if zero else torch.addmm(x_t, h, w_hh_t)
        return self.name(torch.tanh(pre) if self.kind == "rnn_tanh" else torch.relu(pre), "h", t)

    # -- backward -----------------------------------------------------------------------------
    def backward(self, d_y: Any, d_hn: Any, d_cn: Any, need_input: bool) -> dict[str, Any]:
        """Cotangents of the input rows (``x``, if ``need_input``), ``h_0``/``c_0`` and the
        weights, from those of the output rows (``d_y``), ``h_n`` and ``c_n`` (each may be
        ``None``).  Returns a dict with keys ``x h0 c0 w_ih w_hh b_ih b_hh w_hr``."""
        sizes, T = self.sizes, len(self.sizes)
        d_rows = _rows(d_y, sizes) if d_y is not None else None
        d_ys = [None if d_rows is None else d_rows[t] if T == 1 else
                self.name(d_rows[t], "d_y", t) for t in range(T)]
        step = {"lstm": self._lstm_bwd, "gru": self._gru_bwd}.get(self.kind, self._rnn_bwd)()
        self.incoming = (d_hn, d_cn)  # (not renamed: the engine's cotangents)
        n = self.last_rows
        dh = None if d_hn is None else (d_hn if n == self.batch else d_hn[:n])
        dc = None if d_cn is None else (d_cn if n == self.batch else d_cn[:n])
        started: list[tuple[int, Any, Any]] = []  # (first row, d_h0, d_c0) of later starts
        folded = False  # d_ys[t] already added by the previous (later) step's matmul
        for k in range(T - 1, -1, -1):
            t = self.order[k]
            b = sizes[t]
            before = sizes[self.order[k - 1]] if k > 0 else b
            # the cotangent of the previous step's output joins d_h in this step's matmul
            # (d_h_prev = d_y[t-1] + d_gates @ W_hh, one addmm) when its rows are the same
            fold = d_ys[self.order[k - 1]] if k > 0 and before == b else None
            dh, dc = step(t, None if folded else d_ys[t], dh, dc, fold)
            folded = fold is not None
            if before > b:  # sequences b..before ended at step k-1: add their h_n cotangent
                dh = _join_rows([dh, None if d_hn is None else d_hn[b:before]], [0, b],
                                before, self.h_size, self.like)
                if self.c_size is not None:
                    dc = _join_rows([dc, None if d_cn is None else d_cn[b:before]], [0, b],
                                    before, self.c_size, self.like)
            elif before < b:  # sequences before..b started at step k, from h_0 rows
                started.append((before, None if dh is None else dh[before:b],
                                None if dc is None else dc[before:b]))
                dh = None if dh is None else dh[:before]
                dc = None if dc is None else dc[:before]
        started.sort(key=lambda e: e[0])
        starts = [0] + [e[0] for e in started]
        out = self._weight_grads(need_input)
        out["h0"] = _join_rows([dh] + [e[1] for e in started], starts, self.batch,
                               self.h_size, self.like)
        out["c0"] = None if self.c_size is None else _join_rows(
            [dc] + [e[2] for e in started], starts, self.batch, self.c_size, self.like)
        return out

    def cot_h(self, d_y: Any, dh: Any, t: int) -> Any:
        """The cotangent of ``h`` at step ``t``: that of the step's output plus the one
        carried from step ``t + 1``, named ``d_h_t<t>``."""
        dh = _add(d_y, dh)
        if dh is not None and all(dh is not v for v in self.incoming):
            self.name(dh, "d_h", t)
        return dh

    def _weight_grads(self, need_input: bool) -> dict[str, Any]:
        """Weight and bias cotangents of all steps at once (one matmul each), and that of
        the input rows."""
        gates = self.w_hh.shape[0]
        d_gh = self.cat_steps(self.d_gates, gates)  # cotangent of h @ W_hh^T (+ b_hh)
        if len(self.sizes) > 1 and self.prefix is not None:
            d_gh.node._rename(f"{self.prefix}{'d_gh' if self.kind == 'gru' else 'd_gates'}_all")
        h_prev = self.all_steps("h_prev")
        out: dict[str, Any] = {"w_hh": torch.mm(d_gh.t(), h_prev)}
        if self.kind == "gru":  # the input gates differ from the hidden ones in n only
            hs = self.h_size
            d_proj = torch.cat([d_gh[:, :2 * hs], self.cat_steps(self.d_n, hs)], 1)
            out["b_hh"] = None if self.b_hh is None else d_gh.sum(0)
        else:
            d_proj = d_gh
            # (its own tensor: the same values as d_b_ih)
            out["b_hh"] = None if self.b_hh is None else torch.clone(d_gh.sum(0))
        out["w_ih"] = torch.mm(d_proj.t(), self.x)
        out["b_ih"] = None if self.b_ih is None else d_proj.sum(0)
        out["x"] = torch.mm(d_proj, self.w_ih) if need_input else None
        out["w_hr"] = None
        if self.w_hr is not None:
            d_h = self.cat_steps(self.d_h, self.h_size)
            m = self.all_steps("o") * torch.tanh(self.all_steps("c"))
            out["w_hr"] = torch.mm(d_h.t(), m)
        return out

    def _lstm_bwd(self) -> Any:
        i, f, g, o, c, c_prev = (self.all_steps(k) for k in ("i", "f", "g", "o", "c",
                                                               "c_prev"))
        tc = torch.tanh(c)
        sizes = self.sizes
        dc_dh = _rows(self.name(_tanh_grad(o, tc), "dc_dh", -1), sizes)  # d_c += d_h * this
        # d(gate pre-activations i, f, g, o) = [d_c, d_c, d_c, d_h] * factor
        factor = _rows(self.name(torch.cat([_sigmoid_grad(g, i), _sigmoid_grad(c_prev, f),
                                            _tanh_grad(i, g), _sigmoid_grad(tc, o)], 1),
                                 "gate_factor", -1), sizes)
        forget = _rows(f, sizes)
        self.d_gates, self.d_h = {}, {}
        w_hh, w_hr = self.w_hh, self.w_hr

        def step(t: int, d_y: Any, dh: Any, dc: Any, fold: Any) -> tuple[Any, Any]:
            dh = self.cot_h(d_y, dh, t)
            if w_hr is not None:
                self.d_h[t] = dh
                dh = None if dh is None else torch.mm(dh, w_hr)
            if dh is None and dc is None:
                return fold, None
            if dh is None:
                dh = torch.zeros_like(dc)
            dc = dh * dc_dh[t] if dc is None else torch.addcmul(dc, dh, dc_dh[t])
            self.name(dc, "d_c", t)
            d_gates = self.name(torch.cat([dc, dc, dc, dh], 1) * factor[t], "d_gates", t)
            self.d_gates[t] = d_gates
            return _mm_add(fold, d_gates, w_hh), dc * forget[t]

        return step

    def _gru_bwd(self) -> Any:
        r, z, n, gh_n, h_prev = (self.all_steps(k) for k in ("r", "z", "n", "gh_n",
                                                              "h_prev"))
        sizes = self.sizes
        d_n = _tanh_grad(1 - z, n)  # d(n pre-activation) = d_h * d_n
        d_r = _sigmoid_grad(d_n * gh_n, r)
        d_z = _sigmoid_grad(h_prev - n, z)
        # d(h @ W_hh^T + b_hh) = [d_h, d_h, d_h] * factor (r, z, and n's gh_n = r * ...)
        factor = _rows(self.name(torch.cat([d_r, d_z, d_n * r], 1), "gate_factor", -1), sizes)
        d_n_t = _rows(self.name(d_n, "dn_dh", -1), sizes)
        update = _rows(z, sizes)
        self.d_gates, self.d_n = {}, {}
        w_hh = self.w_hh

        def step(t: int, d_y: Any, dh: Any, dc: Any, fold: Any) -> tuple[Any, Any]:
            dh = self.cot_h(d_y, dh, t)
            if dh is None:
                return fold, None
            d_gh = self.name(torch.cat([dh, dh, dh], 1) * factor[t], "d_gh", t)
            self.d_gates[t] = d_gh
            self.d_n[t] = dh * d_n_t[t]
            direct = dh * update[t] if fold is None else torch.addcmul(fold, dh, update[t])
            return torch.addmm(direct, d_gh, w_hh), None  # z * d_h + d_gh @ W_hh

        return step

    def _rnn_bwd(self) -> Any:
        h = self.all_steps("h")
        factor = _rows(self.name(_tanh_grad(1, h) if self.kind == "rnn_tanh"
                                 else (h > 0).to(h.dtype), "dpre_dh", -1), self.sizes)
        self.d_gates = {}
        w_hh = self.w_hh

        def step(t: int, d_y: Any, dh: Any, dc: Any, fold: Any) -> tuple[Any, Any]:
            dh = self.cot_h(d_y, dh, t)
            if dh is None:
                return fold, None
            d_pre = self.name(dh * factor[t], "d_pre", t)
            self.d_gates[t] = d_pre
            return _mm_add(fold, d_pre, w_hh), None

        return step


# ---------------------------------------------------------------------------------------------
# oneDNN's LSTM layer (fused level "all": code built to run)
# ---------------------------------------------------------------------------------------------

_ONEDNN_LSTM = 2  # ideep::rnn_kind::LSTM, the ``mode`` of aten.mkldnn_rnn_layer


def _not_compiled(fn: Callable) -> Callable:
    """``fn`` run eagerly also inside code ``torch.compile`` traces (``fxad.joint_step``):
    a graph break around it, as around eager ``nn.LSTM``'s own call (the oneDNN kernel keeps
    its workspace only when called with gradients enabled, which a traced graph does not
    reproduce).  ``torch._dynamo`` is not imported for it: without it nothing compiles."""
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is None:
            return fn(*args, **kwargs)
        disabled = fn.__dict__.get("_fxad_not_compiled")
        if disabled is None:
            disabled = dynamo.disable(fn, recursive=True, wrapping=False)
            fn._fxad_not_compiled = disabled  # type: ignore[attr-defined]
        return disabled(*args, **kwargs)
    return call


def _call_node(fn: Callable, *args: Any) -> Any:
    """``fn(*args)`` as one graph node (``fn`` itself, not what it wraps) when an argument
    is a proxy."""
    for a in args:
        if isinstance(a, fx.Proxy):
            return a.tracer.create_proxy("call_function", fn, args, {})
    return fn(*args)


@_not_compiled
def onednn_lstm_layer(input: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor,
                      b_ih: torch.Tensor, b_hh: torch.Tensor, hx: torch.Tensor,
                      cx: torch.Tensor, reverse: bool, has_biases: bool,
                      train: bool) -> tuple:
    """One direction of one LSTM layer by oneDNN, as eager ``nn.LSTM`` runs it on the CPU:
    ``torch.ops.aten.mkldnn_rnn_layer`` on a time-major ``(T, B, F)`` input, returning
    ``(output, h_n, c_n, workspace)``.  The kernel keeps the workspace its backward reads
    only while gradients are enabled, so it runs with gradients enabled, on detached
    tensors (no autograd graph is recorded): the generated code runs under
    ``torch.no_grad()``.  The kernel reads its tensors as contiguous memory, as eager's
    caller makes them."""
    d = [t.detach().contiguous() for t in (input, w_ih, w_hh, b_ih, b_hh, hx, cx)]
    with torch.enable_grad():
        return torch.ops.aten.mkldnn_rnn_layer(*d, reverse, [], _ONEDNN_LSTM, hx.shape[1], 1,
                                               has_biases, False, False, train)


@_not_compiled
def onednn_lstm_layer_backward(input: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor,
                               b_ih: torch.Tensor, b_hh: torch.Tensor, hx: torch.Tensor,
                               cx: torch.Tensor, output: torch.Tensor, hy: torch.Tensor,
                               cy: torch.Tensor, d_output: Any, d_hy: Any, d_cy: Any,
                               reverse: bool, has_biases: bool, train: bool,
                               workspace: torch.Tensor) -> tuple:
    """The backward of :func:`onednn_lstm_layer`: ``torch.ops.aten.mkldnn_rnn_layer_backward``
    (what autograd runs for eager ``nn.LSTM`` on the CPU), returning ``(d_input, d_w_ih,
    d_w_hh, d_b_ih, d_b_hh, d_hx, d_cx)``; ``None`` cotangents are zeros."""
    t = [v.contiguous() for v in (input, w_ih, w_hh, b_ih, b_hh, hx, cx)]
    return torch.ops.aten.mkldnn_rnn_layer_backward(
        *t, output, hy, cy, d_output, d_hy, d_cy, reverse, _ONEDNN_LSTM, hx.shape[1], 1,
        has_biases, train, False, [], False, workspace)


for _fn in (onednn_lstm_layer, onednn_lstm_layer_backward):  # fxad_onednn_lstm_layer[_backward]
    code_builtin(f"fxad_{_fn.__name__}", _fn)


def _use_onednn(kind: str, packed: bool, weights: list, x: Any, hx: Any) -> bool:
    """oneDNN's fused LSTM layer and its backward where eager PyTorch uses them (ATen
    ``use_mkldnn``: a float32 CPU LSTM without projections on a padded batch, oneDNN
    enabled), in code built to run (fused kernels at level ``"all"``: ``fxad.compile``,
    ``fxad.joint_step``); the code ``fxad.vjp`` shows is the loop written out."""
    if kind != "lstm" or packed or not fused.enabled("all"):
        return False
    if not (torch.backends.mkldnn.is_available() and torch._C._get_mkldnn_enabled()):
        return False
    if any(w[4] is not None for w in weights):
        return False
    vals = [value_of(t) for t in (x, hx[0], hx[1])]
    vals += [value_of(w) for ws in weights for w in ws if w is not None]
    return all(isinstance(v, torch.Tensor) and v.device.type == "cpu"
               and v.dtype == torch.float32 for v in vals) and vals[0].numel() > 0


class _OneDNNDirection:
    """One layer-direction of an LSTM by oneDNN's kernels, with :class:`_Direction`'s
    interface: input rows ``(T*B, F)`` (viewed as ``(T, B, F)``), output rows."""

    def __init__(self, weights: tuple, steps: int, train: bool, reverse: bool) -> None:
        self.w_ih, self.w_hh, self.b_ih, self.b_hh, self.w_hr = weights
        self.steps, self.train, self.reverse = steps, train, reverse
        self.has_biases = self.b_ih is not None

    def forward(self, x: Any, h0: Any, c0: Any) -> tuple[Any, Any, Any]:
        T = self.steps
        B, H = h0.shape[0], h0.shape[1]
        self.batch, self.h_size, self.c_size, self.like = B, H, c0.shape[1], h0
        # contiguous here, once, for the kernel and the backward kernel (which would each
        # copy a strided input, e.g. a batch-first one transposed to time-major), as eager
        # saves the contiguous input
        self.x = torch.reshape(x, (T, B, x.shape[1])).contiguous()
        # without biases the kernel ignores these two slots (eager passes zeros there)
        b_ih = self.b_ih if self.has_biases else self.w_ih
        b_hh = self.b_hh if self.has_biases else self.w_hh
        self.b = (b_ih, b_hh)
        self.h0, self.c0 = h0, c0
        res = _call_node(onednn_lstm_layer, self.x, self.w_ih, self.w_hh, b_ih, b_hh, h0, c0,
                    self.reverse, self.has_biases, self.train)
        self.y, self.h_n, self.c_n, self.workspace = res[0], res[1], res[2], res[3]
        return torch.reshape(self.y, (T * B, H)), self.h_n, self.c_n

    def backward(self, d_y: Any, d_hn: Any, d_cn: Any, need_input: bool) -> dict[str, Any]:
        T, B, H = self.steps, self.batch, self.h_size
        d_y3 = None if d_y is None else torch.reshape(d_y, (T, B, H))
        res = _call_node(onednn_lstm_layer_backward, self.x, self.w_ih, self.w_hh, self.b[0],
                    self.b[1], self.h0, self.c0, self.y, self.h_n, self.c_n, d_y3, d_hn, d_cn,
                    self.reverse, self.has_biases, self.train, self.workspace)
        d_x, d_w_ih, d_w_hh, d_b, d_b2, d_h0, d_c0 = (res[k] for k in range(7))
        return {"x": torch.reshape(d_x, (T * B, d_x.shape[2])) if need_input else None,
                "w_ih": d_w_ih, "w_hh": d_w_hh, "b_ih": d_b if self.has_biases else None,
                "b_hh": d_b2 if self.has_biases else None, "w_hr": None, "h0": d_h0,
                "c0": d_c0}


# ---------------------------------------------------------------------------------------------
# The layer stack: torch.lstm / gru / rnn_tanh / rnn_relu
# ---------------------------------------------------------------------------------------------

def _split_weights(kind: str, params: list, has_biases: bool, num_layers: int,
                   dirs: int) -> list[tuple]:
    """``(w_ih, w_hh, b_ih, b_hh, w_hr)`` per layer-direction, from the flat list in
    ``nn.RNNBase._flat_weights`` order."""
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
    (the same draws as eager PyTorch for the same seed)."""
    if p >= 1.0:
        return torch.zeros_like(y)
    return torch.empty_like(y).bernoulli_(1.0 - p) / (1.0 - p)


def _stack_args(kind: str, args: tuple, like: tuple | None = None) -> dict[str, Any]:
    """The arguments of either overload by name (``batch_sizes`` is None when padded).
    ``like``: the primal arguments, when ``args`` are their tangents (the overload is read
    from the primals)."""
    ref = args if like is None else like
    if _is_packed(ref[1]):
        names = ("input", "batch_sizes", "hx", "params", "has_biases", "num_layers",
                 "dropout", "train", "bidirectional")
        a = dict(zip(names, args))
        a["batch_first"] = False
        if like is None:
            a["sizes"] = _constant_ints(a["batch_sizes"], _OPS[kind])
    else:
        names = ("input", "hx", "params", "has_biases", "num_layers", "dropout", "train",
                 "bidirectional", "batch_first")
        a = dict(zip(names, args))
        a["batch_sizes"] = None
    return a


def _stack_fwd(kind: str, args: tuple, tangents: tuple | None = None) -> tuple[Any, Any]:
    """The forward of a layer stack: ``(value, aux)``; forward mode (``tangents`` aligned
    with ``args``, see :func:`_stack_args`): ``(value, tangent)``."""
    a = _stack_args(kind, args)
    ta = None if tangents is None else _stack_args(kind, tangents, like=args)
    packed = a["batch_sizes"] is not None
    num_layers, dirs = int(a["num_layers"]), 2 if a["bidirectional"] else 1
    weights = _split_weights(kind, list(a["params"]), a["has_biases"], num_layers, dirs)
    x = a["input"]
    tx = None if ta is None else ta["input"]
    if packed:
        sizes, rows = a["sizes"], x
    else:
        if x.dim() != 3:
            raise _error(_OPS[kind], f"expected a 3-D input, got {x.dim()}-D",
                         "call it through nn.RNN / nn.LSTM / nn.GRU (they batch an unbatched "
                         "input)")
        if a["batch_first"]:
            x = x.transpose(0, 1)
            tx = None if tx is None else tx.transpose(0, 1)
        T, B = x.shape[0], x.shape[1]
        sizes, rows = [B] * T, torch.reshape(x, (T * B, x.shape[2]))
        rows.node._rename(f"{kind}_input")  # the rows of all steps, time-major
        tx = None if tx is None else torch.reshape(tx, (T * B, x.shape[2]))
    n_dirs = num_layers * dirs
    none = (None,) * n_dirs
    if kind == "lstm":
        h0s, c0s = a["hx"][0].unbind(0), a["hx"][1].unbind(0)
        zero = _is_zeros(a["hx"][0]) and _is_zeros(a["hx"][1])
        t_hx = (None, None) if ta is None or ta["hx"] is None else ta["hx"]
        t_h0s = none if t_hx[0] is None else t_hx[0].unbind(0)
        t_c0s = none if t_hx[1] is None else t_hx[1].unbind(0)
    else:
        h0s, c0s = a["hx"].unbind(0), none
        zero = _is_zeros(a["hx"])
        t_h0s = none if ta is None or ta["hx"] is None else ta["hx"].unbind(0)
        t_c0s = none
    t_weights = [(None,) * 5] * n_dirs
    if ta is not None and ta["params"] is not None:
        t_weights = _split_weights(kind, list(ta["params"]), a["has_biases"], num_layers, dirs)
    p, train = float(a["dropout"]), bool(a["train"])
    onednn = ta is None and _use_onednn(kind, packed, weights, x, a["hx"])
    layers, masks, h_n, c_n, t_hn, t_cn = [], [], [], [], [], []
    for layer in range(num_layers):
        mask = None
        if layer > 0 and train and p > 0:  # dropout on the previous layer's output
            mask = _dropout_mask(rows, p)
            rows = rows * mask
            tx = None if tx is None else tx * mask
        masks.append(mask)
        outs, drs, t_outs = [], [], []
        for d in range(dirs):
            k = layer * dirs + d
            if onednn:
                dr: Any = _OneDNNDirection(weights[k], len(sizes), train, d == 1)
                y, h, c = dr.forward(rows, h0s[k], c0s[k])
            else:
                prefix = (f"l{layer}_" if layer else "") + ("rev_" if d else "")
                dr = _Direction(kind, weights[k], sizes, reverse=d == 1, prefix=prefix)
                if ta is None:
                    y, h, c = dr.forward(rows, h0s[k], c0s[k], zero)
                else:
                    y, h, c, t_y, t_h, t_c = dr.forward(
                        rows, h0s[k], c0s[k], zero, (tx, t_h0s[k], t_c0s[k], t_weights[k]))
                    t_outs.append(t_y)
                    t_hn.append(t_h)
                    t_cn.append(t_c)
            outs.append(y)
            drs.append(dr)
            h_n.append(h)
            c_n.append(c)
        layers.append(drs)
        rows = outs[0] if dirs == 1 else torch.cat(outs, 1)
        if ta is not None:
            tx = _join_cols(t_outs, [dr.h_size for dr in drs], rows)
    out = rows
    if not packed:
        out = torch.reshape(rows, (len(sizes), sizes[0], rows.shape[1]))
        tx = None if tx is None else torch.reshape(tx, (len(sizes), sizes[0], rows.shape[1]))
        if a["batch_first"]:
            out = out.transpose(0, 1)
            tx = None if tx is None else tx.transpose(0, 1)
    value = (out, torch.stack(h_n)) + ((torch.stack(c_n),) if kind == "lstm" else ())
    if ta is None:
        return value, (packed, bool(a["batch_first"]), sizes, layers, masks)
    drs_all = [dr for drs in layers for dr in drs]
    t_value = (tx, _stack_states(t_hn, [(dr.batch, dr.h_size, dr.like) for dr in drs_all]))
    if kind == "lstm":
        t_value += (_stack_states(t_cn, [(dr.batch, dr.c_size, dr.like) for dr in drs_all]),)
    return value, t_value


def _join_cols(parts: list, widths: list[int], like: Any) -> Any:
    """``cat(parts, 1)`` with ``None`` parts as zeros; ``None`` if all are."""
    if all(p is None for p in parts):
        return None
    full = [p if p is not None else _zeros(like.shape[0], w, like) for p, w in zip(parts, widths)]
    return full[0] if len(full) == 1 else torch.cat(full, 1)


def _stack_states(parts: list, shapes: list[tuple]) -> Any:
    """``stack(parts)`` with ``None`` parts as zeros of ``(rows, cols)``; ``None`` if all
    are."""
    if all(p is None for p in parts):
        return None
    return torch.stack([p if p is not None else _zeros(r, c, like)
                        for p, (r, c, like) in zip(parts, shapes)])


def _stack_bwd(kind: str, aux: Any, d: Any) -> tuple:
    packed, batch_first, sizes, layers, masks = aux
    d_out, d_hn = d[0], d[1]
    d_cn = d[2] if kind == "lstm" else None
    if d_out is not None and not packed:
        if batch_first:
            d_out = d_out.transpose(0, 1)
        d_out = torch.reshape(d_out, (len(sizes) * sizes[0], d_out.shape[2]))
    drs = [dr for drs in layers for dr in drs]
    d_hns = (None,) * len(drs) if d_hn is None else d_hn.unbind(0)
    d_cns = (None,) * len(drs) if d_cn is None else d_cn.unbind(0)
    grads: list[dict[str, Any]] = [{} for _ in drs]
    dirs = len(layers[0])
    for layer in range(len(layers) - 1, -1, -1):
        d_rows = None
        for j, dr in enumerate(layers[layer]):
            k = layer * dirs + j
            dy = d_out
            if d_out is not None and dirs > 1:
                width = d_out.shape[1] // dirs
                dy = d_out[:, j * width:(j + 1) * width]
            g = dr.backward(dy, d_hns[k], d_cns[k],
                            need_input=layer > 0 or needs_cotangent("input"))
            grads[k] = g
            d_rows = _add(d_rows, g["x"])
        if masks[layer] is not None and d_rows is not None:
            d_rows = d_rows * masks[layer]
        d_out = d_rows
    d_input = d_out
    if d_input is not None and not packed:
        d_input = torch.reshape(d_input, (len(sizes), sizes[0], d_input.shape[1]))
        if batch_first:
            d_input = d_input.transpose(0, 1)
    has_b, has_r = drs[0].b_ih is not None, drs[0].w_hr is not None
    names = ["w_ih", "w_hh"] + (["b_ih", "b_hh"] if has_b else []) + (["w_hr"] if has_r else [])
    d_params = [g[n] for g in grads for n in names]

    def stacked(key: str, cols: Any) -> Any:
        parts = [g[key] for g in grads]
        if all(v is None for v in parts):
            return None
        return torch.stack([v if v is not None else _zeros(dr.batch, cols(dr), dr.like)
                            for v, dr in zip(parts, drs)])

    d_h0 = stacked("h0", lambda dr: dr.h_size)
    d_hx: Any = (d_h0, stacked("c0", lambda dr: dr.c_size)) if kind == "lstm" else d_h0
    if packed:
        return (d_input, None, d_hx, d_params)
    return (d_input, d_hx, d_params)


def _stack_samples(kind: str, dtype: torch.dtype) -> Any:
    """Small configurations of every layout: (T, B, F) = (3, 2, 3), hidden 4."""
    g = _GATES[kind]
    T, B, Fi, H = 3, 2, 3, 4
    for layers, bidir, batch_first, bias in ((1, False, False, True), (2, True, True, True),
                                             (1, True, False, False)):
        dirs = 2 if bidir else 1
        params = []
        for layer in range(layers):
            fin = Fi if layer == 0 else H * dirs
            for _ in range(dirs):
                params += [randn(g * H, fin, dtype=dtype) * 0.5,
                           randn(g * H, H, dtype=dtype) * 0.5]
                if bias:
                    params += [randn(g * H, dtype=dtype) * 0.5, randn(g * H, dtype=dtype) * 0.5]
        x = randn(B, T, Fi, dtype=dtype) if batch_first else randn(T, B, Fi, dtype=dtype)
        h0 = randn(layers * dirs, B, H, dtype=dtype) * 0.5
        hx: Any = (h0, randn(layers * dirs, B, H, dtype=dtype) * 0.5) if kind == "lstm" else h0
        yield (x, hx, params, bias, layers, 0.0, False, bidir, batch_first), {}


@register_vjp(torch.lstm)
class LSTM:
    """nn.LSTM's ``torch.lstm`` (padded and packed overloads), written out as code: one
    matmul for the input projection of all steps, then per step
    ``gates = x_proj[t] + h @ W_hh^T; i, f, g, o = gates.chunk(4, 1)``,
    ``c = sigmoid(f) * c + sigmoid(i) * tanh(g)``, ``h = sigmoid(o) * tanh(c)`` (``@ W_hr^T``
    with proj_size); the backward is backpropagation through time, the weight gradients one
    matmul over all steps (ATen RNN.cpp ``LSTMCell`` / derivatives.yaml via its ops)."""

    outputs = ("output", "h_n", "c_n")

    recompute = False

    def fwd(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
            batch_first):
        return _stack_fwd("lstm", (input, hx, params, has_biases, num_layers, dropout, train,
                                   bidirectional, batch_first))

    def bwd(aux, d):
        return _stack_bwd("lstm", aux, d)

    def jvp(primals, tangents):
        return _stack_fwd("lstm", tuple(primals), tuple(tangents))

    def samples(dtype):
        yield from _stack_samples("lstm", dtype)


@register_vjp(torch.gru)
class GRU:
    """nn.GRU's ``torch.gru`` (padded and packed overloads), written out as code: per step
    ``gh = h @ W_hh^T + b_hh``, ``r, z = sigmoid(x_rz[t] + gh_rz)``,
    ``n = tanh(x_n[t] + r * gh_n)`` (b_hn inside the reset product, as PyTorch),
    ``h = (1 - z) * n + z * h``; backward through time, weight gradients one matmul over all
    steps (ATen RNN.cpp ``GRUCell``)."""

    outputs = ("output", "h_n")

    recompute = False

    def fwd(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
            batch_first):
        return _stack_fwd("gru", (input, hx, params, has_biases, num_layers, dropout, train,
                                  bidirectional, batch_first))

    def bwd(aux, d):
        return _stack_bwd("gru", aux, d)

    def jvp(primals, tangents):
        return _stack_fwd("gru", tuple(primals), tuple(tangents))

    def samples(dtype):
        yield from _stack_samples("gru", dtype)


@register_vjp(torch.rnn_tanh)
class RNNTanh:
    """nn.RNN's ``torch.rnn_tanh`` (padded and packed overloads): per step
    ``h = tanh(x_proj[t] + h @ W_hh^T)``; backward through time with
    ``tanh' = 1 - h^2``, weight gradients one matmul over all steps (ATen RNN.cpp
    ``SimpleCell``)."""

    outputs = ("output", "h_n")

    recompute = False

    def fwd(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
            batch_first):
        return _stack_fwd("rnn_tanh", (input, hx, params, has_biases, num_layers, dropout,
                                       train, bidirectional, batch_first))

    def bwd(aux, d):
        return _stack_bwd("rnn_tanh", aux, d)

    def jvp(primals, tangents):
        return _stack_fwd("rnn_tanh", tuple(primals), tuple(tangents))

    def samples(dtype):
        yield from _stack_samples("rnn_tanh", dtype)


@register_vjp(torch.rnn_relu)
class RNNRelu:
    """nn.RNN(nonlinearity='relu')'s ``torch.rnn_relu`` (padded and packed overloads): per
    step ``h = relu(x_proj[t] + h @ W_hh^T)``; backward through time with
    ``relu' = (h > 0)`` (ATen RNN.cpp ``SimpleCell``)."""

    outputs = ("output", "h_n")

    recompute = False

    def fwd(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
            batch_first):
        return _stack_fwd("rnn_relu", (input, hx, params, has_biases, num_layers, dropout,
                                       train, bidirectional, batch_first))

    def bwd(aux, d):
        return _stack_bwd("rnn_relu", aux, d)

    def jvp(primals, tangents):
        return _stack_fwd("rnn_relu", tuple(primals), tuple(tangents))

    def samples(dtype):
        yield from _stack_samples("rnn_relu", dtype)


# ---------------------------------------------------------------------------------------------
# Cells: one step
# ---------------------------------------------------------------------------------------------

def _cell_fwd(kind: str, input: Any, hx: Any, w_ih: Any, w_hh: Any, b_ih: Any,
              b_hh: Any) -> tuple[Any, Any]:
    h0, c0 = (hx[0], hx[1]) if kind == "lstm" else (hx, None)
    dr = _Direction(kind, (w_ih, w_hh, b_ih, b_hh, None), [input.shape[0]], reverse=False,
                    prefix=None)
    zero = _is_zeros(h0) and (c0 is None or _is_zeros(c0))
    _, h, c = dr.forward(input, h0, c0, zero)
    return ((h, c) if kind == "lstm" else h), dr


def _cell_bwd(kind: str, dr: _Direction, d: Any) -> tuple:
    d_h, d_c = (d[0], d[1]) if kind == "lstm" else (d, None)
    g = dr.backward(None, d_h, d_c, need_input=needs_cotangent("input"))
    d_hx = (g["h0"], g["c0"]) if kind == "lstm" else g["h0"]
    return g["x"], d_hx, g["w_ih"], g["w_hh"], g["b_ih"], g["b_hh"]


def _cell_jvp(kind: str, primals: tuple, tangents: tuple) -> tuple[Any, Any]:
    input, hx, w_ih, w_hh, b_ih, b_hh = primals
    t_in, t_hx, tw_ih, tw_hh, tb_ih, tb_hh = tangents
    h0, c0 = (hx[0], hx[1]) if kind == "lstm" else (hx, None)
    th0, tc0 = ((None, None) if t_hx is None else (t_hx[0], t_hx[1])) if kind == "lstm" \
        else (t_hx, None)
    dr = _Direction(kind, (w_ih, w_hh, b_ih, b_hh, None), [input.shape[0]], reverse=False,
                    prefix=None)
    zero = _is_zeros(h0) and (c0 is None or _is_zeros(c0))
    _, h, c, _, th, tc = dr.forward(input, h0, c0, zero,
                                    (t_in, th0, tc0, (tw_ih, tw_hh, tb_ih, tb_hh, None)))
    if kind == "lstm":
        return (h, c), (th, tc)
    return h, th


def _cell_samples(kind: str, dtype: torch.dtype) -> Any:
    g, B, Fi, H = _GATES[kind], 3, 2, 4
    h = randn(B, H, dtype=dtype) * 0.5
    hx: Any = (h, randn(B, H, dtype=dtype) * 0.5) if kind == "lstm" else h
    w = (randn(g * H, Fi, dtype=dtype) * 0.5, randn(g * H, H, dtype=dtype) * 0.5)
    yield (randn(B, Fi, dtype=dtype), hx) + w + (randn(g * H, dtype=dtype),
                                                 randn(g * H, dtype=dtype)), {}
    yield (randn(B, Fi, dtype=dtype), hx) + w, {}


@register_vjp(torch.lstm_cell)
class LSTMCell:
    """nn.LSTMCell's ``torch.lstm_cell``: one step of :class:`LSTM`'s loop (gates i, f, g, o)
    and its backward (ATen RNN.cpp ``LSTMCell``)."""

    outputs = ("h", "c")

    recompute = False

    def fwd(input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
        return _cell_fwd("lstm", input, hx, w_ih, w_hh, b_ih, b_hh)

    def bwd(aux, d):
        return _cell_bwd("lstm", aux, d)

    def jvp(primals, tangents):
        return _cell_jvp("lstm", primals, tangents)

    def samples(dtype):
        yield from _cell_samples("lstm", dtype)


@register_vjp(torch.gru_cell)
class GRUCell:
    """nn.GRUCell's ``torch.gru_cell``: one step of :class:`GRU`'s loop (gates r, z, n with
    b_hn inside the reset product) and its backward (ATen RNN.cpp ``GRUCell``)."""

    recompute = False

    def fwd(input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
        return _cell_fwd("gru", input, hx, w_ih, w_hh, b_ih, b_hh)

    def bwd(aux, d):
        return _cell_bwd("gru", aux, d)

    def jvp(primals, tangents):
        return _cell_jvp("gru", primals, tangents)

    def samples(dtype):
        yield from _cell_samples("gru", dtype)


@register_vjp(torch.rnn_tanh_cell)
class RNNTanhCell:
    """nn.RNNCell's ``torch.rnn_tanh_cell``: ``h = tanh(x @ W_ih^T + b_ih + h @ W_hh^T +
    b_hh)``, d_pre = d_h (1 - h^2) (ATen RNN.cpp ``SimpleCell``)."""

    recompute = False

    def fwd(input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
        return _cell_fwd("rnn_tanh", input, hx, w_ih, w_hh, b_ih, b_hh)

    def bwd(aux, d):
        return _cell_bwd("rnn_tanh", aux, d)

    def jvp(primals, tangents):
        return _cell_jvp("rnn_tanh", primals, tangents)

    def samples(dtype):
        yield from _cell_samples("rnn_tanh", dtype)


@register_vjp(torch.rnn_relu_cell)
class RNNReluCell:
    """nn.RNNCell(nonlinearity='relu')'s ``torch.rnn_relu_cell``: ``h = relu(x @ W_ih^T +
    b_ih + h @ W_hh^T + b_hh)``, d_pre = d_h (h > 0) (ATen RNN.cpp ``SimpleCell``)."""

    recompute = False

    def fwd(input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
        return _cell_fwd("rnn_relu", input, hx, w_ih, w_hh, b_ih, b_hh)

    def bwd(aux, d):
        return _cell_bwd("rnn_relu", aux, d)

    def jvp(primals, tangents):
        return _cell_jvp("rnn_relu", primals, tangents)

    def samples(dtype):
        yield from _cell_samples("rnn_relu", dtype)


# ---------------------------------------------------------------------------------------------
# Packed sequences: pack_padded_sequence / pad_packed_sequence
# ---------------------------------------------------------------------------------------------

def _packed_rows(batch_sizes: list[int], batch: int) -> list[int]:
    """Rows of the time-major padded batch (``t * batch + b``) that a packed sequence keeps,
    in its order: step by step, the first ``batch_sizes[t]`` sequences (sorted by length)."""
    return [t * batch + b for t, n in enumerate(batch_sizes) for b in range(n)]


@register_vjp(torch._pack_padded_sequence)
class PackPaddedSequence:
    """``_pack_padded_sequence(input, lengths, batch_first) -> (data, batch_sizes)``: the rows
    of the padded batch the (sorted) lengths keep, step by step.  d_input = d_data written back
    at those rows, zeros elsewhere (derivatives.yaml `_pack_padded_sequence`:
    _pack_padded_sequence_backward); the JVP packs the tangent.  The lengths' values are read
    when the code is written (capture records them: a constant, or an input fxad guards)."""

    residuals = "nothing"

    def fwd(input, lengths, batch_first):
        out = torch._pack_padded_sequence(input, lengths, batch_first)
        lens = _constant_ints(lengths, "torch._pack_padded_sequence")
        return out, (tuple(input.shape), lens, batch_first)

    def bwd(aux, d):
        shape, lens, batch_first = aux
        d_data = d[0] if isinstance(d, (tuple, list)) else d
        if d_data is None:
            return (None, None, None)
        T, B = (shape[1], shape[0]) if batch_first else (shape[0], shape[1])
        sizes = [sum(1 for n in lens if n > t) for t in range(max(lens))]
        index = torch.tensor(_packed_rows(sizes, B), device=d_data.device)
        flat = torch.zeros((T * B,) + tuple(shape[2:]), dtype=d_data.dtype,
                           device=d_data.device).index_copy(0, index, d_data)
        d_in = flat.reshape((T, B) + tuple(shape[2:]))
        return (d_in.transpose(0, 1) if batch_first else d_in, None, None)

    def jvp(primals, tangents):
        (x, lengths, batch_first), t = primals, tangents[0]
        out = torch._pack_padded_sequence(x, lengths, batch_first)
        if t is None:
            return out, None
        return out, (torch._pack_padded_sequence(t, lengths, batch_first)[0], None)

    def samples(dtype):
        yield (randn(5, 3, 2, dtype=dtype), torch.tensor([5, 3, 2]), False), {}
        yield (randn(3, 4, 2, dtype=dtype), torch.tensor([4, 4, 1]), True), {}


@register_vjp(torch._pad_packed_sequence)
class PadPackedSequence:
    """``_pad_packed_sequence(data, batch_sizes, batch_first, padding_value, total_length) ->
    (padded, lengths)``: the packed rows written into a padded batch.  d_data = the cotangent
    of the padded batch read at those rows (derivatives.yaml `_pad_packed_sequence`: the
    padded gradient packed again); the JVP pads the tangent with zeros.  The batch sizes'
    values are read when the code is written."""

    residuals = "nothing"

    def fwd(data, batch_sizes, batch_first, padding_value, total_length):
        out = torch._pad_packed_sequence(data, batch_sizes, batch_first, padding_value,
                                         total_length)
        sizes = _constant_ints(batch_sizes, "torch._pad_packed_sequence")
        return out, (sizes, batch_first)

    def bwd(aux, d):
        sizes, batch_first = aux
        d_pad = d[0] if isinstance(d, (tuple, list)) else d
        if d_pad is None:
            return (None,) * 5
        if batch_first:
            d_pad = d_pad.transpose(0, 1)
        T, B = d_pad.shape[0], d_pad.shape[1]
        index = torch.tensor(_packed_rows(sizes, B), device=d_pad.device)
        flat = d_pad.reshape((T * B,) + tuple(d_pad.shape[2:]))
        return (flat.index_select(0, index), None, None, None, None)

    def jvp(primals, tangents):
        (data, batch_sizes, batch_first, padding_value, total_length), t = primals, tangents[0]
        out = torch._pad_packed_sequence(data, batch_sizes, batch_first, padding_value,
                                         total_length)
        if t is None:
            return out, None
        return out, (torch._pad_packed_sequence(t, batch_sizes, batch_first, 0.0,
                                                total_length)[0], None)

    def samples(dtype):
        yield (randn(10, 2, dtype=dtype), torch.tensor([3, 3, 2, 1, 1]), False, 0.0, 5), {}
        yield (randn(10, 2, dtype=dtype), torch.tensor([3, 3, 2, 1, 1]), True, 0.0, 6), {}
