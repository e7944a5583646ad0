"""The distributed tier (other processes) of the tests tests/unit/hdp/test_attention_variants.py describes: its docstring says what they check and how."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist

from helpers.dist_helper import run_distributed
from hdp.cp import CPAlgorithm, cp_attention
from hdp.cp.metadata import rank_layout
from hdp.groups import DomainGroups
from hdp.kernels import get_kernel

from helpers.attention_variants import D, DV, HQ, TOL64, _qkv, naive


# ---- CP level (2 and 4 gloo ranks) -----------------------------------------------------------------------

CP_CASES = {2: {(0, 2): [37, 5, 1, 20]}, 4: {(0, 4): [41, 3, 9]}}


def _cp_variants(rank, world):
    groups = DomainGroups.build(dist.group.WORLD)
    kern = get_kernel(torch.device("cpu"))
    (start, size), lengths = next(iter(CP_CASES[world].items()))
    total = sum(lengths)
    algos = [CPAlgorithm.RING, CPAlgorithm.ALLGATHER]
    # windows shorter than a chunk (steps skipped), crossing chunk boundaries, and wider than any sample
    for case, (window, sink_kind, dv) in enumerate([(3, "learned", DV), (7, None, D), (11, "zero", DV),
                                                     (None, "learned", DV), (1000, None, D)]):
        q, k, v, dout = _qkv(total, 100 + case, dv=dv)
        sink = None
        if sink_kind == "zero":
            sink = torch.zeros(HQ, dtype=torch.float64)
        elif sink_kind == "learned":
            sink = torch.randn(HQ, dtype=torch.float64, generator=torch.Generator().manual_seed(case))
        ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ref_sink = sink.clone().requires_grad_() if sink_kind == "learned" else sink
        ref = naive(*ref_leaves, lengths, 0.31, window=window, sink=ref_sink)
        ref.backward(dout)
        pos = rank - start
        lay = rank_layout(lengths, size, pos)
        offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()[:-1]])
        seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.diff(lay.cu_seqlens.long()))
        idx = offsets[seq] + lay.positions
        for algo in algos:
            leaves = [t[idx].clone().requires_grad_() for t in (q, k, v)]
            my_sink = sink.clone().requires_grad_() if sink_kind == "learned" else sink
            out = cp_attention(*leaves, lengths, size, ring=groups.ring(start, size), groups=groups, algo=algo,
                               kernel=kern, scale=0.31, window=window, sink=my_sink)
            out.backward(dout[idx])
            what = f"window={window} sink={sink_kind} dv={dv} {algo.value}"
            torch.testing.assert_close(out, ref[idx], atol=TOL64, rtol=0, msg=lambda m: f"{what} out: {m}")
            for name, a, b in zip("qkv", leaves, ref_leaves):
                torch.testing.assert_close(a.grad, b.grad[idx], atol=TOL64, rtol=0,
                                           msg=lambda m, name=name: f"{what} d{name}: {m}")
            if sink_kind == "learned":  # each rank holds part of the rows: the sum over the group is the gradient
                g = my_sink.grad.clone()
                dist.all_reduce(g, group=dist.group.WORLD)
                torch.testing.assert_close(g, ref_sink.grad, atol=TOL64, rtol=0, msg=lambda m: f"{what} dsink: {m}")


@pytest.mark.parametrize("world", [2, 4])
def test_cp_window_and_sinks_match_single_process(world):
    run_distributed(_cp_variants, world, timeout=240)


# ---- model level: hdp's Megatron GPT against Megatron's own local attention (2 ranks, one CP group) -------

MODEL_VARIANTS = {
    "window-every-2nd-layer-scale": dict(window_size=5, window_attn_skip_freq=2, softmax_scale=0.2),
    "off-by-one": dict(softmax_type="off-by-one"),
    "learnable-sinks-window": dict(softmax_type="learnable", window_size=9),
}


def _model_variant(rank, world, name):
    from hdp import megatron_compat as mc
    from hdp.core.attention_spec import CPContext, packed_seq_params
    from hdp.trainer.model import ModelConfig, build_gpt_model, packed_logits

    rt = mc.initialize_megatron(device="cpu", seed=1234)
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                      **MODEL_VARIANTS[name])
    torch.manual_seed(0)
    model = build_gpt_model(cfg, "cpu", groups=rt.groups)
    if cfg.softmax_type.value == "learnable":  # sinks of both signs and sizes, not Megatron's 0.02-std init
        with torch.no_grad():
            for layer in model.decoder.layers:
                layer.self_attention.core_attention.softmax_offset.copy_(torch.tensor([-1.0, 0.5, 2.0, 0.0]))
    stock = mc.GPTModel(config=model.config, transformer_layer_spec=mc.get_gpt_layer_local_spec(
        normalization=cfg.normalization), vocab_size=64, max_sequence_length=64, position_embedding_type="rope",
        rotary_base=cfg.rotary_base)
    missing, unexpected = stock.load_state_dict(model.state_dict(), strict=False)
    assert not [k for k in missing if "_extra_state" not in k] and not unexpected, (missing, unexpected)
    lengths = (29, 6)  # one CP group of 2 ranks: 29 tokens cut into chunks of 7-8, the windows cross them
    gen = torch.Generator().manual_seed(5)
    samples = [torch.randint(0, 64, (n,), generator=gen) for n in lengths]
    weights = [torch.randn(n, 64, generator=gen) for n in lengths]
    groups = DomainGroups.build(dist.group.WORLD)
    ctx = CPContext(group_lengths=lengths, k_group=2, ring=groups.ring(0, 2))
    lay = ctx.layout()
    pick = lambda xs: torch.cat([torch.cat([x[fs:fe], x[bs:be]])  # noqa: E731
                                 for x, (fs, fe), (bs, be) in zip(xs, lay.front, lay.back)])
    logits = packed_logits(model, pick(samples), packed_seq_params(lengths, torch.device("cpu"), cp=ctx))
    (logits * pick(weights)).sum().backward()
    ref = [stock(input_ids=s[None], position_ids=torch.arange(len(s))[None], attention_mask=None)[0]
           for s in samples]  # [L, V] each, Megatron's own RoPE and DotProductAttention
    sum((r * w).sum() for r, w in zip(ref, weights)).backward()
    torch.testing.assert_close(logits, pick(ref), atol=1e-5, rtol=0, msg=lambda m: f"{name} logits: {m}")
    grads = {n: p.grad for n, p in model.named_parameters()}
    stock_grads = {n: p.grad for n, p in stock.named_parameters()}
    for n, g in grads.items():  # each rank's loss covers its own tokens: the sum over the group is the full grad
        g = g.clone()
        dist.all_reduce(g, group=dist.group.WORLD)
        torch.testing.assert_close(g, stock_grads[n], atol=1e-4, rtol=1e-4, msg=lambda m, n=n: f"{name} {n}: {m}")
    if cfg.softmax_type.value == "learnable":
        assert any("softmax_offset" in n for n in grads)
    rt.close()


@pytest.mark.parametrize("name", list(MODEL_VARIANTS))
def test_model_variants_match_megatrons_local_attention(name):
    run_distributed(_model_variant, 2, name, timeout=240)


# ---- multi-latent attention: hdp's MLA GPT (CP group of 2) against Megatron's own MLA (its RoPE) -------------

MLA_VARIANTS = {
    "rope": dict(),
    "yarn-mscale": dict(rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=8, mscale=0.7,
                                          mscale_all_dim=0.9)),
    "no-q-lora": dict(q_lora_rank=None),
}


class _NaiveMLACoreAttention(torch.nn.Module):
    """Causal attention of one unpacked sample [S, B, H, D] (Megatron's local DotProductAttention does not take
    MLA's k_channels / v_channels): the reference core attention under Megatron's own MLA and its RoPE."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None, k_channels=None,
                 v_channels=None, cp_comm_type=None, pg_collection=None):
        super().__init__()
        self.scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        s = query.shape[0]
        sc = torch.einsum("sbhd,tbhd->bhst", query, key) * self.scale  # [B, H, S, S]
        sc = sc.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), -math.inf)
        out = torch.einsum("bhst,tbhd->sbhd", sc.softmax(-1), value)  # [S, B, H, Dv]
        return out.reshape(s, query.shape[1], -1)


