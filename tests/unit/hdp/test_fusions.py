"""The fused-kernel seam of hdp's own RoPE and the experts' SwiGLU (hdp.kernels.fusions) on CPU.

No NPU or GPU here: torch_npu's ``npu_rotary_mul`` / ``npu_swiglu`` and flash-attn's rotary are NOT RUN ON
HARDWARE.  What runs: a test stand-in registered for "cpu" (:func:`hdp.kernels.fusions.registered`) that counts
its calls and computes the plain form with other ops (so a call site that ignored it, or mis-sliced what it
hands the kernel, shows up).  Checked, through the modules that call the seam (hdp's core attention and the
zero-memory MoE layer): the stand-in is called exactly when the flag asks for it, and gives the plain form's
values and gradients.  Tolerance: 0 for the zero-memory layer (the stand-in runs the plain form's own ops, so
bits are equal); fp32 round-off (1e-6) where the stand-in computes the rotation in another order.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from hdp.kernels import fusions
from hdp.rope import apply_rope, rope_cos_sin


class _Counting:
    """A stand-in kernel: counts calls, computes the plain form by other ops."""

    def __init__(self, fusion: fusions.Fusion) -> None:
        self.calls = 0
        self.kernel = fusions.FusedKernel(fusion, f"test stand-in ({fusion.value})", self)
        self.fusion = fusion

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.fusion is fusions.Fusion.ROTARY:
            x, cos, sin = args
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half], x[..., half:]
            c, s = cos[..., :half], sin[..., :half]  # the halves repeat the same angles
            return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
        (h,) = args
        a, b = torch.chunk(h, 2, dim=-1)
        return F.silu(a) * b


@pytest.mark.parametrize("start, rd, d", [(0, 16, 16), (0, 8, 16), (4, 8, 16)])
def test_rotate_takes_a_registered_kernel_and_equals_the_plain_form(start: int, rd: int, d: int) -> None:
    g = torch.Generator().manual_seed(0)
    pos = torch.tensor([0, 1, 2, 7, 8, 3, 4])  # zigzag-like positions: not the packed rows
    cos, sin = rope_cos_sin(pos, rd, base=1e4)  # [T, 1, Dr]
    x = torch.randn(len(pos), 3, d, generator=g, requires_grad=True)
    plain = apply_rope(x, cos, sin, start=start)
    (gx_plain,) = torch.autograd.grad(plain.square().sum(), x)
    stand_in = _Counting(fusions.Fusion.ROTARY)
    with fusions.registered(stand_in.kernel, "cpu"):
        assert fusions.rotate(x, cos, sin, fused=False, start=start) is not None and stand_in.calls == 0
        out = fusions.rotate(x, cos, sin, fused=True, start=start)
        assert stand_in.calls == 1
        (gx,) = torch.autograd.grad(out.square().sum(), x)
    torch.testing.assert_close(out, plain, atol=1e-6, rtol=0)
    torch.testing.assert_close(gx, gx_plain, atol=1e-6, rtol=0)
    if start:
        assert torch.equal(out[..., :start], x[..., :start])  # the dims before the RoPE part pass through
    assert fusions.kernel_for(fusions.Fusion.ROTARY, torch.device("cpu"))[0] is None  # unregistered after the block


def test_no_kernel_runs_the_plain_form_and_says_why_once(caplog: pytest.LogCaptureFixture) -> None:
    kernel, why = fusions.kernel_for(fusions.Fusion.ROTARY, torch.device("cpu"))
    assert kernel is None and "no fused rotary kernel for device 'cpu'" in why
    for fusion, name in ((fusions.Fusion.ROTARY, "flash_attn"), (fusions.Fusion.SWIGLU, "no fused SwiGLU")):
        kernel, why = fusions.kernel_for(fusion, torch.device("cuda"))  # no flash-attn in this venv
        assert kernel is None and name in why, why
    x = torch.randn(5, 2, 8)
    cos, sin = rope_cos_sin(torch.arange(5), 8)
    fusions._NOTED.clear()
    with caplog.at_level(logging.INFO, logger="hdp.kernels.fusions"):
        for _ in range(3):
            assert torch.equal(fusions.rotate(x, cos, sin, fused=True), apply_rope(x, cos, sin))
    notes = [r.getMessage() for r in caplog.records if "fused rotary asked for on cpu" in r.getMessage()]
    assert len(notes) == 1 and "the plain form runs" in notes[0], notes


def _core_attention(fused_rope: bool, apply_rope_fusion: bool = False):
    from hdp.megatron_compat import AttnMaskType, TransformerConfig
    from hdp.core.attention_spec import HdpCoreAttention, RopeConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            attention_dropout=0.0)
    object.__setattr__(cfg, "apply_rope_fusion", apply_rope_fusion)  # past Megatron's TE check (no TE on CPU)
    return HdpCoreAttention(cfg, 1, AttnMaskType.causal, "self", rope=RopeConfig(base=1e4, fused=fused_rope))


@pytest.mark.parametrize("flag", ["RopeConfig.fused", "apply_rope_fusion"])
def test_core_attention_rotates_with_the_fused_kernel_when_asked(flag: str) -> None:
    """hdp's core attention (RoPE at the sample positions, then attention) with the fused flag: the kernel rotates
    q and k once each, and the output and input gradients equal the plain form's."""
    from hdp.core.attention_spec import packed_seq_params

    g = torch.Generator().manual_seed(1)
    lengths = (5, 9)
    q = torch.randn(14, 4, 8, generator=g, requires_grad=True)
    k = torch.randn(14, 2, 8, generator=g, requires_grad=True)
    v = torch.randn(14, 2, 8, generator=g, requires_grad=True)

    def run(attn):
        psp = packed_seq_params(lengths, torch.device("cpu"))
        out = attn(q, k, v, None, packed_seq_params=psp)  # [T, Hq*D]
        return out, torch.autograd.grad(out.square().sum(), (q, k, v))

    plain_out, plain_grads = run(_core_attention(False))
    stand_in = _Counting(fusions.Fusion.ROTARY)
    attn = _core_attention(flag == "RopeConfig.fused", flag == "apply_rope_fusion")
    assert attn.rope_fused
    with fusions.registered(stand_in.kernel, "cpu"):
        assert run(_core_attention(False))[0] is not None and stand_in.calls == 0  # not asked: not called
        out, grads = run(attn)
    assert stand_in.calls == 2  # q and k
    torch.testing.assert_close(out, plain_out, atol=1e-6, rtol=0)
    for a, b in zip(grads, plain_grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("level", ["level0", "level1"])
@pytest.mark.parametrize("how", ["fused_swiglu", "bias_activation_fusion"])
def test_zero_memory_swiglu_takes_the_fused_kernel_and_equals_the_plain_form(level: str, how: str, tmp_path) -> None:
    """A zero-memory MoE layer (EP 1, TEGroupedMLP experts, SwiGLU) asked to fuse its SwiGLU: the kernel computes
    the activation in forward and in the backward's recompute, and output and every gradient equal the unfused
    layer's bit for bit; not asked, it is never called."""
    import torch.distributed as dist

    from hdp import megatron_compat as mc
    from benchmarks.moe import build_moe_layer, moe_transformer_config

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    rt = mc.initialize_megatron(device="cpu", expert_model_parallel_size=1, seed=1234)
    try:
        torch.manual_seed(0)
        cfg = moe_transformer_config(hidden_size=32, ffn_hidden_size=24, num_experts=4, topk=2, ep=1,
                                     experts="te_grouped")
        layer = build_moe_layer(cfg, level, experts="te_grouped")
        g = torch.Generator().manual_seed(2)
        x0 = torch.randn(11, 1, 32, generator=g)
        dy = torch.randn(11, 1, 32, generator=g)

        def run():
            for p in layer.parameters():
                p.grad = None
            x = x0.clone().requires_grad_(True)
            out, _ = layer(x)
            out.backward(dy)
            return out.detach(), {"input": x.grad, **{n: p.grad.clone() for n, p in layer.named_parameters()}}

        stand_in = _Counting(fusions.Fusion.SWIGLU)
        with fusions.registered(stand_in.kernel, "cpu"):
            ref_out, ref = run()
            assert stand_in.calls == 0
            if how == "fused_swiglu":
                layer.fused_swiglu = True
            else:
                object.__setattr__(layer.experts.config, "bias_activation_fusion", True)
            out, got = run()
        assert stand_in.calls == 2  # forward, and the backward's recompute
        assert torch.equal(out, ref_out)
        for name, grad in ref.items():
            assert torch.equal(got[name], grad), name
    finally:
        rt.close()
        dist.destroy_process_group()
