"""Rules for distance functions: ``F.cosine_similarity``, ``F.pairwise_distance``, ``F.pdist``
and ``torch.cdist``.

p-norm cotangents share :func:`fxad.rules._base.pnorm_grad` (derivatives.yaml
``linalg_vector_norm``: norm_backward; ``_cdist_backward``, ``_pdist_backward``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .._base import pnorm_grad, randn, _t
from ..registry import register_vjp


@register_vjp(F.cosine_similarity)
class CosineSimilarity:
    """cosine_similarity(a, b, dim, eps) = sum(a b, dim) / (max(|a|, eps) max(|b|, eps)) with
    a, b broadcast: d_a = d (b / (|a||b|) - cos a / |a|^2) (the norms' eps clamps are made
    without grad in ATen's cosine_similarity, so they scale only)."""

    def fwd(x1, x2, dim=1, eps=1e-8):
        out = F.cosine_similarity(x1, x2, dim, eps)
        return out, (x1, x2, out, dim, eps)

    def bwd(aux, d):
        a, b, out, dim, eps = aux
        shape = torch.broadcast_shapes(tuple(a.shape), tuple(b.shape))
        if tuple(a.shape) != tuple(shape):
            a = a.expand(shape)
        if tuple(b.shape) != tuple(shape):
            b = b.expand(shape)
        dim = dim % len(shape)
        na = torch.clamp_min(torch.linalg.vector_norm(a, 2, dim, keepdim=True), eps)
        nb = torch.clamp_min(torch.linalg.vector_norm(b, 2, dim, keepdim=True), eps)
        d = torch.unsqueeze(d, dim)
        c = torch.unsqueeze(out, dim)
        d_a = d * (b / (na * nb) - c * a / (na * na))
        d_b = d * (a / (na * nb) - c * b / (nb * nb))
        return d_a, d_b

    def samples(dtype):
        yield (_t((3, 4), dtype), _t((3, 4), dtype)), {}
        yield (_t((3, 4, 2), dtype), _t((4, 2), dtype), -1), {}


@register_vjp(F.pairwise_distance)
class PairwiseDistance:
    """pairwise_distance(a, b, p, eps, keepdim) = ||a - b + eps||_p over the last dim:
    d_a = dn/dz, d_b = -dn/dz (derivatives.yaml `linalg_vector_norm`)."""

    def fwd(x1, x2, p=2.0, eps=1e-6, keepdim=False):
        out = F.pairwise_distance(x1, x2, p, eps, keepdim)
        return out, (x1, x2, out, p, eps, keepdim)

    def bwd(aux, d):
        a, b, out, p, eps, keepdim = aux
        z = a - b + eps
        if z.dim() == 0:
            return pnorm_grad(z, out, p, d), -pnorm_grad(z, out, p, d)
        if not keepdim and out.dim() < z.dim():
            out, d = torch.unsqueeze(out, -1), torch.unsqueeze(d, -1)
        g = pnorm_grad(z, out, p, d, -1)
        return g, -g

    def samples(dtype):
        yield (_t((3, 4), dtype), _t((3, 4), dtype)), {}
        yield (_t((3, 4), dtype), _t((4,), dtype), 1.5), {"keepdim": True}


@register_vjp(torch.cdist)
class Cdist:
    """cdist(x1, x2, p)[..., i, j] = ||x1_i - x2_j||_p: with g_ij the p-norm cotangent of
    x1_i - x2_j, d_x1 = sum_j g_ij, d_x2 = -sum_i g_ij (derivatives.yaml `_cdist_forward`:
    _cdist_backward)."""

    def fwd(x1, x2, p=2.0, compute_mode="use_mm_for_euclid_dist_if_necessary"):
        out = torch.cdist(x1, x2, p, compute_mode)
        return out, (x1, x2, out, p)

    def bwd(aux, d):
        a, b, out, p = aux
        diff = torch.unsqueeze(a, -2) - torch.unsqueeze(b, -3)
        g = pnorm_grad(diff, torch.unsqueeze(out, -1), p, torch.unsqueeze(d, -1), -1)
        return torch.sum(g, -2), -torch.sum(g, -3)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), randn(5, 4, dtype=dtype)), {}
        yield (randn(2, 3, 4, dtype=dtype), randn(2, 5, 4, dtype=dtype), 1.5), {}
        yield (randn(3, 4, dtype=dtype), randn(5, 4, dtype=dtype), math.inf), {}


@register_vjp(torch.nn.functional.pdist)
class Pdist:
    """pdist(x, p)[k] = ||x_i - x_j||_p over the pairs i < j (row-major): with g_k the p-norm
    cotangent of x_i - x_j, d_x = index_add of g_k at i minus at j (derivatives.yaml
    `_pdist_forward`: _pdist_backward)."""

    def fwd(input, p=2):
        out = torch.nn.functional.pdist(input, p)
        return out, (input, out, p)

    def bwd(aux, d):
        x, out, p = aux
        n = x.shape[0]
        ij = torch.triu_indices(n, n, 1, device=x.device)
        i, j = ij[0], ij[1]
        z = x[i] - x[j]
        g = pnorm_grad(z, torch.unsqueeze(out, -1), p, torch.unsqueeze(d, -1), -1)
        return (torch.zeros_like(x).index_add(0, i, g).index_add(0, j, -g),)

    def jvp(primals, tangents):
        x, p = primals
        t = tangents[0]
        out = torch.nn.functional.pdist(x, p)
        if t is None:
            return out, None
        n = x.shape[0]
        ij = torch.triu_indices(n, n, 1, device=x.device)
        z = x[ij[0]] - x[ij[1]]
        tz = t[ij[0]] - t[ij[1]]
        g = pnorm_grad(z, torch.unsqueeze(out, -1), p, torch.ones_like(torch.unsqueeze(out, -1)),
                       -1)
        return out, torch.sum(g * tz, -1)

    def samples(dtype):
        yield (randn(4, 3, dtype=dtype),), {}
        yield (randn(4, 3, dtype=dtype), 1.5), {}
