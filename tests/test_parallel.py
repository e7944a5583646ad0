"""HdpEngine under TP / PP / EP layouts on gloo: every layout against one process on the whole batch.

World = TP × PP × domain.  Each layout runs the same batch under an hdp plan on the domain (a CP2
ring and single-rank groups) and is compared with a plain one-process Megatron GPT on the whole
batch (same weights, set by global parameter name so every layout starts identically):

* gradients after the rounds (the engine's phases 1–2, then Megatron's ``finalize_model_grads``
  with an all-reduce instead of the reduce-scatter, so every rank holds whole gradients) equal
  the reference's TP shard of each parameter: fp32 round-off, ``rtol=1e-4, atol=1e-6``;
* losses (1e-5 relative), grad norms (1e-5 relative) and parameters after Adam steps through
  ``train_step`` (2e-6 absolute, as in tests/test_engine.py);
* forward log-probs in the caller's order (1e-5 absolute) on every rank, whatever its stage;
* checkpoint save -> load -> step equals the uninterrupted run bit for bit.

Spawned runs are shared among checks to keep the suite short: one 4-rank run for PP (1F1B,
interleaved, MoE EP 2 with zero-memory, bad layouts), one for TP, one 8-rank run for TP × PP.
"""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
import torch
import torch.distributed as dist

from dist_helper import run_distributed

pytestmark = pytest.mark.dist

VOCAB = 128
B = 32  # token budget per rank and round
# on a domain of 2 ranks: sample 0 needs a CP2 group, the rest run on single ranks; >= 4 rounds
LENGTHS = [60, 30, 20, 12, 25, 9, 40, 16, 7, 33]
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6
PARAM_TOL = 2e-6
LOSS_RTOL = 1e-5
LOGP_TOL = 1e-5
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48)


