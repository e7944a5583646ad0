"""Attention variants hdp computes (sliding windows by sample position, softmax sinks, a custom scale, value
heads of another width) and the table that classifies every attention setting of Megatron's TransformerConfig.

References: naive float64 attention with an explicit mask (kernel and CP levels, tolerance 1e-10 absolute,
float64 throughout), Megatron's own ``GPTModel`` with its local ``DotProductAttention`` on the same weights
(model level: logits 1e-5 absolute in float32, values O(1)).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from hdp.cp.metadata import StepCase, group_layouts, positions, rank_layout, ring_schedule, step_sees_keys
from hdp.kernels import KeyWindow, get_kernel, kernel_attention
from hdp.kernels import reference

from helpers.attention_variants import D, DV, HQ, TOL64, _qkv, naive


# ---- kernel level (one process) ---------------------------------------------------------------------


@pytest.mark.parametrize("window", [None, 0, 3, 20])
@pytest.mark.parametrize("sink_kind", [None, "zero", "learned"])
def test_local_kernel_window_sink_and_value_dim_match_naive(window, sink_kind):
    """kernel_attention (the reference kernel) against the naive mask, with
    gradients of q, k, v and the sink."""
    lengths = [13, 1, 30, 7]
    q, k, v, dout = _qkv(sum(lengths), 3)
    sink = None
    if sink_kind == "zero":
        sink = torch.zeros(HQ, dtype=torch.float64)
    elif sink_kind == "learned":
        sink = torch.randn(HQ, dtype=torch.float64, generator=torch.Generator().manual_seed(9)).requires_grad_()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in lengths])
    win = None if window is None else KeyWindow(window, pos, pos)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    kern = get_kernel(torch.device("cpu"))  # block sizes smaller than the window: test_reference_blocks_with_window
    out, lse = kernel_attention(*leaves, cu, cu, True, 0.37, kern, window=win, sink=sink)
    out.backward(dout)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_sink = sink.detach().clone().requires_grad_() if sink_kind == "learned" else sink
    ref = naive(*ref_leaves, lengths, 0.37, window=window, sink=ref_sink)
    ref.backward(dout)
    assert out.shape == (sum(lengths), HQ, DV)
    torch.testing.assert_close(out, ref, atol=TOL64, rtol=0)
    for a, b in zip(leaves, ref_leaves):
        torch.testing.assert_close(a.grad, b.grad, atol=TOL64, rtol=0)
    if sink_kind == "learned":
        torch.testing.assert_close(sink.grad, ref_sink.grad, atol=TOL64, rtol=0)


def test_kernels_without_windows_run_the_reference_for_those_calls():
    """An adapter that declares no window (flash-attn, torch-flash, NPU) is called for plain calls only; a
    windowed call runs the reference kernel."""
    from hdp.kernels import AttentionKernel, KernelName

    calls = []

    def fwd(*a):
        calls.append("fwd")
        return reference.attn_fwd(*a)

    kern = AttentionKernel(KernelName.TORCH_FLASH, fwd, reference.attn_bwd)
    q, k, v, _ = _qkv(10, 1, dv=D)
    cu = torch.tensor([0, 10], dtype=torch.int32)
    pos = torch.arange(10)
    kern.forward(q, k, v, cu, cu, True, 0.5)
    assert calls == ["fwd"]
    out, _ = kern.forward(q, k, v, cu, cu, True, 0.5, window=KeyWindow(2, pos, pos))
    assert calls == ["fwd"]  # it did not go to the adapter
    torch.testing.assert_close(out, naive(q, k, v, [10], 0.5, window=2), atol=TOL64, rtol=0)


@pytest.mark.parametrize("dv", [DV, 11])
def test_kernels_of_one_head_dim_get_the_narrower_side_zero_padded(dv):
    """Dv != D (MLA) on an adapter that needs one head dim (flash-attn 2, torch-flash, NPU): it is called with V
    (Dv < D) or Q and K (Dv > D) zero-padded to max(D, Dv), and forward and backward equal the naive attention."""
    from hdp.kernels import AttentionKernel, KernelName

    widths = []

    def fwd(q, k, v, *a):
        assert q.shape[-1] == k.shape[-1] == v.shape[-1]  # what the adapter's kernel requires
        widths.append(v.shape[-1])
        return reference.attn_fwd(q, k, v, *a)

    def bwd(dout, q, k, v, out, *a):
        assert dout.shape[-1] == q.shape[-1] == v.shape[-1] == out.shape[-1]
        widths.append(v.shape[-1])
        return reference.attn_bwd(dout, q, k, v, out, *a)

    kern = AttentionKernel(KernelName.FLASH_ATTN, fwd, bwd)
    lengths = [9, 4]
    q, k, v, dout = _qkv(sum(lengths), 3, dv=dv)
    cu = torch.tensor([0, 9, 13], dtype=torch.int32)
    out, lse = kern.forward(q, k, v, cu, cu, True, 0.4)
    grads = kern.backward(dout, q, k, v, out, lse, cu, cu, True, 0.4)
    assert widths == [max(D, dv)] * 2 and out.shape == (13, HQ, dv)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = naive(*leaves, lengths, 0.4)
    ref.backward(dout)
    torch.testing.assert_close(out, ref, atol=TOL64, rtol=0)
    for got, leaf in zip(grads, leaves):
        assert got.shape == leaf.shape
        torch.testing.assert_close(got, leaf.grad, atol=TOL64, rtol=0)


@pytest.mark.parametrize("window", [0, 2, 9])
def test_reference_blocks_with_window(window):
    """Blocks smaller than the window and than the samples: skipped, full and partial blocks all occur."""
    lengths = [40, 3, 25]
    q, k, v, dout = _qkv(sum(lengths), 5, dv=D)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in lengths])
    win = KeyWindow(window, pos, pos)
    out, lse = reference.attn_fwd(q, k, v, cu, cu, True, 0.5, block_q=4, block_k=8, window=win)
    dq, dk, dv = reference.attn_bwd(dout, q, k, v, out, lse, cu, cu, True, 0.5, block_q=4, block_k=8, window=win)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = naive(*leaves, lengths, 0.5, window=window)
    ref.backward(dout)
    torch.testing.assert_close(out, ref, atol=TOL64, rtol=0)
    for got, leaf in zip((dq, dk, dv), leaves):
        torch.testing.assert_close(got, leaf.grad, atol=TOL64, rtol=0)


def test_window_by_position_not_by_row():
    """The zigzag local layout of rank 0 of 2 holds chunks 0 and 3 of a sample: rows adjacent, positions far
    apart.  A window by position must hide chunk 0 from chunk 3; one by rows would not."""
    lengths, k_group = [16], 2
    lay = rank_layout(lengths, k_group, 0)
    assert lay.front == ((0, 4),) and lay.back == ((12, 16),)
    q, k, v, _ = _qkv(16, 7, dv=D)
    idx = positions(lengths, k_group, 0)
    cu = lay.cu_seqlens
    out, _ = reference.attn_fwd(q[idx], k[idx], v[idx], cu, cu, True, 0.5, window=KeyWindow(3, idx, idx))
    full = naive(q, k, v, lengths, 0.5, window=3)
    # rows of chunk 3 (positions 12..15) only see keys 9..15 of the sample; chunk 0 is too far, and keys 4..11
    # live on the other rank: the local result is the window restricted to local keys
    local_keys_visible = naive(q[idx], k[idx], v[idx], [8], 0.5, window=None)  # by rows: chunk 0 visible
    assert not torch.allclose(out[4:], local_keys_visible[4:])
    torch.testing.assert_close(out[:4], full[:4], atol=TOL64, rtol=0)  # chunk 0: the whole window is local


def test_step_sees_keys_skips_only_steps_outside_every_window():
    lengths = [64]
    lays = group_layouts(lengths, 4)
    seen = {w: [(j, s.source) for j in range(4) for s in ring_schedule(4, j)
                if step_sees_keys(lays[j], lays[s.source], s.case, w)] for w in (None, 100, 8, 0)}
    assert len(seen[None]) == len(seen[100]) == 16  # every step of every rank
    assert len(seen[0]) == 4  # only the local step: a 0-window sees the token itself
    assert 4 < len(seen[8]) < 16  # a window of 8 over chunks of 8: neighbours only
    for j, i in seen[8]:  # what is kept is a chunk pair at most 8 positions apart
        assert j == i or any(abs(a - b) <= 8 + 8 for a in (lays[j].front[0][0], lays[j].back[0][0])
                             for b in (lays[i].front[0][0], lays[i].back[0][0]))
    assert step_sees_keys(lays[1], lays[0], StepCase.FRONT_KEYS, 8)  # chunk 1 sees the end of chunk 0


# ---- the field table ---------------------------------------------------------------------------------------


def test_every_attention_field_of_the_installed_megatron_is_classified():
    """Every attention-looking field of the installed TransformerConfig is handled, refused or left to Megatron."""
    from hdp.megatron_compat import TransformerConfig
    from hdp.core.attention_config import FIELDS, unclassified_fields

    from hdp.megatron_compat import MLATransformerConfig

    missing = unclassified_fields(TransformerConfig) + unclassified_fields(MLATransformerConfig)
    assert not missing, f"TransformerConfig fields hdp does not classify (add them to attention_config.FIELDS): {missing}"
    assert {"q_lora_rank", "kv_lora_rank", "beta_fast", "beta_slow"} <= set(FIELDS)  # MLA fields the pattern finds
    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    assert {"window_size", "softmax_type", "softmax_scale", "multi_latent_attention"} <= set(FIELDS) & names

    @dataclasses.dataclass
    class Upgraded(TransformerConfig):  # a Megatron release that adds an attention setting
        attention_temperature: float = 1.0

    assert unclassified_fields(Upgraded) == ["attention_temperature"]


def _tf(**kw):
    from hdp.megatron_compat import TransformerConfig

    base = dict(num_layers=4, hidden_size=32, num_attention_heads=4, attention_dropout=0.0)
    base.update(kw)
    return TransformerConfig(**base)


@pytest.mark.parametrize(("field", "value"), [
    ("rotary_interleaved", True), ("cache_mla_latents", True), ("qk_clip", True),
    ("log_max_attention_logit", True), ("attention_dropout", 0.1), ("experimental_attention_variant", "gated_delta_net"),
])
def test_refused_fields_raise_naming_the_field(field, value):
    from hdp.core.attention_config import check_attention_config

    cfg = _tf()
    object.__setattr__(cfg, field, value)  # past TransformerConfig's own post-init checks
    with pytest.raises(ValueError, match=rf"TransformerConfig\.{field}="):
        check_attention_config(cfg)


def test_mla_fields_give_the_decoupled_rope_part():
    """An MLATransformerConfig: the RoPE part after qk_head_dim, its frequencies from the MLA fields (Megatron's
    YaRN attention factor), pairs interleaved; per-layer no-RoPE is refused with MLA."""
    from hdp.megatron_compat import MLATransformerConfig
    from hdp.core.attention_config import check_attention_config
    from hdp.core.mla import mla_rope_config

    cfg = MLATransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, attention_dropout=0.0,
                               qk_head_dim=6, qk_pos_emb_head_dim=4, v_head_dim=5, rope_type="yarn",
                               rotary_scaling_factor=40.0, mscale=1.0, mscale_all_dim=0.0)
    s = check_attention_config(cfg)
    assert (s.rope_start, s.rope_dim, s.is_mla) == (6, 4, True)
    rope = mla_rope_config(cfg)
    assert rope.interleaved and rope.scaling.factor == 40.0
    assert rope.scaling.attention_scale == pytest.approx(0.1 * math.log(40.0) + 1.0)  # mscale(f, 1) / mscale(f, 0)
    object.__setattr__(cfg, "no_rope_freq", 2)
    with pytest.raises(ValueError, match="no_rope_freq=2 with multi_latent_attention"):
        check_attention_config(cfg)


def test_handled_fields_give_the_settings():
    from hdp.core.attention_config import SoftmaxType, check_attention_config

    s = check_attention_config(_tf(window_size=(7, 0), window_attn_skip_freq=2, softmax_type="learnable",
                                   softmax_scale=0.25, no_rope_freq=[0, 0, 0, 1]))
    assert s.softmax_scale == 0.25 and s.softmax_type is SoftmaxType.LEARNABLE
    assert [s.window_for(layer) for layer in (1, 2, 3, 4)] == [7, None, 7, None]  # Megatron: every 2nd layer full
    assert [s.rope_for(layer) for layer in (1, 2, 3, 4)] == [True, True, True, False]
    assert check_attention_config(_tf(window_size=(-1, 0))).window is None  # left -1: unbounded
    with pytest.raises(ValueError, match=r"window_size=\(7, 3\)"):
        check_attention_config(_tf(window_size=(7, 3)))


@pytest.mark.parametrize(("kw", "match"), [
    (dict(mla=dict(qk_pos_emb_head_dim=5)), r"MLAConfig.qk_pos_emb_head_dim=5: must be even"),
    (dict(mla=dict(kv_lora_rank=0)), r"MLAConfig.kv_lora_rank=0"),
    (dict(mla=dict(), num_query_groups=2), r"ModelConfig.num_query_groups=2 with mla"),
    (dict(mla=dict(), rope_scaling=dict(type="llama3", factor=8.0, original_max_position_embeddings=8)),
     r"rope_scaling type 'llama3' with mla"),
    (dict(mla=dict(), rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=8,
                                        attention_factor=1.2)), r"attention_factor=1.2 with mla"),
    (dict(moe_router_score_function="sigmoid"), r"moe_router_score_function='sigmoid': needs a MoE model"),
    (dict(num_moe_experts=8, moe_router_topk=4, moe_router_num_groups=3, moe_router_group_topk=1),
     r"moe_router_num_groups=3, moe_router_group_topk=1: need groups dividing"),
    (dict(num_moe_experts=8, moe_router_num_groups=4), r"moe_router_group_topk=None: set both"),
    (dict(num_moe_experts=8, moe_router_enable_expert_bias=True), r"expert bias needs moe_router_score_function"),
    (dict(num_moe_experts=8, moe_layer_freq=(0, 1, 1)), r"moe_layer_freq=\(0, 1, 1\): give one 0"),
])
def test_model_config_mla_and_router_fields_are_validated(kw, match):
    from hdp.rope import RopeScaling
    from hdp.trainer.model import MLAConfig, ModelConfig

    kw = dict(kw)
    with pytest.raises(ValueError, match=match):
        if "mla" in kw:
            kw["mla"] = MLAConfig(**{"qk_head_dim": 6, "qk_pos_emb_head_dim": 4, "v_head_dim": 5, **kw["mla"]})
        if "rope_scaling" in kw:
            kw["rope_scaling"] = RopeScaling(**kw["rope_scaling"])
        ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, **kw)
