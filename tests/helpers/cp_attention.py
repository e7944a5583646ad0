"""Definitions more than one test module needs (a test module never imports another), moved out of
test_cp_attention.py; used by tests/distributed/hdp/test_cp_attention_dist.py,
tests/unit/hdp/test_cp_attention.py."""

from __future__ import annotations

import math

import torch

HQ, HKV, D = 4, 2, 8


def naive_causal(q, k, v, lengths, scale):
    """Full causal attention of each sample, float64, GQA by repeating kv heads."""
    g = q.shape[1] // k.shape[1]
    outs, off = [], 0
    for n in lengths:
        qs, ks, vs = q[off : off + n], k[off : off + n], v[off : off + n]
        sc = torch.einsum("ihd,jhd->hij", qs, ks.repeat_interleave(g, 1)) * scale  # [Hq, n, n]
        sc = sc.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
        outs.append(torch.einsum("hij,jhd->ihd", sc.softmax(-1), vs.repeat_interleave(g, 1)))
        off += n
    return torch.cat(outs) if outs else q.new_zeros((0,) + tuple(q.shape[1:]))
