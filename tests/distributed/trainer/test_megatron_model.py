"""Megatron-core GPT on CPU/gloo: packing exactness, CP attention inside the model, DDP + distributed
optimizer step against a single-process step, MoE with EP=2.

Tolerances (float32): logits 1e-5 absolute (values are O(1)); parameters after one Adam step 1e-6
absolute (Adam's first step moves every weight by ~lr = 1e-3, so 1e-6 is 0.1% of the update and
far above fp32 round-off of the reduction order).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from helpers.dist_helper import run_distributed

VOCAB = 256
LOGIT_TOL = 1e-5
PARAM_TOL = 1e-6
# five samples of different lengths; the 2-rank split gives rank 0 samples 0-2, rank 1 samples 3-4
LENGTHS = [13, 5, 22, 9, 17]


def _tokens(lengths: list[int], seed: int = 7) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


def _setup(ep: int = 1, **model_kw: object) -> tuple[object, object, object]:
    from hdp import megatron_compat as mc
    from hdp.trainer.model import ModelConfig, build_gpt_model
    from hdp.trainer.parallel import ParallelConfig

    rt = mc.initialize_megatron(device="cpu", expert_model_parallel_size=ep, seed=1234)
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2,
                      **model_kw)
    torch.manual_seed(0)  # same initial weights on every rank (CPU init draws from the CPU generator)
    return cfg, build_gpt_model(cfg, "cpu", groups=rt.groups, parallel=ParallelConfig(ep=ep)), rt


# ---- (a) single process: packing is exact; hdp RoPE + attention match Megatron's own -----------


def _packing_exact(rank: int, world: int) -> None:
    from hdp import megatron_compat as mc
    from hdp.core.attention_spec import packed_seq_params
    from hdp.trainer.model import packed_logits

    cfg, model, rt = _setup()
    cpu = torch.device("cpu")
    samples = _tokens([7, 19, 3])
    lengths = [int(s.numel()) for s in samples]
    with torch.no_grad():
        packed = packed_logits(model, torch.cat(samples), packed_seq_params(lengths, cpu))  # [T, V]
        assert packed.shape == (sum(lengths), VOCAB)
        off = 0
        for s in samples:
            alone = packed_logits(model, s, packed_seq_params([s.numel()], cpu))
            torch.testing.assert_close(packed[off : off + s.numel()], alone, atol=LOGIT_TOL, rtol=0)
            off += s.numel()

        # Megatron's own path (its RoPE on CPU through the shim + local DotProductAttention, bshd)
        # with the same weights gives the same logits: hdp's RoPE convention is Megatron's.
        ref = mc.GPTModel(
            config=model.config,
            transformer_layer_spec=mc.get_gpt_layer_local_spec(normalization=cfg.normalization),
            vocab_size=VOCAB,
            max_sequence_length=64,
            position_embedding_type="rope",
            rotary_base=cfg.rotary_base,
        )
        missing, unexpected = ref.load_state_dict(model.state_dict(), strict=False)
        assert not [k for k in missing if "_extra_state" not in k] and not unexpected, (missing, unexpected)
        ref.eval()
        s = samples[1]
        pos = torch.arange(s.numel())[None]
        mega = ref(input_ids=s[None], position_ids=pos, attention_mask=None)[0]  # [L, V]
        torch.testing.assert_close(packed[7 : 7 + s.numel()], mega, atol=LOGIT_TOL, rtol=0)
    rt.close()


def test_packed_thd_forward_matches_per_sample() -> None:
    run_distributed(_packing_exact, 1, timeout=120)


def test_other_attention_backends_name_their_dependency() -> None:
    from hdp.core.attention_spec import CoreAttentionBackend, core_attention_module

    with pytest.raises(NotImplementedError, match="TransformerEngine"):
        core_attention_module(CoreAttentionBackend.TE)
    with pytest.raises(NotImplementedError, match="MindSpeed"):
        core_attention_module("mindspeed")
    with pytest.raises(ValueError, match="attention_backend"):
        core_attention_module("flash")


def _shim_scope(rank: int, world: int) -> None:
    import importlib

    from hdp import megatron_compat as mc
    from megatron.core.optimizer import clip_grads, distrib_optimizer
    from megatron.core.tensor_parallel import random as rnd
    from megatron.core.transformer.moe import experts, grouped_gemm_util, moe_utils

    def snapshot() -> dict[str, object]:
        snap = {m: importlib.import_module(m).torch for m in mc._PROXIED_MODULES}
        snap.update(tracker_cls=rnd.CudaRNGStatesTracker, clip=clip_grads.clip_grad_by_total_norm_fp32,
                    dopt_init=distrib_optimizer.DistributedOptimizer.__dict__["__init__"],
                    move=moe_utils.maybe_move_tensor_to_cpu, gemm=hasattr(moe_utils, "te_general_gemm"),
                    tensor_type=torch.Tensor.type, grouped_gemm=grouped_gemm_util.grouped_gemm,
                    gg_ops=grouped_gemm_util.ops, jit_fuser=experts.jit_fuser)
        return snap

    assert not mc.cpu_shim_applied()
    before = snapshot()
    assert mc.apply_cpu_shim("cuda") is None  # never touches Megatron for an accelerator
    assert snapshot() == before
    first = mc.apply_cpu_shim("cpu")
    second = mc.apply_cpu_shim(torch.device("cpu"))
    patched = snapshot()
    assert mc.cpu_shim_applied() and first.live and second.live
    assert all(getattr(patched[m], "_hdp_cpu_proxy", False) for m in mc._PROXIED_MODULES)
    assert patched["clip"] is not before["clip"] and patched["dopt_init"] is not before["dopt_init"]
    assert patched["tensor_type"] is before["tensor_type"]  # Tensor.type is never swapped
    # GroupedMLP's grouped_gemm package calls served by torch's grouped_mm; its torch.compile off
    assert before["grouped_gemm"] is None and patched["gg_ops"].gmm is not None
    assert patched["jit_fuser"] is not before["jit_fuser"]
    first.undo()
    first.undo()  # idempotent
    assert mc.cpu_shim_applied() and snapshot() == patched  # the other hold keeps it
    with second:
        pass
    assert not mc.cpu_shim_applied() and not second.live
    assert snapshot() == before  # every replaced attribute is back


def test_cpu_shim_is_a_scoped_handle_that_restores_every_attribute() -> None:
    """apply -> patched; the last undo puts back every attribute it replaced; never for an accelerator;
    torch.Tensor.type is never replaced (in a fresh process, so no other test holds the shim)."""
    run_distributed(_shim_scope, 1, timeout=120)


def test_initialize_megatron_needs_the_device() -> None:
    from hdp import megatron_compat as mc
    from hdp.trainer.model import ModelConfig, build_gpt_model

    with pytest.raises(TypeError, match="device"):
        mc.initialize_megatron(seed=1)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="device"):
        build_gpt_model(ModelConfig())  # type: ignore[call-arg]


# ---- (b) 2 ranks: a CP group inside the model, and DDP + distributed optimizer step --------------


def _reference_step(
    model: torch.nn.Module, samples: list[torch.Tensor], lr: float, eps: float, clip: float
) -> tuple[dict[str, torch.Tensor], float]:
    """Single-process step on the whole batch: token-mean loss, torch AdamW (Megatron's CPU fallback).

    Returns the parameters after the step and the global grad norm before clipping.
    """
    from hdp.core.attention_spec import packed_seq_params
    from hdp.trainer.model import packed_logits, token_logprobs

    tokens, targets, mask = _packed_targets(samples)
    logits = packed_logits(model, tokens, packed_seq_params([s.numel() for s in samples], tokens.device))
    loss = -(token_logprobs(logits, targets) * mask).sum() / mask.sum()
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf")))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=eps, weight_decay=0.0)
    opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}, norm


def _packed_targets(samples: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed tokens, next-token targets and loss mask (the last token of a sample has no target)."""
    tokens = torch.cat(samples)
    targets = torch.cat([torch.roll(s, -1) for s in samples])
    mask = torch.cat([torch.cat([torch.ones(s.numel() - 1), torch.zeros(1)]) for s in samples])
    return tokens, targets, mask


def _cp_forward_and_ddp_step(rank: int, world: int) -> None:
    from hdp import megatron_compat as mc
    from hdp.groups import DomainGroups
    from hdp.cp import metadata
    from hdp.core.attention_spec import CPContext, packed_seq_params
    from hdp.trainer.model import OptimConfig, build_gpt_model, build_optimizer, packed_logits, token_logprobs, wrap_ddp

    cfg, model, rt = _setup()
    torch.manual_seed(0)
    ref_model = build_gpt_model(cfg, "cpu", groups=rt.groups)  # same init, stays a plain module
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
    cpu = torch.device("cpu")
    samples = _tokens(LENGTHS)

    # 1. CP: samples 2 and 4 as one group of k=2 zigzag-split over both ranks; the local logits
    #    equal the single-process logits at those tokens (RoPE at per-sample positions of the chunks).
    group = [samples[2], samples[4]]
    glens = tuple(int(s.numel()) for s in group)
    groups = DomainGroups.build(dist.group.WORLD)
    ctx = CPContext(group_lengths=glens, k_group=2, ring=groups.ring(0, 2))
    lay = ctx.layout()
    local = torch.cat(
        [torch.cat([s[fs:fe], s[bs:be]]) for s, (fs, fe), (bs, be) in zip(group, lay.front, lay.back)]
    )
    with torch.no_grad():
        cp_logits = packed_logits(model, local, packed_seq_params(glens, cpu, cp=ctx))
        full = packed_logits(ref_model, torch.cat(group), packed_seq_params(glens, cpu))
    sample_start = torch.tensor([0, glens[0]])
    idx = torch.cat(
        [torch.cat([torch.arange(fs, fe), torch.arange(bs, be)]) + sample_start[i]
         for i, ((fs, fe), (bs, be)) in enumerate(zip(lay.front, lay.back))]
    )
    assert torch.equal(metadata.positions(glens, 2, rank), ctx.positions())
    torch.testing.assert_close(cp_logits, full[idx], atol=LOGIT_TOL, rtol=0)

    # 2. DDP + distributed optimizer: rank 0 takes samples 0-2, rank 1 samples 3-4 (different token
    #    counts); each rank's loss is its summed token loss over the *global* token count, DDP sums.
    # Adam's first step is ~lr·sign(g) when eps << |g|, which would hide a wrong gradient scale;
    # eps = 1e-3 (about the size of the gradients here) keeps the update scale-sensitive, and the
    # grad norm (taken before clipping) is compared directly as well.
    opt_cfg = OptimConfig(lr=1e-3, adam_eps=1e-3, clip_grad=1.0)
    ddp = wrap_ddp(model, opt_cfg, groups=rt.groups)
    optimizer = build_optimizer(ddp, opt_cfg, groups=rt.groups)
    mine = samples[:3] if rank == 0 else samples[3:]
    _, _, all_mask = _packed_targets(samples)
    n_global = all_mask.sum()
    tokens, targets, mask = _packed_targets(mine)
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    logits = packed_logits(ddp, tokens, packed_seq_params([s.numel() for s in mine], cpu))
    loss = -(token_logprobs(logits, targets) * mask).sum() / n_global
    loss.backward()
    ddp.finish_grad_sync()
    ok, grad_norm, _ = optimizer.step()
    assert ok and grad_norm is not None and grad_norm > 1.0  # so clipping was exercised

    expect, ref_norm = _reference_step(ref_model, samples, lr=1e-3, eps=1e-3, clip=1.0)
    assert abs(grad_norm - ref_norm) <= 1e-5 * ref_norm, (grad_norm, ref_norm)
    got = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}
    assert set(expect) == set(got)
    for k in expect:
        torch.testing.assert_close(got[k], expect[k], atol=PARAM_TOL, rtol=0, msg=lambda m, k=k: f"{k}: {m}")
    rt.close()