def _mla_model(rank, world, name):
    from hdp import megatron_compat as mc
    from hdp.rope import RopeScaling
    from hdp.core.attention_spec import CPContext, packed_seq_params
    from hdp.core.mla import HdpMLASelfAttention
    from hdp.trainer.model import MLAConfig, ModelConfig, build_gpt_model, packed_logits

    rt = mc.initialize_megatron(device="cpu", seed=1234)
    kw = dict(MLA_VARIANTS[name])
    rs = kw.pop("rope_scaling", None)
    mla = MLAConfig(q_lora_rank=kw.pop("q_lora_rank", 16), kv_lora_rank=12, qk_head_dim=6, qk_pos_emb_head_dim=4,
                    v_head_dim=5)
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, qk_layernorm=True, mla=mla,
                      rope_scaling=RopeScaling(**rs) if rs else None, rotary_base=500.0, **kw)
    torch.manual_seed(0)
    model = build_gpt_model(cfg, "cpu", groups=rt.groups)
    assert all(isinstance(layer.self_attention, HdpMLASelfAttention) for layer in model.decoder.layers)
    spec = mc.get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=True, multi_latent_attention=True)
    attn = spec.submodules.self_attention
    attn = dataclasses.replace(attn, submodules=dataclasses.replace(attn.submodules, core_attention=_NaiveMLACoreAttention))
    spec = dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attn))
    stock = mc.GPTModel(config=model.config, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=64,
                        position_embedding_type="none")  # Megatron's MLA applies its own RoPE
    missing, unexpected = stock.load_state_dict(model.state_dict(), strict=False)
    assert not [k for k in missing if "_extra_state" not in k] and not unexpected, (missing, unexpected)
    lengths = (29, 6)  # one CP group of 2 ranks: 29 tokens cut into zigzag chunks of 7-8
    gen = torch.Generator().manual_seed(5)
    samples = [torch.randint(0, 64, (n,), generator=gen) for n in lengths]
    weights = [torch.randn(n, 64, generator=gen) for n in lengths]
    groups = DomainGroups.build(dist.group.WORLD)
    ctx = CPContext(group_lengths=lengths, k_group=2, ring=groups.ring(0, 2), groups=groups)
    lay = ctx.layout()
    pick = lambda xs: torch.cat([torch.cat([x[fs:fe], x[bs:be]])  # noqa: E731
                                 for x, (fs, fe), (bs, be) in zip(xs, lay.front, lay.back)])
    ref = [stock(input_ids=s[None], position_ids=torch.arange(len(s))[None], attention_mask=None)[0]
           for s in samples]  # [L, V] each: Megatron's MLA with its own RoPE, each sample whole
    sum((r * w).sum() for r, w in zip(ref, weights)).backward()
    stock_grads = {n: p.grad for n, p in stock.named_parameters()}
    for algo in (CPAlgorithm.RING, CPAlgorithm.ALLGATHER):
        model.zero_grad()
        ctx = dataclasses.replace(ctx, algo=algo)
        logits = packed_logits(model, pick(samples), packed_seq_params(lengths, torch.device("cpu"), cp=ctx))
        (logits * pick(weights)).sum().backward()
        what = f"{name} {algo.value}"
        torch.testing.assert_close(logits, pick(ref), atol=1e-5, rtol=0, msg=lambda m: f"{what} logits: {m}")
        for n, p in model.named_parameters():  # each rank's loss covers its own tokens: the group's sum is the grad
            g = p.grad.clone()
            dist.all_reduce(g, group=dist.group.WORLD)
            torch.testing.assert_close(g, stock_grads[n], atol=1e-4, rtol=1e-4, msg=lambda m, n=n: f"{what} {n}: {m}")
    rt.close()


@pytest.mark.parametrize("name", list(MLA_VARIANTS))
def test_mla_matches_megatrons_own_mla(name):
    """Megatron's MLA (q/kv latents, decoupled RoPE at interleaved pairs, YaRN with mscale and MLA's softmax scale,
    Dv != D) through hdp's core attention on a CP group of 2 (ring and all-gather), against Megatron's own MLA with
    its own RoPE, each sample whole: logits 1e-5, gradients 1e-4 (float32)."""
    run_distributed(_mla_model, 2, name, timeout=240)
