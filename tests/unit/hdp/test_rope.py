"""Packed RoPE after the zigzag split equals per-sample RoPE before the split (float64, 1e-12)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.dispatch_reference import local_metas, select_local
from hdp.rope import apply_rope, apply_rope_packed, rope_cos_sin, rope_inv_freq
from helpers.plan_factory import plan_with_k, random_plan

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


# ---- frequency variants against transformers' own definitions --------------------------------------------


def _hf_cases():
    from transformers import LlamaConfig, Qwen3Config

    from hdp.rope import RopeScaling

    common = dict(hidden_size=64, num_attention_heads=4, max_position_embeddings=1024)
    return [
        ("llama3", LlamaConfig(**common, rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 64}),
         RopeScaling(type="llama3", factor=8.0, original_max_position_embeddings=64), 5e5),
        ("yarn", Qwen3Config(**common, head_dim=16, rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                                                     "original_max_position_embeddings": 32}),
         RopeScaling(type="yarn", factor=4.0, original_max_position_embeddings=32), 1e6),
        ("yarn-deepseek", Qwen3Config(**common, head_dim=16, rope_parameters={
            "rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0, "original_max_position_embeddings": 64,
            "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 16, "truncate": False}),
         RopeScaling(type="yarn", factor=40.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=0.707,
                     beta_fast=16, truncate=False), 1e4),
        ("linear", LlamaConfig(**common, rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}),
         RopeScaling(type="linear", factor=2.0), 1e4),
        ("dynamic", LlamaConfig(**common, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
         RopeScaling(type="dynamic", factor=2.0, original_max_position_embeddings=1024), 1e4),
    ]


@pytest.mark.parametrize("index", range(5))
def test_frequencies_match_transformers(index):
    """inv_freq and the attention factor of every variant equal transformers' (to its float32 evaluation: 2e-6
    relative, the YaRN ramp between whole dims in float32), and the cos/sin tables at positions up to 300."""
    pytest.importorskip("transformers")
    import warnings

    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from hdp.rope import rope_frequencies

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        name, hf, spec, base = _hf_cases()[index]
    kind = hf.rope_parameters["rope_type"]
    want, factor = ROPE_INIT_FUNCTIONS[kind](hf, "cpu")
    got, got_factor = rope_frequencies(16, base=base, scaling=spec, dtype=torch.float64)
    torch.testing.assert_close(got, want.double(), rtol=2e-6, atol=0, msg=lambda m: f"{name}: {m}")
    assert got_factor == pytest.approx(factor, rel=1e-12), name
    pos = torch.arange(300)
    cos, sin = rope_cos_sin(pos, 16, base=base, scaling=spec, dtype=torch.float64)
    ang = pos[:, None].double() * want.double()[None]
    torch.testing.assert_close(cos[:, 0, :8], ang.cos() * factor, atol=1e-4, rtol=0)  # float32 inv_freq x 300
    torch.testing.assert_close(sin[:, 0, 8:], ang.sin() * factor, atol=1e-4, rtol=0)


def test_rope_scaling_validation_names_the_field():
    from hdp.rope import RopeScaling

    with pytest.raises(ValueError, match="RopeScaling.type='longrope'"):
        RopeScaling(type="longrope")
    with pytest.raises(ValueError, match="original_max_position_embeddings=None: rope_type llama3"):
        RopeScaling(type="llama3", factor=8.0)
    with pytest.raises(ValueError, match="low_freq_factor=4.0, high_freq_factor=1.0"):
        RopeScaling(type="llama3", factor=8.0, original_max_position_embeddings=64, low_freq_factor=4.0,
                    high_freq_factor=1.0)
    with pytest.raises(ValueError, match="factor=0"):
        RopeScaling(type="linear", factor=0)


def test_decoupled_rope_part_rotates_the_tail():
    """``start``: a RoPE part at the end of the head (MLA's q_pe / k_pe) rotates as a head of its own."""
    x = torch.randn(5, 2, 12, dtype=torch.float64)
    cos, sin = rope_cos_sin(torch.arange(5), 4, dtype=torch.float64)
    out = apply_rope(x, cos, sin, start=8)
    assert torch.equal(out[..., :8], x[..., :8])
    torch.testing.assert_close(out[..., 8:], apply_rope(x[..., 8:].contiguous(), cos, sin), atol=0, rtol=0)


def test_interleaved_rope_is_transformers_and_megatrons_mla_rope():
    """``interleaved``: transformers' ``apply_rotary_pos_emb_interleave`` (DeepSeek-V3 ``rope_interleave``) and
    Megatron's MLA RoPE (``_apply_rotary_pos_emb_bshd`` with ``multi_latent_attention``), bit for bit in float64,
    on a decoupled tail; without it the result differs."""
    pytest.importorskip("transformers")
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    t, h, nope, dr = 7, 3, 6, 8
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(t, h, nope + dr, generator=gen, dtype=torch.float64)
    k = torch.randn(t, 1, nope + dr, generator=gen, dtype=torch.float64)
    pos = torch.tensor([0, 1, 2, 9, 4, 0, 30])
    cos, sin = rope_cos_sin(pos, dr, base=777.0, dtype=torch.float64)  # [T, 1, Dr]
    got_q = apply_rope(q, cos, sin, start=nope, interleaved=True)
    got_k = apply_rope(k, cos, sin, start=nope, interleaved=True)
    assert torch.equal(got_q[..., :nope], q[..., :nope])
    # transformers: [B, H, S, Dr] with cos/sin [B, S, Dr]
    hq, hk = apply_rotary_pos_emb_interleave(q[..., nope:].transpose(0, 1)[None], k[..., nope:].transpose(0, 1)[None],
                                             cos[:, 0][None], sin[:, 0][None])
    torch.testing.assert_close(got_q[..., nope:], hq[0].transpose(0, 1), atol=0, rtol=0)
    torch.testing.assert_close(got_k[..., nope:], hk[0].transpose(0, 1), atol=0, rtol=0)

    half = torch.atan2(sin[..., : dr // 2], cos[..., : dr // 2])  # the angles back, [T, 1, Dr/2]
    freqs = torch.cat([half, half], dim=-1)[:, None]  # [T, 1, 1, Dr] (Megatron's sbhd freqs)
    mega = _apply_rotary_pos_emb_bshd(q[:, None, :, nope:], freqs, multi_latent_attention=True)[:, 0]
    torch.testing.assert_close(got_q[..., nope:], mega, atol=1e-12, rtol=0)
    plain = apply_rope(q, cos, sin, start=nope)
    assert (plain - got_q).abs().max() > 1e-3
