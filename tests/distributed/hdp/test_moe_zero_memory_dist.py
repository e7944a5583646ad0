"""The distributed tier (other processes) of the tests tests/unit/hdp/test_moe_zero_memory.py describes: its docstring says what they check and how."""

from __future__ import annotations

import pytest
import torch

from helpers.dist_helper import run_distributed

ATOL, RTOL = 1e-6, 1e-5
PARAM_TOL = 1e-6
H, F, E = 32, 48, 8
EMPTY = (1, 4, 5)  # experts no token is routed to; at EP4 rank 2 holds experts 4, 5: it receives nothing
TOKENS = (16, 3, 9, 1)  # tokens per rank (uneven; rank 3 has a single token)


def _unsupported() -> None:
    """Zero-memory on top of Megatron's own 'moe' recompute is refused with a message naming it."""
    from benchmarks.moe import build_moe_layer, moe_transformer_config

    cfg = moe_transformer_config(hidden_size=H, ffn_hidden_size=F, num_experts=4, topk=2, ep=1, full_recompute=True)
    with pytest.raises(ValueError, match="recompute_modules contains 'moe'"):
        build_moe_layer(cfg, "level0")
    build_moe_layer(cfg, "none")  # Megatron's own recompute alone is fine
    # experts of another class, and TE's grouped layout with more than weight{i}: refused naming what was found
    cfg = moe_transformer_config(hidden_size=H, ffn_hidden_size=F, num_experts=4, topk=2, ep=1, experts="te_grouped")
    layer = build_moe_layer(cfg, experts="te_grouped")
    layer.experts.linear_fc1.register_parameter("bias0", torch.nn.Parameter(torch.zeros(2 * F)))
    with pytest.raises(ValueError, match=r"TEGroupedMLP linear_fc1 holds \['bias0', 'weight0'.*needs weight0..weight3"):
        layer.set_zero_memory_level("level1")
    layer.experts = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"experts are Linear \(zero-memory takes SequentialMLP, GroupedMLP, TEGroupedMLP\)"):
        layer.set_zero_memory_level("level0")


# ---- (a) layer exactness EP 1/2/4 + order of events --------------------------------------------------


