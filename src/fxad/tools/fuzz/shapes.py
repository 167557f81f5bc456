"""Op families on shapes (:class:`_ShapeFamilies`): views and reshapes, slicing,
integer-tensor indexing, ``cat``/``stack`` and ``split``/``chunk``/``unbind``."""
from __future__ import annotations

import math
from typing import Any

import torch

from .state import _lit, _State


class _ShapeFamilies(_State):
    """Statement generators of the shape families (``b_<family>``)."""

    def _reshape_target(self, shape: tuple[int, ...]) -> tuple[int, ...] | None:
        r = self.r
        nd = len(shape)
        opts: list[tuple[int, ...]] = [(-1,), (math.prod(shape),)]
        if nd >= 2:
            i = r.randrange(nd - 1)
            opts.append(shape[:i] + (shape[i] * shape[i + 1],) + shape[i + 2:])
            opts.append(shape[:i] + (-1,) + shape[i + 2:])
        for i, s in enumerate(shape):
            if s == 4:
                opts.append(shape[:i] + (2, 2) + shape[i + 1:])
            if s == 1:
                opts.append(shape[:i] + shape[i + 1:])
        i = r.randrange(nd + 1)
        opts.append(shape[:i] + (1,) + shape[i:])
        return self.choice(opts)

    def b_view(self) -> Any:
        r = self.r
        a = self.pick("fi" if r.random() < 0.15 else "f")
        if a is None:
            return None
        s = self.shp(a)
        nd = len(s)
        forms = [f"{a}.unsqueeze({r.randint(-nd - 1, nd)})", f"{a}[None]", f"{a}.clone()",
                 f"{a}.contiguous()", f"{a}.reshape({self._reshape_target(s)})",
                 f"torch.reshape({a}, {self._reshape_target(s)})"]
        if nd == 0:
            forms += [f"{a}.expand({r.randint(2, 3)})", f"{a}.view(1, 1)"]
            return self.one("view", self.choice(forms))
        d = self.dim(nd)
        tgt = self._reshape_target(s)
        forms += [f"{a}.view({tgt})" if self.t(a).is_contiguous() else f"{a}.reshape({tgt})",
                  f"{a}.flatten()", f"{a}.flip({d})", f"torch.roll({a}, 1, {d})",
                  f"{a}[:, None]" if nd >= 1 else f"{a}[None]",
                  f"{a}.narrow({d}, {r.randrange(s[d])}, 1)",
                  f"{a}.select({d}, {r.randrange(-s[d], s[d])})",
                  f"{a}.repeat({', '.join(str(r.choice([1, 2])) for _ in range(nd))})",
                  f"{a}.view(-1)" if self.t(a).is_contiguous() else f"{a}.reshape(-1)"]
        if s[d] > 1:
            forms.append(f"{a}.narrow({d}, 1, {s[d] - 1})")
        if 1 in s:
            i = s.index(1)
            forms += [f"{a}.squeeze({i})", f"{a}.squeeze()",
                      f"{a}.expand("
                      f"{', '.join(str(r.choice([2, 3])) if x == 1 else '-1' for x in s)})"]
        forms += [f"{a}.expand({r.choice([2, 3])}, {', '.join(str(x) for x in s)})",
                  f"torch.broadcast_to({a}, {(2,) + s})"]
        if nd >= 2:
            perm = list(range(nd))
            r.shuffle(perm)
            d1, d2 = r.sample(range(nd), 2)
            forms += [f"{a}.permute({', '.join(map(str, perm))})",
                      f"torch.permute({a}, {tuple(perm)})",
                      f"{a}.transpose({d1}, {d2 - nd if r.random() < 0.3 else d2})",
                      f"torch.transpose({a}, {d1}, {d2})", f"{a}.mT",
                      f"torch.movedim({a}, {d1}, {d2})", f"{a}.diagonal()",
                      f"torch.tril({a})", f"{a}.triu(1)", f"{a}.flatten({r.randrange(nd - 1)})"]
            if nd == 2:
                forms += [f"{a}.t()", f"{a}.T"]
        if 4 in s:
            forms.append(f"{a}.unflatten({s.index(4)}, (2, -1))")
        ex = [n for n in self.order if n != a and self.broadcastable(n, a, onto=True)
              and self.shp(n) != s]
        if ex:
            forms.append(f"{a}.expand_as({self.choice(ex)})")
        return self.one("view", self.choice(forms))

    def b_slice(self) -> Any:
        a = self.pick("fi" if self.r.random() < 0.1 else "f", lambda n: self.t(n).dim() >= 1)
        if a is None:
            return None
        return self.one("slice", f"{a}[{self.slice_expr(self.shp(a))}]")

    def b_index(self) -> Any:
        r = self.r
        a = self.pick("f", lambda n: self.t(n).dim() >= 1)
        if a is None:
            return None
        s = self.shp(a)
        nd = len(s)
        d = r.randrange(nd)
        n = s[d]
        c = r.random()
        if c < 0.3:
            idx = self.index_tensor(n, negative=True)
            if d == 0:
                forms = [f"{a}[{idx}]"]
                if nd >= 2:
                    idx2 = self.index_tensor(s[1], length=len(eval(idx, self.ns)), negative=True)
                    forms += [f"{a}[{idx}, {idx2}]", f"{a}[{idx}, 1:]"]
            elif d == nd - 1:
                forms = [f"{a}[..., {idx}]"]
            else:
                forms = [f"{a}[:, {idx}]"]
            return self.one("index", self.choice(forms))
        if c < 0.5:
            idx = self.index_tensor(n)
            return self.one("index", self.choice([f"{a}.index_select({d}, {idx})",
                                                  f"torch.index_select({a}, {d}, {idx})"]))
        if c < 0.7:
            # gather along d with a literal index no larger than a elsewhere
            ishape = [x if k == d else r.randint(1, x) for k, x in enumerate(s)]
            ishape[d] = r.randint(1, 4)
            vals = torch.randint(0, n, ishape, generator=torch.Generator().manual_seed(
                r.randrange(2 ** 31))).tolist()
            return self.one("index", self.choice([f"torch.gather({a}, {d}, {_lit(vals)})",
                                                  f"{a}.gather({d}, {_lit(vals)})"]))
        b = self.pick("f", lambda k: self.shp(k) == s) or a
        forms = [f"torch.take_along_dim({a}, {b}.argsort({d}), {d})",
                 f"{a}.gather({d}, {b}.argsort({d}, descending=True))",
                 f"{a}.sort({d}).values", f"torch.topk({a}, 1, {d}).values",
                 f"{a}.take({self.index_tensor(math.prod(s))})",
                 f"{a}.scatter({d}, {b}.argsort({d}), {b})",
                 f"{a}.index_add({d}, {self.index_tensor(n, length=n)}, {b})"]
        if n >= 2:
            forms.append(f"torch.topk({a}, 2, {d}, largest=False).values")
        return self.one("index", self.choice(forms))

    def b_join(self) -> Any:
        r = self.r
        a = self.pick("f", lambda n: self.t(n).dim() >= 1)
        if a is None:
            return None
        s = self.shp(a)
        nd = len(s)
        d = r.randrange(nd)
        if r.random() < 0.6:
            parts = [n for n in self.order if self.kind(n) == "f" and self.t(n).dim() == nd
                     and all(x == y for k, (x, y) in enumerate(zip(self.shp(n), s)) if k != d)]
            others = [self.choice(parts) for _ in range(r.choice([1, 1, 2]))]
            seq = [a] + others
            r.shuffle(seq)
            dd = d - nd if r.random() < 0.3 else d
            return self.one("join", self.choice([f"torch.cat([{', '.join(seq)}], {dd})",
                                                 f"torch.cat(({', '.join(seq)}), dim={dd})",
                                                 f"torch.concat([{', '.join(seq)}], {dd})"]))
        parts = [n for n in self.order if self.kind(n) == "f" and self.shp(n) == s]
        seq = [a, self.choice(parts)]
        dd = r.randint(-nd - 1, nd)
        forms = [f"torch.stack([{', '.join(seq)}], {dd})", f"torch.stack(({seq[1]},))"]
        if nd <= 2:
            forms += [f"torch.hstack([{', '.join(seq)}])", f"torch.vstack([{', '.join(seq)}])"]
        return self.one("join", self.choice(forms))

    def b_split(self) -> Any:
        r = self.r
        a = self.pick("f", lambda n: any(x >= 2 for x in self.shp(n)))
        if a is None:
            return None
        s = self.shp(a)
        d = self.choice([k for k, x in enumerate(s) if x >= 2])
        n = s[d]
        c = r.random()
        if c < 0.35:
            k = r.randint(1, n - 1)
            v, w = self.new(), self.new()
            text = self.choice([f"{v}, {w} = {a}.split([{k}, {n - k}], {d})",
                                f"{v}, {w} = torch.split({a}, [{k}, {n - k}], dim={d})",
                                f"{v}, {w} = {a}.chunk(2, {d})",
                                f"{v}, {w} = torch.chunk({a}, 2, {d})"])
            return [(text, (v, w), "split")]
        if c < 0.55 and n <= 4:
            vs = [self.new() for _ in range(n)]
            return [(f"{', '.join(vs)} = {a}.unbind({d})", tuple(vs), "split")]
        return self.one("split", self.choice([
            f"{a}.split({r.randint(1, n - 1)}, {d})[{r.choice([0, -1])}]",
            f"torch.unbind({a}, {d})[{r.randrange(n)}]", f"{a}.chunk(3, {d})[-1]",
            f"{a}.tensor_split(2, {d})[0]", f"{a}.split(1, {d})[{r.randrange(-n, n)}]"]))