def test_cp_group_in_model_and_ddp_distributed_optimizer_step_match_single_process() -> None:
    run_distributed(_cp_forward_and_ddp_step, 2, timeout=180)


# ---- (c) MoE with the alltoall dispatcher, EP = 2 ---------------------------------------------------


def _moe_step(rank: int, world: int) -> None:
    from hdp import megatron_compat as mc
    from hdp.core.attention_spec import packed_seq_params
    from hdp.trainer.model import OptimConfig, build_optimizer, packed_logits, token_logprobs, wrap_ddp

    cfg, model, rt = _setup(ep=2, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64)
    assert mc.parallel_state.get_expert_model_parallel_world_size() == 2
    n_local = sum(1 for n, _ in model.named_parameters() if "local_experts" in n and "linear_fc1" in n)
    assert n_local == cfg.num_layers * 2  # 4 experts over EP=2: two per rank and layer
    opt_cfg = OptimConfig(lr=1e-3)
    ddp = wrap_ddp(model, opt_cfg, groups=rt.groups)
    optimizer = build_optimizer(ddp, opt_cfg, groups=rt.groups)
    samples = _tokens(LENGTHS)
    mine = samples[:3] if rank == 0 else samples[3:]
    tokens, targets, mask = _packed_targets(mine)
    before = {n: p.detach().clone() for n, p in ddp.named_parameters()}
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    logits = packed_logits(ddp, tokens, packed_seq_params([s.numel() for s in mine], torch.device("cpu")))
    loss = -(token_logprobs(logits, targets) * mask).sum() / 80.0
    assert torch.isfinite(loss)
    loss.backward()
    ddp.finish_grad_sync()
    ok, grad_norm, _ = optimizer.step()
    assert ok and grad_norm is not None and grad_norm > 0
    changed = [n for n, p in ddp.named_parameters() if not torch.equal(before[n], p.detach())]
    assert any("local_experts" in n for n in changed) and any("router" in n for n in changed)
    # the non-expert (replicated) parameters must agree across the 2 ranks after the step
    for n, p in ddp.named_parameters():
        if "local_experts" in n:
            continue
        lo, hi = p.detach().clone(), p.detach().clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=dist.group.WORLD)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=dist.group.WORLD)
        assert torch.equal(lo, hi), n
    rt.close()


def test_moe_alltoall_ep2_step() -> None:
    run_distributed(_moe_step, 2, timeout=180)
