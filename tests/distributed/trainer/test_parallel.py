"""HdpEngine under TP / PP / EP layouts on gloo: every layout against one process on the whole batch.

World = TP × PP × domain.  Each layout runs the same batch under an hdp plan on the domain (a CP2
ring and single-rank groups) and is compared with a plain one-process Megatron GPT on the whole
batch (same weights, set by global parameter name so every layout starts identically):

* gradients after the rounds (the engine's phases 1–2, then Megatron's ``finalize_model_grads``
  with an all-reduce instead of the reduce-scatter, so every rank holds whole gradients) equal
  the reference's TP shard of each parameter: fp32 round-off, ``rtol=1e-4, atol=1e-6``;
* losses (1e-5 relative), grad norms (1e-5 relative) and parameters after Adam steps through
  ``train_step`` (2e-6 absolute, as in tests/distributed/trainer/test_engine.py);
* forward log-probs in the caller's order (1e-5 absolute) on every rank, whatever its stage;
* checkpoint save -> load -> step equals the uninterrupted run bit for bit.

Spawned runs are shared among checks to keep the suite short: one 4-rank run for PP (1F1B,
interleaved, MoE EP 2 with zero-memory, bad layouts), one for TP, one 8-rank run for TP × PP.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

from helpers.dist_helper import run_distributed

from helpers.parallel import (
    B, LOGP_TOL, LOSS_RTOL, _batch, _check_grads, _check_params, _engine_cfg, _layout_run, _reference, init_param
)

MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48)


# ---- the one-process reference ------------------------------------------------------------------------


ENTROPY_COEF = 0.1


def entropy_bonus_loss(local, logprobs, weights):
    """NLL with an entropy bonus: ℓ_t = −log p_t − c·H_t (H over the full vocabulary, with its gradient)."""
    return -(weights * (logprobs + ENTROPY_COEF * local.entropy())).sum()


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
