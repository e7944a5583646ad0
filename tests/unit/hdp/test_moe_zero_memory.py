"""MoE zero-memory recomputation (hdp.moe): exactness against Megatron's MoE layer, overlap order,
a whole MoE GPT step, metadata and the token-budget model.

Tolerances (float32): the zero-memory path runs the same GEMMs on the same rows as Megatron's
path, only in a different autograd graph, so outputs and gradients agree to fp32 round-off:
atol 1e-6 on O(1e-2..1) values, rtol 1e-5.  Parameters after one Adam step: 1e-6 absolute (as in
test_megatron_model: 0.1% of the lr = 1e-3 update).
"""

from __future__ import annotations

import pytest
import torch


# ---- pure pieces --------------------------------------------------------------------------------


def test_dispatch_meta_matches_megatron_layout() -> None:
    from hdp.moe import dispatch_meta, permutation_indices

    # 2 EP ranks, 4 experts (2 local each); counts[src, expert]
    counts = torch.tensor([[1, 0, 2, 3], [2, 1, 0, 4]])
    m0 = dispatch_meta(counts, 0)
    assert m0.input_splits == (1, 5) and m0.output_splits == (1, 3)
    assert m0.tokens_per_local_expert == (3, 1)
    # received: [src0: e0(1)] [src1: e0(2), e1(1)] -> grouped: e0 from src0, e0 from src1, e1 from src1
    assert m0.group_index is None  # already grouped
    m1 = dispatch_meta(counts, 1)
    assert m1.output_splits == (5, 4) and m1.tokens_per_local_expert == (2, 7)
    # received rows: src0 e2 (0,1) e3 (2,3,4); src1 e2 () e3 (5..8) -> grouped e2: 0,1  e3: 2,3,4,5,6,7,8
    assert m1.group_index is None
    counts = torch.tensor([[1, 2, 1, 1], [2, 1, 0, 4]])
    m0 = dispatch_meta(counts, 0)
    # received: src0 e0 [0] e1 [1,2]; src1 e0 [3,4] e1 [5] -> grouped e0: 0,3,4  e1: 1,2,5
    assert m0.group_index.tolist() == [0, 3, 4, 1, 2, 5]
    routing = torch.tensor([[True, False, True], [False, False, True], [True, True, False]])
    assert permutation_indices(routing).tolist() == [0, 2, 2, 0, 1]
    with pytest.raises(ValueError, match="ep_rank"):
        dispatch_meta(counts, 2)


def test_levels_and_budget() -> None:
    from hdp.moe import MoEShape, ZeroMemoryLevel, layer_levels, token_budget_with_zero_memory

    L0, L1 = ZeroMemoryLevel.LEVEL0, ZeroMemoryLevel.LEVEL1
    assert ZeroMemoryLevel.parse("level1") is L1
    with pytest.raises(ValueError, match="choose one of"):
        ZeroMemoryLevel.parse("level2")
    assert layer_levels("level1", 4, first_n_layers=2) == [L1, L1, L0, L0]
    assert layer_levels("level0", 3) == [L0, L0, L0]
    with pytest.raises(ValueError, match="first_n_layers"):
        layer_levels("level0", 3, first_n_layers=1)
    shape = MoEShape(hidden_size=4096, moe_ffn_hidden_size=1536, topk=8)
    b0 = token_budget_with_zero_memory(16384, "level0", shape)
    b1 = token_budget_with_zero_memory(16384, "level1", shape)
    assert token_budget_with_zero_memory(16384, "none", shape) == 16384
    assert 2 * 16384 < b0 < b1  # a 128K sample: CP8 at B=16K, CP4 with level0
    assert -(-131072 // 16384) == 8 and -(-131072 // b0) == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_swiglu_backward_equals_autograd(dtype: torch.dtype, offset: float) -> None:
    """The written-out SwiGLU x probs backward of the zero-memory path gives autograd's bits
    (Megatron MLP's unfused graph: chunk, silu, (b + offset), x probs, .to(dtype), fc2)."""
    import torch.nn.functional as F

    from hdp.moe.zero_memory import _swiglu_grads, _swiglu_z

    g = torch.Generator().manual_seed(3)
    n, f, h = 37, 24, 16
    x = torch.randn(n, 2 * f, generator=g).to(dtype)
    p = torch.rand(n, generator=g)  # fp32 router probs
    dy = torch.randn(n, h, generator=g).to(dtype)
    w2 = torch.randn(h, f, generator=g).to(dtype)
    xr, pr, w2r = (t.clone().requires_grad_(True) for t in (x, p, w2))
    a, b = torch.chunk(xr, 2, dim=-1)
    act = F.silu(a) * (b + offset)
    ((act * pr.unsqueeze(-1)).to(act.dtype) @ w2r.t()).backward(dy)
    dx = torch.empty_like(x)
    z, parts = _swiglu_z(x, p, offset)
    dw2 = dy.t().matmul(z)  # what the zero-memory path's grouped weight-gradient GEMM computes per expert
    dp = _swiglu_grads(parts, p, dy.matmul(w2), dx)
    assert torch.equal(dx, xr.grad) and torch.equal(dp, pr.grad) and torch.equal(dw2, w2r.grad)
    assert dp.dtype == p.dtype and dx.dtype == dtype


def test_model_config_grouped_gemm_is_validated() -> None:
    """ModelConfig.moe_grouped_gemm: needs a MoE model and bf16 (Megatron's GroupedMLP asserts bf16)."""
    from hdp.trainer.model import ModelConfig

    with pytest.raises(ValueError, match=r"ModelConfig.moe_grouped_gemm=True: needs a MoE model"):
        ModelConfig(moe_grouped_gemm=True, params_dtype="bfloat16")
    with pytest.raises(ValueError, match=r"moe_grouped_gemm=True with params_dtype='float32'.*bfloat16"):
        ModelConfig(num_moe_experts=4, moe_grouped_gemm=True)
    assert ModelConfig(num_moe_experts=4, moe_grouped_gemm=True, params_dtype="bfloat16").moe_grouped_gemm


def test_grouped_mlp_weights_shard_by_expert_across_ep_ranks() -> None:
    """init_parameters' GroupedMLP rule: EP rank r's weight1 [H, L·F1] (viewed [L, H, F1] by GroupedMLP) holds
    experts rL..rL+L-1 of the one-process weight1 [H, E·F1] (viewed [E, H, F1]); weight2 [L·F, H] likewise."""
    from hdp.trainer.model import _grouped_expert_shard

    e, ep, hid, f1, f = 4, 2, 3, 10, 5
    n_local = e // ep
    full1 = torch.arange(hid * e * f1, dtype=torch.float32).view(hid, e * f1)
    full2 = torch.arange(e * f * hid, dtype=torch.float32).view(e * f, hid)
    for r in range(ep):
        w1 = _grouped_expert_shard(full1, torch.empty(hid, n_local * f1), r)
        w2 = _grouped_expert_shard(full2, torch.empty(n_local * f, hid), r)
        for local in range(n_local):
            glob = r * n_local + local
            assert torch.equal(w1.view(n_local, hid, f1)[local], full1.view(e, hid, f1)[glob])
            assert torch.equal(w2.view(n_local, f, hid)[local], full2.view(e, f, hid)[glob])
