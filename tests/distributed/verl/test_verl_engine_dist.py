"""``HdpMegatronEngine`` on a tiny Megatron GPT (2 and 4 gloo ranks) equals one process on the whole batch.

What runs is the engine's own code: ``forward_backward_batch`` (hdp plan, checksum, round loop through
Megatron's ``forward_backward_func``, zigzag chunks with hdp's ring CP attention inside Megatron's
``GPTModel``, whole-sample log-probs per group, verl's real ``ppo_loss`` with global normalisers,
Megatron DDP gradient all-reduce, outputs gathered in verl's sample order, metric reduction), and
verl's own ``BaseEngine.train_batch`` / ``infer_batch`` / ``MegatronEngine.optimizer_*`` around it,
on the TensorDict verl's trainer sends (``left_right_2_no_padding`` of a padded update batch:
nested ``input_ids``/``position_ids``, ``loss_mask``, ``response_mask``, ``old_log_probs``,
``advantages``, temperature).

What does not run on CPU: verl's ``MegatronEngine.__init__``/``initialize`` (Megatron-Bridge model
building from an HF checkpoint, checkpoint manager, weight export, offload).  The engine is built
with :meth:`HdpMegatronEngine.from_modules` around ``hdp.trainer.model``'s GPT instead.

Reference: the same GPT (same seed) in one process, every sample whole, verl's ``ppo_loss`` with
``dp_size = 1``.  Tolerances (float32): gradients ``rtol 1e-4`` and ``atol 1e-6 · max|g|`` (the
paths sum tokens in different splits and orders); log-probs ``2e-5`` absolute (values O(1..10)).
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("verl")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from helpers.dist_helper import run_distributed  # noqa: E402

MODES = ("token-mean", "seq-mean-token-mean")
LOGP_TOL = 2e-5
BUDGET = 48  # tokens per rank and round: the long samples need 2..4 ranks
# (prompt, response) lengths: short samples fit one rank, two need a CP group
LENGTHS = {
    2: [(5, 9), (3, 70), (7, 12), (4, 20), (6, 4), (2, 30), (8, 6)],
    4: [(5, 9), (3, 150), (7, 12), (4, 20), (6, 4), (2, 100), (8, 6), (3, 17), (5, 25)],
}


def _worker(rank: int, world: int) -> None:
    import logging
    from functools import partial

    from verl.utils.metric.utils import Metric
    from verl.workers.utils.losses import ppo_loss

    from hdp import megatron_compat as mc
    from hdp.integrations import verl as _pkg  # noqa: F401
    from benchmarks.verl.bench import (actor_config, build_engines, grads_close, main_grads, plan_that_ran,
                                             reference_step, verl_update_batch)
    from hdp.integrations.verl.batch import sample_lengths
    from hdp.core.planning import plan_id

    logging.getLogger("verl").setLevel(logging.ERROR)
    mc.initialize_megatron(device="cpu", seed=1234)
    lengths = LENGTHS[world]
    batch = partial(verl_update_batch, lengths, 3, temperature=0.8, max_token_len_per_gpu=BUDGET)
    engine, model = build_engines(budget=BUDGET)
    plan = engine.planner.plan(sample_lengths(batch()))  # the engine's planner on this batch; each step must run it
    assert max(plan.group_size) > 1, "the batch must split some sample over a CP group"
    assert world == 2 or min(plan.group_size) == 1, "on 4 ranks the plan mixes CP groups and k = 1"

    for mode in MODES:
        ref_grads, ref_logp, ref_loss = reference_step(batch(calculate_entropy=True), mode)
        data = batch(calculate_entropy=True)
        model.zero_grad_buffer()
        out = engine.forward_backward_batch(data, partial(ppo_loss, actor_config(mode)))
        ok, worst = grads_close(main_grads(model), ref_grads)
        assert ok, f"{mode}: gradients differ from the single-process reference (max abs diff {worst:.3e})"
        if rank == 0:
            got = list(out["model_output"]["log_probs"].unbind())
            assert len(got) == len(ref_logp)
            for i, (a, b) in enumerate(zip(got, ref_logp)):
                torch.testing.assert_close(a, b, atol=LOGP_TOL, rtol=0, msg=lambda m, i=i: f"{mode} sample {i}: {m}")
            assert len(out["model_output"]["entropy"].unbind()) == len(lengths)
            # the step's loss (what the worker logs as actor/loss) is the whole batch's, on any domain size
            assert len(out["loss"]) == 1 and abs(out["loss"][0] - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss)), (
                mode, out["loss"], ref_loss)
            metrics = out["metrics"]
            assert isinstance(metrics["actor/pg_loss"], Metric)
            assert metrics["hdp/rounds"] == [plan.num_rounds] and metrics["hdp/plan_id"] == [plan_id(plan)]
            assert plan_that_ran(metrics)["cp_degree_hist"] == {str(k): v for k, v in sorted(plan.stats.cp_degree_hist.items())}
        else:
            assert out == {}

    # verl's infer_batch (compute_log_prob): no_grad, no loss, log-probs in verl's order on rank 0
    out = engine.infer_batch(batch(calculate_entropy=False))
    if rank == 0:
        for a, b in zip(out["model_output"]["log_probs"].unbind(), ref_logp):
            torch.testing.assert_close(a, b, atol=LOGP_TOL, rtol=0)
        assert "entropy" not in out["model_output"]
        # no loss function: floats (1.0 per round, as stock verl), which the worker all-reduces with AVG
        assert out["loss"] and all(type(x) is float for x in out["loss"]), out["loss"]

    # verl's train_batch (update_actor): zero_grad, hdp step, Megatron distributed-optimizer step
    mc.destroy_megatron()
    mc.initialize_megatron(device="cpu", seed=1234)
    engine2, model2 = build_engines(budget=BUDGET, distributed_optimizer=True)
    ref_norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in ref_grads])))
    before = [p.detach().clone() for p in model2.parameters()]
    out = engine2.train_batch(batch(), partial(ppo_loss, actor_config(MODES[-1])))
    changed = sum(not torch.equal(a, p.detach()) for a, p in zip(before, model2.parameters()))
    assert changed > 0
    norm = torch.tensor([float(out["metrics"]["grad_norm"]) if rank == 0 else 0.0], dtype=torch.float64)
    dist.broadcast(norm, src=0, group=dist.group.WORLD)
    assert abs(float(norm) - ref_norm) <= 1e-4 * ref_norm, (float(norm), ref_norm)
    if rank == 0:  # the step's phases, the slowest rank's (the late ones belong to a previous step: none yet)
        from hdp.core.phases import LATE_PHASES, PHASES, metric_name

        got = {p: out["metrics"][metric_name(p)][0] for p in PHASES}
        assert all(math.isnan(v) if p in LATE_PHASES else v >= 0.0 for p, v in got.items()), got
        assert got["rounds"] > got["loss"] > got["exchange"] > 0.0, got

    # verl's split primitives (a Tinker-style worker): the passes between optimizer_zero_grad and optimizer_step
    # are one update, skipped on every rank when any of them was not finite
    loss_fn = partial(ppo_loss, actor_config(MODES[-1]))

    def nan_loss(*a, **k):
        value, metrics = loss_fn(*a, **k)
        return value * float("nan"), metrics

    held = [p.detach().clone() for p in model2.parameters()]
    engine2.optimizer_zero_grad()
    engine2.forward_backward_batch(batch(), nan_loss)
    engine2.forward_backward_batch(batch(), loss_fn)
    assert math.isnan(engine2.optimizer_step())
    assert all(torch.equal(a, p.detach()) for a, p in zip(held, model2.parameters()))  # nothing applied
    engine2.optimizer_zero_grad()
    engine2.forward_backward_batch(batch(), loss_fn)
    assert math.isfinite(engine2.optimizer_step())
    assert any(not torch.equal(a, p.detach()) for a, p in zip(held, model2.parameters()))
    mc.destroy_megatron()


@pytest.mark.parametrize("world", [2, 4])
def test_hdp_engine_matches_single_process_reference(world: int) -> None:
    run_distributed(_worker, world, timeout=110)
