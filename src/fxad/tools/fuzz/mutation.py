"""In-place families (:class:`_Mutations`): in-place ops on intermediates, ``x[idx] = v``,
and in-place ops on tensors that have views and through views (aliasing)."""
from __future__ import annotations

from typing import Any

import torch

from .state import _broadcast, _State, _storage


class _Mutations(_State):
    """Statement generators of the in-place families (``b_<family>``)."""

    def overlapping(self, name: str) -> bool:
        """Whether ``name`` or a tensor sharing its memory has elements sharing one memory
        location (``expand``): writing there has no well-defined autograd semantics."""
        return any(any(st == 0 and n > 1 for st, n in zip(self.t(k).stride(), self.t(k).shape))
                   for k in [name] + self.aliases(name))

    def _mutation(self, t: str, family: str) -> Any:
        """An in-place statement on ``t`` (an intermediate)."""
        r = self.r
        if self.overlapping(t):
            return None
        s = self.shp(t)
        nd = len(s)
        # operands never share memory with the target: PyTorch reads them while it writes
        # (x[idx] = diagonal(x)), with a result that depends on the kernel's order
        mem = {_storage(self.t(k)) for k in [t] + self.aliases(t)}

        def apart(n: str) -> bool:
            return _storage(self.t(n)) not in mem

        b = self.pick("f", lambda n: apart(n) and self.broadcastable(t, n, onto=True))
        sc = self.scalar()
        if family == "setitem" or (family == "alias" and r.random() < 0.4):
            if nd == 0:
                idx = "..."
            else:
                c = r.random()
                if c < 0.55:
                    idx = self.slice_expr(s, allow_none=False)
                elif c < 0.75:
                    d = r.randrange(nd)
                    ti = self.index_tensor(s[d], unique=True)
                    idx = ti if d == 0 else ", ".join([":"] * d + [ti])
                else:
                    m = self.pick("b", lambda n: self.broadcastable(t, n, onto=True))
                    idx = m if m is not None else f"{t} > 0.5"
            try:
                sub = eval(f"{t}[{idx}]", self.ns)
            except Exception:
                return None
            vals = [n for n in self.order if apart(n) and self.kind(n) == "f"
                    and _broadcast(self.shp(n), tuple(sub.shape)) == tuple(sub.shape)]
            is_mask = (idx in self.ns and self.kind(idx) == "b") or idx.endswith("> 0.5")
            val = sc if (not vals or is_mask or r.random() < 0.3) else self.choice(vals)
            if r.random() < 0.2 and val != sc:
                val = f"{val}.sin()" if r.random() < 0.5 else f"{val} * 2"
            return [(f"{t}[{idx}] = {val}", (), family)]
        forms = [f"{t}.mul_({sc})", f"{t}.clamp_(min=-0.5)", f"{t}.clamp_(-1, 1)",
                 f"{t}.relu_()", f"{t}.sigmoid_()", f"{t}.tanh_()", f"{t}.sin_()",
                 f"{t}.neg_()", f"{t}.abs_()", f"{t}.zero_()", f"{t}.fill_({sc})",
                 f"{t} *= {sc}", f"{t}.div_({sc})", f"{t}.add_({sc})", f"{t}.pow_(2)",
                 f"{t}.masked_fill_({t} > 0.5, {sc})"]
        if self.t(t).abs().max() < 3:
            forms.append(f"{t}.exp_()")
        if b is not None:
            forms += [f"{t}.add_({b})", f"{t}.sub_({b}, alpha=0.5)", f"{t} += {b}",
                      f"{t} -= {b}", f"{t}.copy_({b})", f"{t}.mul_({b})",
                      f"{t}.addcmul_({b}, {b}, value=0.5)", f"{t}.lerp_({b}, 0.3)",
                      f"{t}.div_({self.denominator(b)})", f"{t} *= {b}"]
        m = self.pick("b", lambda n: self.broadcastable(t, n, onto=True))
        if m is not None:
            forms.append(f"{t}.masked_fill_({m}, {sc})")
        if nd >= 1:
            d = r.randrange(nd)
            perm = self.index_tensor(s[d], length=s[d], unique=True)
            src = self.pick("f", lambda n: apart(n) and self.shp(n) == s)
            if src is not None:
                forms += [f"{t}.index_add_({d}, {perm}, {src})",
                          f"{t}.index_copy_({d}, {perm}, {src})",
                          f"{t}.scatter_({d}, {src}.argsort({d}), {src})",
                          f"{t}.scatter_add_({d}, {src}.argsort({d}), {src})"]
            forms.append(f"{t}.index_fill_({d}, {self.index_tensor(s[d], unique=True)}, {sc})")
        return [(self.choice(forms), (), family)]

    def _own(self, n: str) -> bool:
        return self.kind(n) == "f" and not self.is_input_alias(n) \
            and self.t(n).dtype == torch.float64

    def b_inplace(self) -> Any:
        t = self.pick("f", lambda n: self._own(n) and not self.aliases(n))
        return None if t is None else self._mutation(t, "inplace")

    def b_setitem(self) -> Any:
        t = self.pick("f", lambda n: self._own(n) and not self.aliases(n))
        return None if t is None else self._mutation(t, "setitem")

    def b_alias(self) -> Any:
        r = self.r
        t = self.pick("f", lambda n: self._own(n) and bool(self.aliases(n)))
        if t is not None:
            return self._mutation(t, "alias")
        base = self.pick("f", lambda n: self._own(n) and self.t(n).dim() >= 1)
        if base is None:
            return None
        s = self.shp(base)
        nd = len(s)
        w = self.new()
        view = self.choice([f"{base}[{r.randrange(s[0])}]", f"{base}.unsqueeze(0)",
                            f"{base}.view(-1)" if self.t(base).is_contiguous() else f"{base}[:]",
                            f"{base}[..., 1:]" if s[-1] > 1 else f"{base}[..., :1]",
                            f"{base}.transpose(0, 1)" if nd >= 2 else f"{base}[None]",
                            f"{base}.narrow(0, 0, 1)", f"{base}.diagonal()" if nd >= 2
                            else f"{base}[::2]"])
        if not self.add([(f"{w} = {view}", (w,), "alias")]):
            return None
        target = self.choice([w, base])
        return self._mutation(target, "alias")
