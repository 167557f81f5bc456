"""Op families on values (:class:`_ValueFamilies`): elementwise unary and binary ops, Python
scalars, masks and ``where``, integer tensors, reductions, softmax, matmul,
``torch.nn.functional`` ops and tensor factories."""
from __future__ import annotations

from typing import Any

from .state import _broadcast, _lit, _State


class _ValueFamilies(_State):
    """Statement generators of the value families (``b_<family>``)."""

    def b_unary(self) -> Any:
        a = self.pick("f")
        if a is None:
            return None
        c = self.r.random()
        if c < 0.55:
            expr = self.choice([
                f"torch.sin({a})", f"{a}.cos()", f"torch.tanh({a})", f"{a}.sigmoid()",
                f"torch.relu({a})", f"F.relu({a})", f"{a}.abs()", f"torch.abs({a})", f"-{a}",
                f"{a}.neg()", f"torch.atan({a})", f"torch.erf({a})", f"F.softplus({a})",
                f"F.gelu({a})", f"F.silu({a})", f"F.elu({a})", f"F.leaky_relu({a}, 0.1)",
                f"{a}.clamp(-0.5, 0.8)", f"torch.clamp({a}, min=0.1)", f"{a}.square()",
                f"{a} ** 2", f"torch.floor({a})", f"{a}.sign()", f"F.hardtanh({a})",
                f"F.logsigmoid({a})", f"{a}.clamp(max=0.3)", f"torch.sinh({self.bounded(a)})",
                f"{self.bounded(a)}.pow(3)", f"{a}.detach()",
            ])
        elif c < 0.7:
            b = self.bounded(a)
            expr = self.choice([f"torch.exp({b})", f"{b}.exp()", f"torch.expm1({b})",
                                f"2 ** {b}", f"torch.exp2({b})"])
        else:
            p = self.positive(a)
            expr = self.choice([f"torch.log({p})", f"{p}.log()", f"torch.sqrt({p})",
                                f"{p}.sqrt()", f"torch.rsqrt({p})", f"{p}.reciprocal()",
                                f"torch.log1p({p})", f"{p} ** 0.5", f"{p} ** -1.5",
                                f"{p}.pow(1.3)", f"torch.log2({p})"])
        return self.one("unary", expr)

    def b_binary(self) -> Any:
        a = self.pick("f")
        if a is None:
            return None
        if self.r.random() < 0.15:
            b = a
        else:
            b = self.pick("f", lambda n: self.broadcastable(a, n))
            if b is None:
                return None
        d = self.denominator(b)
        expr = self.choice([
            f"{a} + {b}", f"{a} - {b}", f"{a} * {b}", f"{a} / {d}", f"torch.add({a}, {b})",
            f"torch.sub({a}, {b}, alpha=2)", f"{a}.mul({b})", f"torch.div({a}, {d})",
            f"torch.maximum({a}, {b})", f"torch.minimum({a}, {b})", f"torch.atan2({a}, {d})",
            f"{self.positive(a)} ** {self.bounded(b, 2)}", f"torch.lerp({a}, {b}, 0.3)",
            f"torch.where({a} > {b}, {a}, {b})", f"{a}.add({b}, alpha=0.5)",
            f"torch.addcmul({a}, {a}, {b}, value=0.5)", f"{a}.pow({self.choice(['2', '3'])}) - {b}",
        ])
        return self.one("binary", expr)

    def b_scalar(self) -> Any:
        a = self.pick("f")
        if a is None:
            return None
        s, s2 = self.scalar(), self.scalar()
        expr = self.choice([
            f"{a} + {s}", f"{s} + {a}", f"{s} - {a}", f"{a} * {s}", f"{s} * {a}",
            f"{a} / {s}", f"{s} / {self.denominator(a)}", f"{a} ** 3", f"torch.mul({a}, {s})",
            f"{a}.div({s})", f"torch.add({a}, {s})", f"{a}.sub({s}, alpha=2)",
            f"torch.rsub({a}, {s})", f"{a}.clamp(max={s})", f"torch.where({a} > 0, {a}, {s})",
            f"{a}.masked_fill({a} < {s}, {s2})", f"{a} * torch.tensor({s}, dtype=torch.float64)",
            f"{a} - {s}", f"{a} * 1", f"{a} + 0", f"{a} * 0", f"{s} ** {self.bounded(a)}",
            f"{a} - {a}", f"{a} / 1", f"{a} ** 1", f"{a} ** 0", f"-(-{a})", f"0 * {a} + {a}",
            f"{a} * 1.0 - 0.0", f"({a} * 0).sum()", f"{a} + {a}",
            f"{a} / {a}.detach().abs().clamp(min=1)",
        ])
        return self.one("scalar", expr)

    def b_mask(self) -> Any:
        r = self.r
        masks = [n for n in self.order if self.kind(n) == "b"]
        if masks and r.random() < 0.5:
            m = self.choice(masks)
        else:
            a = self.pick("f")
            if a is None:
                return None
            b = self.pick("f", lambda n: self.broadcastable(a, n))
            cmp = self.choice([f"{a} > {b}" if b else f"{a} > 0", f"{a} < 0.3", f"{a} >= 0",
                               f"torch.gt({a}, -0.2)", f"{a}.le(0.5)"])
            if r.random() < 0.4:
                return self.one("mask", cmp)
            m = f"({cmp})"
        if m in self.ns and r.random() < 0.3:
            m2 = self.choice(masks)
            if self.broadcastable(m, m2, onto=True):
                m = self.choice([f"({m} & {m2})", f"({m} | {m2})", f"(~{m2})"])
        mvar = m if m in self.ns else None
        a = self.pick("f", lambda n: mvar is None or self.broadcastable(n, mvar))
        if a is None:
            return None
        b = self.pick("f", lambda n: self.broadcastable(a, n))
        s = self.scalar()
        onto = mvar is None or self.broadcastable(a, mvar, onto=True)
        forms = [f"torch.where({m}, {a}, {s})", f"torch.where({m}, {s}, {a})",
                 f"{a} * {m}", f"{a} * {m}.double()", f"{m}.to(torch.float64) * {a}"]
        if b is not None:
            forms += [f"torch.where({m}, {a}, {b})", f"{a}.clamp(min={b})" if
                      self.broadcastable(a, b, onto=True) else f"{b} + {a}"]
        if onto:
            forms += [f"{a}.masked_fill({m}, {s})", f"{a}.where({m}, 0.0)"]
        return self.one("mask", self.choice(forms))

    def b_int(self) -> Any:
        r = self.r
        ints = [n for n in self.order if self.kind(n) == "i"]
        c = r.random()
        if c < 0.35 or not ints:
            a = self.pick("f")
            if a is None:
                return None
            t = self.t(a)
            nd = t.dim()
            forms = [f"{a}.long()", f"({a} * 3).long()", f"({a} > 0).sum({self.dim(nd)})"
                     if nd else f"({a} > 0).long()", f"{a}.to(torch.int64)"]
            if nd:
                d = self.dim(nd)
                forms += [f"{a}.argmax({d})", f"{a}.argmin({d}, keepdim=True)",
                          f"{a}.argsort({d})", f"{a}.sort({d}).indices",
                          f"torch.arange({t.shape[d]})", f"torch.arange({t.shape[d]}).flip(0)"]
            return self.one("int", self.choice(forms))
        k = self.choice(ints)
        own = [i for i in ints if not self.is_input_alias(i) and not self.aliases(i)]
        if own and r.random() < 0.35:  # an integer intermediate mutated in place
            i = self.choice(own)
            nd = self.t(i).dim()
            return [(self.choice([f"{i}.add_(1)", f"{i}.clamp_(0, 3)", f"{i} //= 2",
                                  f"{i}[0] = 1" if nd else f"{i}.mul_(2)",
                                  f"{i}.masked_fill_({i} > 2, 0)"]), (), "int")]
        if c < 0.55:
            return self.one("int", self.choice([
                f"{k} + 1", f"{k} * 2", f"{k} % 3", f"{k} // 2", f"{k}.clamp(0, 3)",
                f"{k} - 2", f"torch.remainder({k}, 4)", f"{k}.flip(0)" if self.t(k).dim() else
                f"{k} + 2"]))
        a = self.pick("f", lambda n: self.broadcastable(n, k))
        if a is None:
            return None
        b = self.pick("f", lambda n: self.broadcastable(a, n) and self.broadcastable(n, k))
        forms = [f"{a} * {k}", f"{k} + {a}", f"{a} / ({k} + 1)", f"{a} * {k}.double()",
                 f"{a} + {k}.float()", f"{a} - {k}.to(torch.float64)", f"{a} ** ({k} % 3)",
                 f"{k} * 0.5 + {a}"]
        if b is not None:
            forms.append(f"torch.where({k} > 1, {a}, {b})")
        return self.one("int", self.choice(forms))

    def b_reduction(self) -> Any:
        a = self.pick("f")
        if a is None:
            return None
        t = self.t(a)
        nd = t.dim()
        bounded = t.numel() and t.abs().max() <= 3
        if nd == 0 or self.r.random() < 0.15:
            forms = [f"{a}.sum()", f"torch.sum({a})", f"{a}.mean()", f"{a}.amax()",
                     f"{a}.max()", f"torch.min({a})", f"{a}.norm()"]
            if bounded and t.numel() <= 8:
                forms.append(f"{a}.prod()")
            return self.one("reduction", self.choice(forms))
        d = self.dim(nd)
        n = t.shape[d]
        kd = self.choice(["True", "False"])
        forms = [
            f"{a}.sum({d})", f"torch.sum({a}, {d}, keepdim={kd})", f"{a}.mean({d}, keepdim={kd})",
            f"torch.amax({a}, {d}, keepdim={kd})", f"{a}.amin({d})", f"{a}.max({d}).values",
            f"torch.max({a}, {d}, keepdim=True)[0]", f"{a}.min({d})[0]",
            f"torch.logsumexp({a}, {d})", f"{a}.logsumexp({d}, keepdim=True)",
            f"torch.linalg.vector_norm({a}, dim={d})", f"{a}.norm(dim={d}, keepdim={kd})",
            f"{a}.cumsum({d})", f"torch.cummax({a}, {d}).values",
        ]
        if nd >= 2:
            d2 = self.choice([x for x in range(nd) if x != d % nd])
            forms += [f"{a}.sum(({d}, {d2}))", f"torch.mean({a}, ({d}, {d2}), keepdim={kd})",
                      f"torch.amax({a}, ({d}, {d2}))"]
        if n >= 2:
            forms += [f"{a}.var({d})", f"torch.var({a}, {d}, correction=0, keepdim={kd})",
                      f"{a}.std({d})"]
        if bounded and n <= 5:
            forms += [f"{a}.prod({d})", f"torch.prod({a}, {d}, keepdim={kd})",
                      f"torch.cumprod({a}, {d})"]
        return self.one("reduction", self.choice(forms))

    def b_softmax(self) -> Any:
        a = self.pick("f", lambda n: self.t(n).dim() >= 1)
        if a is None:
            return None
        d = self.dim(self.t(a).dim())
        return self.one("softmax", self.choice([
            f"torch.softmax({a}, {d})", f"{a}.softmax({d})", f"F.softmax({a}, dim={d})",
            f"torch.log_softmax({a}, {d})", f"{a}.log_softmax({d})", f"F.log_softmax({a}, {d})",
            f"{a}.softmax({d}, dtype=torch.float64)"]))

    def b_matmul(self) -> Any:
        a = self.pick("f", lambda n: self.t(n).dim() >= 1)
        if a is None:
            return None
        k = self.shp(a)[-1]

        def ok(n: str) -> bool:
            s = self.shp(n)
            if len(s) == 1:
                return s[0] == k
            if len(s) < 2 or s[-2] != k:
                return False
            return _broadcast(self.shp(a)[:-2], s[:-2]) is not None

        b = self.pick("f", ok)
        if b is None:
            if self.t(a).dim() == 1:
                return self.one("matmul", f"torch.outer({a}, {a})")
            return self.one("matmul", f"{a} @ {a}.mT" if self.t(a).dim() >= 2 else f"{a} @ {a}")
        forms = [f"{a} @ {b}", f"torch.matmul({a}, {b})"]
        if self.t(a).dim() == 2 and self.t(b).dim() == 2:
            forms.append(f"torch.mm({a}, {b})")
        return self.one("matmul", self.choice(forms))

    def b_nn(self) -> Any:
        r = self.r
        a = self.pick("f", lambda n: self.t(n).dim() >= 1)
        if a is None:
            return None
        s = self.shp(a)
        nd, k = len(s), s[-1]
        c = r.random()
        if c < 0.2:
            w = self.pick("f", lambda n: self.t(n).dim() == 2 and self.shp(n)[1] == k)
            if w is None:
                return None
            bias = self.pick("f", lambda n: self.shp(n) in ((self.shp(w)[0],), ()))
            args = f"{a}, {w}" + (f", {bias}" if bias and r.random() < 0.6 else "")
            return self.one("nn", f"F.linear({args})")
        if c < 0.4 and nd <= 2:
            n_cls = k
            rows = 1 if nd == 1 else s[0]
            ints = [i for i in self.order if self.kind(i) == "i" and
                    self.shp(i) == ((rows,) if nd == 2 else ())]
            tgt = f"({self.choice(ints)} % {n_cls})" if ints and r.random() < 0.5 else \
                _lit([r.randrange(n_cls) for _ in range(rows)] if nd == 2 else r.randrange(n_cls))
            red = self.choice(["", ", reduction='sum'", ", reduction='none'"])
            return self.one("nn", self.choice([
                f"F.cross_entropy({a}, {tgt}{red})",
                f"F.nll_loss(F.log_softmax({a}, -1), {tgt}{red})" if nd == 2 else
                f"F.cross_entropy({a}, {tgt})"]))
        if c < 0.5:
            idx = self.pick("i", lambda n: self.t(n).numel() <= 16)
            w = self.pick("f", lambda n: self.t(n).dim() == 2)
            if idx is None or w is None:
                return None
            return self.one("nn", self.choice([
                f"F.embedding({idx} % {self.shp(w)[0]}, {w})",
                f"F.one_hot({idx} % {k}, {k}).double() * {a}" if self.broadcastable(
                    a, idx) else f"F.embedding({idx} % {self.shp(w)[0]}, {w})"]))
        b = self.pick("f", lambda n: self.shp(n) == s)
        d = self.dim(nd)
        forms = [f"F.pad({a}, ({r.randint(0, 2)}, {r.randint(0, 2)}))",
                 f"F.normalize({a}, dim={d})", f"F.layer_norm({a}, ({k},))",
                 f"torch.flatten({a})", f"F.softplus({a}, beta=2)"]
        if s[d] >= 2:
            forms.append(f"torch.diff({a}, dim={d})")
        if b is not None:
            forms += [f"F.mse_loss({a}, {b})", f"F.l1_loss({a}, {b}, reduction='sum')",
                      f"F.smooth_l1_loss({a}, {b})", f"torch.dist({a}, {b})"]
        if nd == 2:
            forms.append(f"torch.einsum('ij->ji', {a})")
            if b is not None:
                forms += [f"torch.einsum('ij,ij->i', {a}, {b})",
                          f"torch.einsum('ij,kj->ik', {a}, {b})"]
        return self.one("nn", self.choice(forms))

    def b_factory(self) -> Any:
        a = self.pick("f")
        if a is None:
            return None
        s = self.shp(a)
        forms = [f"torch.zeros_like({a})", f"torch.ones({s}, dtype=torch.float64)",
                 f"{a}.new_zeros({s})", f"torch.full({s}, 0.5, dtype=torch.float64)",
                 f"torch.zeros({s}, dtype=torch.float64)", f"torch.ones_like({a}) * 2",
                 f"torch.empty_like({a}).copy_({a})"]
        if len(s) == 1:
            forms += [f"torch.arange({s[0]}, dtype=torch.float64)",
                      f"torch.linspace(0, 1, {s[0]}, dtype=torch.float64)"]
        return self.one("factory", self.choice(forms))