def init_param(name: str, p: torch.Tensor) -> None:
    """Rank- and layout-independent weights keyed by the global parameter name (full tensors)."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    val = torch.randn(p.shape, generator=g, dtype=torch.float32)
    p.copy_(1.0 + 0.1 * val if p.dim() == 1 else 0.05 * val)


def _model_cfg(**kw: object):
    from hdp.trainer.model import ModelConfig

    base = dict(vocab_size=VOCAB, hidden_size=64, num_layers=4, num_attention_heads=4, num_query_groups=2,
                max_sequence_length=256)
    return ModelConfig(**{**base, **kw})


def _engine_cfg(parallel: dict, model_kw: dict | None = None, **planning: object):
    from hdp.packing import cost_model
    from hdp.trainer.config import EngineConfig, ParallelConfig, PlanningConfig
    from hdp.trainer.model import OptimConfig

    return EngineConfig(
        model=_model_cfg(**(model_kw or {})),
        optim=OptimConfig(lr=1e-3, adam_eps=1e-3, clip_grad=1.0),
        planning=PlanningConfig(max_tokens_per_rank=B, cost_model=cost_model("deepseek-v3", "h100-nvlink"), **planning),
        parallel=ParallelConfig(**parallel),
    )


def _batch(step: int, lengths: list[int] = LENGTHS):
    from hdp.trainer.engine import Batch

    g = torch.Generator().manual_seed(300 + step)
    tokens = [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]
    masks = []
    for n in lengths:
        m = torch.zeros(n)
        m[int(torch.randint(1, n // 2 + 1, (1,), generator=g)) :] = 1.0
        masks.append(m)
    return Batch(tokens=tokens, loss_mask=masks)


# ---- the one-process reference ------------------------------------------------------------------------


ENTROPY_COEF = 0.1


def entropy_bonus_loss(local, logprobs, weights):
    """NLL with an entropy bonus: ℓ_t = −log p_t − c·H_t (H over the full vocabulary, with its gradient)."""
    return -(weights * (logprobs + ENTROPY_COEF * local.entropy())).sum()


def _reference(batches, steps: int, model_kw: dict | None = None, entropy_coef: float = 0.0) -> dict:
    """Loss, gradients (step 1), grad norms, parameters after each step and log-probs of batch 0, in
    one process on the whole batch (Megatron initialised TP = PP = EP = 1 for it, then torn down).
    ``entropy_coef`` c: the per-token loss is −log p − c·H (full-vocabulary entropy, naive path)."""
    from hdp import megatron_compat as mc
    from loss_reference import aggregate_loss
    from hdp.core.attention_spec import packed_seq_params
    from hdp.trainer.model import build_gpt_model, packed_logits, token_logprobs

    rt = mc.initialize_megatron(device="cpu", seed=1)
    model = build_gpt_model(_model_cfg(**(model_kw or {})), "cpu", groups=rt.groups)
    with torch.no_grad():
        for name, p in model.named_parameters():
            init_param(name, p)

    def loss_of(batch):
        tokens = torch.cat(list(batch.tokens))
        logits = packed_logits(model, tokens, packed_seq_params(batch.lengths, tokens.device))  # [sum L, V]
        losses, masks, off = [], [], 0
        for i, t in enumerate(batch.tokens):
            n = t.numel()
            lg = logits[off : off + n - 1]
            loss = -token_logprobs(lg, t[1:])
            if entropy_coef:
                logp = torch.log_softmax(lg.float(), dim=-1)  # [n-1, V]
                loss = loss - entropy_coef * -(logp.exp() * logp).sum(-1)
            losses.append(loss)
            masks.append(batch.loss_mask[i][1:])
            off += n
        return aggregate_loss(losses, masks, "token-mean")

    out: dict = {"loss": [], "norm": [], "params": []}
    with torch.no_grad():
        lps = []
        for t in batches[0].tokens:
            lp = token_logprobs(packed_logits(model, t, packed_seq_params([t.numel()], t.device))[:-1], t[1:])
            lps.append(torch.cat([lp.new_zeros(1), lp]))
        out["logprobs"] = lps
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-3, weight_decay=0.0)
    for s in range(steps):
        opt.zero_grad()
        loss = loss_of(batches[s])
        loss.backward()
        if s == 0:
            out["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        out["norm"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        out["loss"].append(float(loss))
        out["params"].append({n: p.detach().clone() for n, p in model.named_parameters()})
    rt.close()
    return out


# ---- checks on an engine ----------------------------------------------------------------------------


def _named(engine) -> dict[str, torch.nn.Parameter]:
    """Global name -> this rank's parameter (its TP shard), over all its model chunks."""
    from hdp.trainer.model import global_param_names

    cfg = engine.config
    per_rank = (cfg.model.num_moe_experts or 0) // cfg.parallel.ep
    out = {}
    for chunk in engine.model_chunks:
        names = global_param_names(chunk.module, ep_rank=engine.groups.ep.rank(), experts_per_rank=per_rank)
        out.update({names[n]: p for n, p in chunk.module.named_parameters()})
    return out


