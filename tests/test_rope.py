"""Packed RoPE after the zigzag split equals per-sample RoPE before the split (float64, 1e-12)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dispatch_reference import local_metas, select_local
from hdp.rope import apply_rope, apply_rope_packed, rope_cos_sin, rope_inv_freq
from plan_factory import plan_with_k, random_plan

H, D = 3, 8


def _per_sample_reference(x: torch.Tensor, rotary_dim: int, base: float) -> torch.Tensor:
    """Textbook rotate-half RoPE of one whole sample x [L, H, D], positions 0..L-1 (float64)."""
    length = x.shape[0]
    inv = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))  # [Dr/2]
    ang = torch.arange(length, dtype=torch.float64)[:, None] * inv[None]  # [L, Dr/2]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]  # [L, 1, Dr/2]
    half = rotary_dim // 2
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


@pytest.mark.parametrize("rotary_dim", [D, 4])
def test_packed_rope_matches_per_sample(rotary_dim):
    rng = np.random.default_rng(7)
    plans = [random_plan(rng, 4, 9, max_k=4, max_len=30) for _ in range(6)]
    plans += [plan_with_k(rng, 4, k, 5) for k in (1, 2, 4)]
    base = 500.0
    for plan in plans:
        gen = torch.Generator().manual_seed(int(plan.lengths.sum()))
        xs = [torch.randn(int(n), H, D, generator=gen, dtype=torch.float64) for n in plan.lengths]
        ref = [_per_sample_reference(x, rotary_dim, base) for x in xs]
        for rank in range(plan.num_ranks):
            for meta in local_metas(plan, rank):
                local = select_local(plan, rank, meta.round_index, xs)
                got = apply_rope_packed(local.values, local.meta.position_ids, base=base, rotary_dim=rotary_dim)
                want = select_local(plan, rank, meta.round_index, ref).values
                assert got.shape == want.shape
                torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_rope_dtype_device_and_identity():
    pos = torch.tensor([0, 5, 1, 0, 2])
    x = torch.randn(5, 2, 6, dtype=torch.bfloat16)
    cos, sin = rope_cos_sin(pos, 4, dtype=x.dtype)
    assert cos.shape == (5, 1, 4) and cos.dtype == torch.bfloat16
    out = apply_rope(x, cos, sin)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    # position 0 is the identity; dims beyond rotary_dim pass through untouched
    assert torch.equal(out[0], x[0]) and torch.equal(out[:, :, 4:], x[:, :, 4:])
    torch.testing.assert_close(rope_inv_freq(4, base=100.0, dtype=torch.float64),
                               torch.tensor([1.0, 0.1], dtype=torch.float64))


def test_rope_bad_input():
    with pytest.raises(ValueError, match="rotary_dim=3"):
        rope_cos_sin(torch.arange(4), 3)
    with pytest.raises(ValueError, match="larger than the head dim"):
        apply_rope_packed(torch.zeros(4, 1, 4), torch.arange(4), rotary_dim=8)
    with pytest.raises(ValueError, match="expected THD"):
        apply_rope_packed(torch.zeros(4, 4), torch.arange(4))