def _grads(layer: torch.nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {"input": x.grad.detach().clone()}
    for n, p in layer.named_parameters():
        out[n] = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
    return out


def _run_level(layer: torch.nn.Module, level: str, x0: torch.Tensor, dy: torch.Tensor, trace: object = None):
    layer.set_zero_memory_level(level)
    layer.trace = trace
    for p in layer.parameters():
        p.grad = None
    x = x0.clone().requires_grad_(True)
    out, bias = layer(x)
    assert bias is None
    out.backward(dy)
    layer.trace = None
    return out.detach(), _grads(layer, x)


def _exactness(rank: int, world: int) -> None:
    from hdp import megatron_compat as mc
    from hdp.moe import ZeroMemoryTrace
    from benchmarks.moe import build_moe_layer, moe_transformer_config

    for ep, topk in ((1, 2), (2, 3), (4, 2)):
        rt = mc.initialize_megatron(device="cpu", expert_model_parallel_size=ep, seed=1234)
        if ep == 1:
            _unsupported()
        torch.manual_seed(0)
        tcfg = moe_transformer_config(hidden_size=H, ffn_hidden_size=F, num_experts=E, topk=topk, ep=ep)
        layer = build_moe_layer(tcfg)
        with torch.no_grad():  # experts in EMPTY get no token: their logit is -sum(x) for x > 0
            for e in EMPTY:
                layer.router.weight[e].fill_(-1.0)
        g = torch.Generator().manual_seed(10 + rank)
        x0 = torch.rand(TOKENS[rank], 1, H, generator=g) + 0.1  # [s, b, H], positive
        dy = torch.randn(TOKENS[rank], 1, H, generator=g)
        ref_out, ref = _run_level(layer, "none", x0, dy)
        n_local = E // ep
        my_experts = range(rank % ep * n_local, rank % ep * n_local + n_local)
        for level in ("level0", "level1"):
            trace = ZeroMemoryTrace()
            out, got = _run_level(layer, level, x0, dy, trace)
            torch.testing.assert_close(out, ref_out, atol=ATOL, rtol=RTOL, msg=lambda m: f"ep{ep} {level} out: {m}")
            assert set(got) == set(ref)
            for k in ref:
                torch.testing.assert_close(got[k], ref[k], atol=ATOL, rtol=RTOL,
                                           msg=lambda m, k=k: f"ep{ep} {level} grad {k}: {m}")
            # the empty experts really were empty and still got (zero) weight gradients
            for local, e in enumerate(my_experts):
                if e in EMPTY:
                    assert torch.count_nonzero(got[f"experts.local_experts.{local}.linear_fc1.weight"]) == 0
            if TOKENS[rank] > 1:
                assert torch.count_nonzero(got["router.weight"]) > 0
            ev = trace.index
            if level == "level0":
                # re-dispatch issued before the fc1 input-gradient GEMM, waited on after it
                assert ev("combine_grad_a2a") < ev("redispatch_issue") < ev("fc1_dgrad_start")
                assert ev("fc1_dgrad_end") < ev("redispatch_wait") < ev("fc1_wgrad"), trace.events
                assert ev("probs_backward") < ev("redispatch_wait")
            else:
                # level1: re-dispatch first, then recompute fc1 and the activation
                assert ev("redispatch_issue") < ev("redispatch_wait") < ev("fc1_recompute") < ev("fc2_backward")
                # ... issued at the very start of the layer's backward, so that the unpermute backward
                # and dy's (async) all-to-all overlap it; fc1 is recomputed while dy is in flight
                assert trace.events[0] == "redispatch_issue", trace.events
                assert ev("redispatch_issue") < ev("unpermute_backward") < ev("combine_grad_issue") \
                    < ev("redispatch_wait"), trace.events
                assert ev("fc1_recompute") < ev("combine_grad_a2a") < ev("fc2_backward"), trace.events
            # both levels: the input/probs gradients travel home while fc1's weight gradient runs
            assert ev("fc1_dgrad_end") < ev("fc1_wgrad") < ev("dispatch_grad_a2a_wait"), trace.events
        rt.close()


def test_zero_memory_layer_matches_megatron_ep1_ep2_ep4() -> None:
    """Outputs and input/router/fc1/fc2 grads of level0/level1 equal Megatron's layer; EP 1/2/4,
    empty experts (a whole EP4 rank receives nothing), topk 2 and 3, 16/3/9/1 tokens per rank;
    the level0 re-dispatch is issued before the fc1 input-grad GEMM and waited on after it; the level1
    re-dispatch is issued first in the layer's backward, before the unpermute backward and dy's
    all-to-all, and fc1 is recomputed before dy is waited on."""
    run_distributed(_exactness, 4, timeout=110)


# ---- (b) whole MoE GPT step with and without zero-memory --------------------------------------------


def _gpt_step(rank: int, world: int) -> None:
    from hdp import megatron_compat as mc
    from hdp.moe import ZeroMemoryLevel, ZeroMemoryMoELayer, apply_zero_memory
    from hdp.core.attention_spec import packed_seq_params
    from hdp.trainer.model import (
        ModelConfig, OptimConfig, build_gpt_model, build_optimizer, packed_logits, token_logprobs, wrap_ddp,
    )
    from hdp.trainer.parallel import ParallelConfig

    rt = mc.initialize_megatron(device="cpu", expert_model_parallel_size=2, seed=1234)
    cfg = ModelConfig(vocab_size=128, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                      num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48)
    par = ParallelConfig(ep=2)
    g = torch.Generator().manual_seed(7)
    samples = [torch.randint(0, 128, (n,), generator=g) for n in (13, 5, 22, 9, 4)]
    mine = samples[:3] if rank == 0 else samples[3:]  # 40 vs 13 tokens
    tokens = torch.cat(mine)
    targets = torch.cat([torch.roll(s, -1) for s in mine])
    psp = packed_seq_params([s.numel() for s in mine], torch.device("cpu"))
    results = {}
    for mode in ("none", "level0", "level1", "first1"):
        torch.manual_seed(0)
        model = build_gpt_model(cfg, "cpu", groups=rt.groups, parallel=par)
        if mode == "first1":
            layers = apply_zero_memory(model, "level1", first_n_layers=1)
            assert [lay.zero_memory_level for lay in layers] == [ZeroMemoryLevel.LEVEL1, ZeroMemoryLevel.LEVEL0]
        elif mode != "none":
            layers = apply_zero_memory(model, mode)
            assert len(layers) == 2 and all(isinstance(lay, ZeroMemoryMoELayer) for lay in layers)
            assert all(isinstance(m.mlp, ZeroMemoryMoELayer) for m in model.decoder.layers)
        opt_cfg = OptimConfig(lr=1e-3, adam_eps=1e-3)
        ddp = wrap_ddp(model, opt_cfg, groups=rt.groups)
        optimizer = build_optimizer(ddp, opt_cfg, groups=rt.groups)
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        logits = packed_logits(ddp, tokens, psp)
        loss = -token_logprobs(logits, targets).sum() / 53.0
        loss.backward()
        ddp.finish_grad_sync()
        ok, norm, _ = optimizer.step()
        assert ok and norm > 0
        results[mode] = ({n: p.detach().clone() for n, p in model.named_parameters()}, float(loss), norm)
    ref_params, ref_loss, ref_norm = results["none"]
    for mode in ("level0", "level1", "first1"):
        params, loss, norm = results[mode]
        assert abs(loss - ref_loss) <= 1e-6 and abs(norm - ref_norm) <= 1e-5 * ref_norm, (mode, loss, ref_loss)
        assert set(params) == set(ref_params)
        for n in ref_params:
            torch.testing.assert_close(params[n], ref_params[n], atol=PARAM_TOL, rtol=0,
                                       msg=lambda m, n=n: f"{mode} {n}: {m}")
    rt.close()


def test_moe_gpt_step_same_parameters_with_and_without_zero_memory() -> None:
    run_distributed(_gpt_step, 2, timeout=110)


# ---- (d) grouped experts: Megatron's GroupedMLP and TransformerEngine's layout, EP 2 ----------------------

# The zero-memory node runs the same grouped GEMMs as the plain layer (one seam, hdp.kernels.grouped_gemm,
# also serves Megatron's gmm calls and the TE stand-in on CPU) and the same elementwise ops in the same
# dtypes and order, so outputs and every gradient agree to the bit (tolerance 0), in float32 and bfloat16
# (GroupedMLP runs bf16 only).
GROUPED_CASES = (("grouped", torch.bfloat16), ("te_grouped", torch.float32), ("te_grouped", torch.bfloat16))
RANK1_EMPTY = (4, 5, 6, 7)  # at EP 2 every expert of rank 1: it receives nothing


def _expert_weight(got: dict, kind: str, local: int, n_local: int) -> torch.Tensor:
    """fc1 weight gradient of local expert ``local`` in ``kind``'s layout."""
    if kind == "grouped":
        w = got["experts.weight1"]  # [H, L·F1]
        return w.view(n_local, w.shape[0], -1)[local]
    return got[f"experts.linear_fc1.weight{local}"]


def _grouped_exactness(rank: int, world: int) -> list[str]:
    from hdp import megatron_compat as mc
    from hdp.kernels.grouped_gemm import GroupedGemmBackend, backend_for
    from hdp.moe import ZeroMemoryTrace
    from hdp.moe.zero_memory import ExpertKind
    from benchmarks.moe import build_moe_layer, moe_transformer_config

    ep, n_local = 2, E // 2
    rt = mc.initialize_megatron(device="cpu", expert_model_parallel_size=ep, seed=1234)
    seen = []
    for kind, dtype in GROUPED_CASES:
        for topk, empty in ((2, EMPTY), (3, RANK1_EMPTY)):
            torch.manual_seed(0)
            tcfg = moe_transformer_config(hidden_size=H, ffn_hidden_size=F, num_experts=E, topk=topk, ep=ep,
                                          experts=kind, dtype=dtype)
            layer = build_moe_layer(tcfg, experts=kind)
            assert ExpertKind.of(layer.experts).value == {"grouped": "GroupedMLP", "te_grouped": "TEGroupedMLP"}[kind]
            with torch.no_grad():
                for e in empty:
                    layer.router.weight[e].fill_(-1.0)
            g = torch.Generator().manual_seed(10 + rank)
            x0 = (torch.rand(TOKENS[rank], 1, H, generator=g) + 0.1).to(dtype)
            dy = torch.randn(TOKENS[rank], 1, H, generator=g).to(dtype)
            ref_out, ref = _run_level(layer, "none", x0, dy)
            for level in ("level0", "level1"):
                trace = ZeroMemoryTrace()
                out, got = _run_level(layer, level, x0, dy, trace)
                what = f"{kind} {dtype} top{topk} {level}"
                torch.testing.assert_close(out, ref_out, atol=0, rtol=0, msg=lambda m: f"{what} out: {m}")
                assert set(got) == set(ref)
                for k in ref:
                    torch.testing.assert_close(got[k], ref[k], atol=0, rtol=0, msg=lambda m, k=k: f"{what} grad {k}: {m}")
                for local in range(n_local):
                    if rank * n_local + local in empty:
                        assert torch.count_nonzero(_expert_weight(got, kind, local, n_local)) == 0
                    elif TOKENS[rank] > 1:
                        assert torch.count_nonzero(_expert_weight(got, kind, local, n_local)) > 0, (what, local)
                ev = trace.index
                if level == "level0":
                    assert ev("combine_grad_a2a") < ev("redispatch_issue") < ev("fc1_dgrad_start"), trace.events
                    assert ev("fc1_dgrad_end") < ev("redispatch_wait") < ev("fc1_wgrad"), trace.events
                else:
                    assert trace.events[0] == "redispatch_issue", trace.events
                    assert ev("unpermute_backward") < ev("combine_grad_issue") < ev("redispatch_wait") \
                        < ev("fc1_recompute") < ev("combine_grad_a2a") < ev("fc2_backward"), trace.events
                assert ev("fc1_dgrad_end") < ev("fc1_wgrad") < ev("dispatch_grad_a2a_wait"), trace.events
                seen.append(what)
            # the grouped GEMMs of these shapes are torch's grouped_mm (not the loop fallback)
            x2 = torch.zeros(4, H, dtype=dtype)
            assert backend_for(x2, torch.zeros(2, H, F, dtype=dtype))[0] is GroupedGemmBackend.TORCH
    rt.close()
    return seen


def test_zero_memory_grouped_experts_match_megatron_ep2() -> None:
    """Megatron's GroupedMLP (bf16; its gmm calls served by torch's grouped_mm) and TEGroupedMLP's layout
    (fp32 and bf16): level0 / level1 outputs and every gradient equal the plain layer's bit for bit,
    experts without tokens (a whole rank in one routing) get zero
    gradients, others nonzero, and the re-dispatch overlap order holds."""
    seen = run_distributed(_grouped_exactness, 2, timeout=200)
    assert len(seen[0]) == len(GROUPED_CASES) * 2 * 2