def _shard(engine, full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    from hdp.trainer.model import _tp_shard

    size = 1 if not getattr(p, "allreduce", True) else engine.groups.tp_size
    return _tp_shard(full, p, engine.groups.tp_rank, size)


def _check_grads(engine, batch, ref: dict, what: str, plan=None, loss_fn=None) -> None:
    """The engine's gradients of ``batch`` (phases 1–2, then all-reduced) equal the reference shards."""
    from hdp import megatron_compat as mc
    from hdp.trainer.engine import nll_loss

    prep = engine._prepare(batch, plan, loss_fn or nll_loss)()  # validation, the plan, the library's loss adapter
    core = engine.core
    core.skip_update()
    state = core.run(prep.plan, prep.tokens, prep.adapter, train=True)
    red = core.reduce(state)
    np.testing.assert_allclose(float(red[0]), ref["loss"][0], rtol=LOSS_RTOL, err_msg=f"{what} loss")
    seconds = core.round_seconds(state)
    assert len(seconds) == prep.plan.num_rounds and all(t > 0 for t in seconds)
    mc.finalize_model_grads(engine.model_chunks, None, pg_collection=engine.runtime.groups, force_all_reduce=True)
    named = _named(engine)
    assert named, what
    for name, p in named.items():
        expect = _shard(engine, ref["grads"][name], p)
        torch.testing.assert_close(p.main_grad, expect, rtol=GRAD_RTOL, atol=GRAD_ATOL,
                                   msg=lambda m, n=name: f"{what} grad {n}: {m}")
    core.skip_update()


def _check_params(engine, expect: dict, what: str, tol: float = PARAM_TOL) -> None:
    for name, p in _named(engine).items():
        torch.testing.assert_close(p.detach(), _shard(engine, expect[name], p), atol=tol, rtol=0,
                                   msg=lambda m, n=name: f"{what} {n}: {m}")


def _check_forward(engine, batch, ref: dict, what: str) -> None:
    out = engine.forward(batch)  # every rank, every stage: the caller's order
    assert [x.shape[0] for x in out.logprobs] == batch.lengths
    for i, lp in enumerate(ref["logprobs"]):
        torch.testing.assert_close(out.logprobs[i], lp, atol=LOGP_TOL, rtol=0, msg=lambda m, i=i: f"{what} {i}: {m}")
        assert bool((out.entropies[i][1:] > 0).all()) and out.entropies[i][0] == 0


def _check_stage_mismatch(engine, batch, plan) -> None:
    """The last pipeline stage holds another plan: every rank of the job raises, nothing runs."""
    from hdp.packing import PlannerConfig
    from hdp.packing import plan as make_plan
    from hdp.trainer.engine import nll_loss

    other = make_plan(batch.lengths, PlannerConfig(num_ranks=plan.num_ranks, max_tokens_per_rank=B,
                                                   policy="static-cp"))
    assert other.checksum() != plan.checksum()
    mine = other if engine.groups.is_last_stage else plan
    with pytest.raises(ValueError, match="plan mismatch"):
        engine.train_step(batch, nll_loss, plan=mine)


def _layout_run(parallel: dict, ref: dict, batches, what: str, *, ckpt: str | None = None, model_kw=None,
                forward: bool = True, mismatch: bool = False, **kw: object) -> None:
    """Gradients, ``train_step`` losses / norms / parameters, forward log-probs, checkpoint resume."""
    from hdp.trainer.engine import HdpEngine, nll_loss

    engine = HdpEngine.build(_engine_cfg(parallel, model_kw, **kw), dist.group.WORLD, init_fn=init_param)
    plan = engine.plan(batches[0])
    assert 2 in plan.stats.cp_degree_hist and plan.num_rounds >= 3, plan.to_dict()  # a CP2 ring, a pipeline
    if mismatch:
        _check_stage_mismatch(engine, batches[0], plan)
    _check_grads(engine, batches[0], ref, what)
    if forward:
        _check_forward(engine, batches[0], ref, what)
    steps = len(ref["loss"])
    for s in range(steps):
        m = engine.train_step(batches[s], nll_loss)
        np.testing.assert_allclose(m["loss"], ref["loss"][s], rtol=LOSS_RTOL, err_msg=f"{what} loss {s}")
        np.testing.assert_allclose(m["grad_norm"], ref["norm"][s], rtol=LOSS_RTOL, err_msg=f"{what} norm {s}")
        _check_params(engine, ref["params"][s], f"{what} step {s + 1}", tol=PARAM_TOL * (s + 1))
        if s == 0 and ckpt is not None:
            engine.save_checkpoint(ckpt)
    if ckpt is not None:
        uninterrupted = {n: p.detach().clone() for n, p in _named(engine).items()}
        resumed = HdpEngine.build(_engine_cfg(parallel, model_kw, **kw), dist.group.WORLD)  # default init
        resumed.load_checkpoint(ckpt)
        assert resumed.step == 1
        for s in range(1, steps):
            resumed.train_step(batches[s], nll_loss)
        for n, p in _named(resumed).items():
            assert torch.equal(p.detach(), uninterrupted[n]), f"{what}: checkpoint resume differs at {n}"
        resumed.close()
    engine.close()


# ---- bad layouts: the same clear error on every rank, before any collective ---------------------------


def _bad_layouts(rank: int, world: int) -> None:
    from hdp.trainer.config import ParallelConfig
    from hdp.trainer.engine import HdpEngine

    cases = [
        (dict(parallel=dict(pp=3), model_kw=dict(num_layers=6)), r"tp=1 x pp=3 = 3 does not divide the world of 4"),
        (dict(parallel=dict(tp=3)), r"tp=3: model.num_attention_heads=4 is not divisible by tp"),
        (dict(parallel=dict(tp=4)), r"tp=4: model.vocab_size|tp=4: model.num_query_groups=2"),
        (dict(parallel=dict(pp=2), model_kw=dict(num_layers=3)), r"num_layers=3 is not divisible by pp"),
        (dict(parallel=dict(ep=2)), r"ep=2: expert parallelism needs a MoE model"),
        (dict(parallel=dict(tp=2, sequence_parallel=False), model_kw=MOE), r"sequence_parallel=False"),
        (dict(parallel=dict(ep=8), model_kw=dict(num_moe_experts=8)), r"ep=8: expert parallelism is carved"),
    ]
    for kw, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            HdpEngine.build(_engine_cfg(kw["parallel"], kw.get("model_kw")), dist.group.WORLD)
    with pytest.raises(ValueError, match=r"ParallelConfig.virtual_pp=2: virtual stages need pp > 1"):
        ParallelConfig(virtual_pp=2)
    with pytest.raises(ValueError, match=r"ParallelConfig.expert_tp=2"):
        ParallelConfig(expert_tp=2)
    dist.barrier(group=dist.group.WORLD)  # nobody hung in a collective


# ---- PP 2 x domain 2 (4 ranks) ------------------------------------------------------------------------


def _pp(rank: int, world: int, tmp: str) -> None:
    _bad_layouts(rank, world)
    batches = [_batch(0), _batch(1)]
    ref = _reference(batches, 2)
    # 1F1B, with a distributed checkpoint after step 1
    _layout_run(dict(pp=2), ref, batches, "pp2", ckpt=os.path.join(tmp, "pp2"), mismatch=True)
    # interleaved 1F1B, 2 virtual stages per rank (rounds padded to a multiple of PP with idle rounds)
    one = {k: v[:1] for k, v in ref.items() if k in ("loss", "norm", "params")} | {
        k: ref[k] for k in ("grads", "logprobs")}
    _layout_run(dict(pp=2, virtual_pp=2), one, batches, "pp2 vpp2", forward=False)
    # MoE, EP 2 inside each stage's domain, zero-memory level1
    moe_ref = _reference(batches, 1, MOE)
    _layout_run(dict(pp=2, ep=2), moe_ref, batches, "moe pp2 ep2 zero-memory", model_kw=MOE, forward=False,
                zero_memory="level1")


def test_pp2_domain2_1f1b_interleaved_moe_forward_checkpoint_and_bad_layouts(tmp_path) -> None:
    """PP 2 x domain 2: 1F1B (+ forward log-probs, checkpoint resume, a plan mismatch between stages
    raises everywhere), interleaved with 2 virtual stages, MoE EP 2 with zero-memory level1; bad
    layouts raise on every rank without a hang."""
    run_distributed(_pp, 4, str(tmp_path), timeout=600)


# ---- PP 2 x 2 virtual stages x domain 2: 1, 2, 3 and 5 rounds (4 ranks) ------------------------------

# rounds -> (lengths, round_of, group_start, group_size) on a domain of 2 ranks (CP2 groups, an idle rank)
VPP_PLANS = {
    1: ([7, 4], [0, 0], [0, 1], [1, 1]),
    2: ([40, 9, 12], [0, 1, 1], [0, 0, 1], [2, 1, 1]),
    3: ([30, 20, 12, 25, 9], [0, 1, 1, 2, 2], [0, 0, 1, 0, 1], [2, 1, 1, 1, 1]),
    5: ([60, 30, 20, 12, 25, 9, 40, 16], [0, 1, 1, 2, 2, 2, 3, 4], [0, 0, 1, 0, 1, 0, 0, 0],
        [2, 1, 1, 1, 1, 1, 2, 1]),
}


def _vpp_plan(rounds: int):
    from hdp.packing import Plan

    lengths, round_of, start, size = (np.array(c) for c in VPP_PLANS[rounds])
    plan = Plan.from_columns(num_ranks=2, max_tokens_per_rank=B, policy="explicit", lengths=lengths,
                             round_of=round_of, group_start=start, group_size=size)
    assert plan.num_rounds == rounds
    return plan


def _vpp_rounds(rank: int, world: int) -> None:
    from hdp.trainer.engine import HdpEngine, nll_loss

    batches = {r: _batch(r, list(VPP_PLANS[r][0])) for r in VPP_PLANS}
    refs = {r: _reference([b], 1) for r, b in batches.items()}  # before the engine: it re-initialises Megatron
    engine = HdpEngine.build(_engine_cfg(dict(pp=2, virtual_pp=2), collective_timeout_s=60), dist.group.WORLD,
                             init_fn=init_param)
    for r, batch in batches.items():  # gradients only: the engine's weights stay the reference's
        _check_grads(engine, batch, refs[r], f"pp2 vpp2, {r} rounds", plan=_vpp_plan(r))
    for r, batch in batches.items():  # forward-only: every virtual micro-batch in warm-up
        out = engine.forward(batch, plan=_vpp_plan(r))
        for i, lp in enumerate(refs[r]["logprobs"]):
            torch.testing.assert_close(out.logprobs[i], lp, atol=LOGP_TOL, rtol=0)
    m = engine.train_step(batches[1], nll_loss, plan=_vpp_plan(1))  # one round: the case that hung
    np.testing.assert_allclose(m["loss"], refs[1]["loss"][0], rtol=LOSS_RTOL)
    np.testing.assert_allclose(m["grad_norm"], refs[1]["norm"][0], rtol=LOSS_RTOL)
    _check_params(engine, refs[1]["params"][0], "pp2 vpp2, 1 round, step 1")
    engine.close()


def test_pp2_vpp2_domain2_with_1_2_3_and_5_rounds() -> None:
    """The interleaved schedule on steps of <= PP rounds (every virtual micro-batch of stage 0 in warm-up,
    stage 1 already in 1F1B): gradients, log-probs and a train step equal one process, no hang (60 s timeout:
    the hang it fixes waited for the collective timeout)."""
    run_distributed(_vpp_rounds, 4, timeout=400)


# ---- TP 2 (sequence parallel) x domain 2 (4 ranks) ------------------------------------------------------


def _tp(rank: int, world: int, tmp: str) -> None:
    batches = [_batch(0), _batch(1)]
    ref = _reference(batches, 2)
    _layout_run(dict(tp=2), ref, batches, "tp2 sp", ckpt=os.path.join(tmp, "tp2"))
    moe_ref = _reference(batches, 1, MOE)
    # EP 2 with expert-TP 1 under TP 2 (each EP group spans the two TP ranks of a domain rank), zero-memory
    _layout_run(dict(tp=2, ep=2), moe_ref, batches, "moe tp2 ep2 zero-memory", model_kw=MOE, forward=False,
                zero_memory="level0")
    # an entropy bonus through LocalTensors.entropy(): its gradient reaches the model, over the full
    # vocabulary under TP 2 (the shard's log_softmax would be off) and at TP 1
    from hdp.trainer.engine import HdpEngine

    ent_ref = _reference(batches[:1], 1, entropy_coef=ENTROPY_COEF)
    assert abs(ent_ref["loss"][0] - ref["loss"][0]) > 1e-2 * abs(ref["loss"][0])  # the bonus matters
    for par in (dict(tp=2), dict()):
        engine = HdpEngine.build(_engine_cfg(par), dist.group.WORLD, init_fn=init_param)
        _check_grads(engine, batches[0], ent_ref, f"entropy bonus {par}", loss_fn=entropy_bonus_loss)
        engine.close()


def test_tp2_sequence_parallel_domain2_forward_checkpoint_and_moe(tmp_path) -> None:
    """TP 2 with sequence parallelism x domain 2 (+ forward log-probs, checkpoint resume); MoE EP 2 under
    TP 2 with zero-memory level0; an entropy-regularised loss under TP 2 and TP 1."""
    run_distributed(_tp, 4, str(tmp_path), timeout=600)


# ---- TP 2 x PP 2 x domain 2 (8 ranks) -------------------------------------------------------------------


def _tp_pp(rank: int, world: int, tmp: str) -> None:
    batches = [_batch(0), _batch(1)]
    ref = _reference(batches, 2)
    _layout_run(dict(tp=2, pp=2), ref, batches, "tp2 pp2", ckpt=os.path.join(tmp, "tp2pp2"))


@pytest.mark.slow
def test_tp2_pp2_domain2_on_8_ranks(tmp_path) -> None:
    """TP 2 (sequence parallel) x PP 2 x domain 2 on 8 gloo ranks (+ forward log-probs, checkpoint resume)."""
    run_distributed(_tp_pp, 8, str(tmp_path), timeout=900)
