"""Definitions more than one test module needs (a test module never imports another), moved out of
test_attention_variants.py; used by tests/distributed/hdp/test_attention_variants_dist.py,
tests/unit/hdp/test_attention_variants.py."""

from __future__ import annotations

import math

import torch

HQ, HKV, D, DV = 4, 2, 8, 6
TOL64 = 1e-10


def naive(q, k, v, lengths, scale, *, window=None, sink=None):
    """Causal attention per sample in float64 with an explicit mask: key j visible to query i iff
    i - window <= j <= i; ``sink`` [Hq]: one value-less logit per head in the denominator."""
    g = q.shape[1] // k.shape[1]
    outs, off = [], 0
    for n in lengths:
        qs, ks, vs = q[off : off + n], k[off : off + n], v[off : off + n]
        sc = torch.einsum("ihd,jhd->hij", qs, ks.repeat_interleave(g, 1)) * scale  # [Hq, n, n]
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        hide = j > i
        if window is not None:
            hide = hide | (j < i - window)
        sc = sc.masked_fill(hide, -math.inf)
        if sink is not None:
            sc = torch.cat([sc, sink.to(sc.dtype)[:, None, None].expand(-1, n, 1)], dim=-1)  # [Hq, n, n+1]
        p = sc.softmax(-1)[..., :n]
        outs.append(torch.einsum("hij,jhd->ihd", p, vs.repeat_interleave(g, 1)))
        off += n
    return torch.cat(outs) if outs else q.new_zeros((0, q.shape[1], v.shape[2]))


def _qkv(total, seed, dv=DV, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(total, HQ, D, generator=gen, dtype=dtype)
    k = torch.randn(total, HKV, D, generator=gen, dtype=dtype)
    v = torch.randn(total, HKV, dv, generator=gen, dtype=dtype)
    dout = torch.randn(total, HQ, dv, generator=gen, dtype=dtype)
    return q, k, v, dout
