"""verl's losses through verl's own ``ActorRolloutRefWorker`` on the hdp engine (2 CPU ranks, a CP group in the
plan): each loss either trains the mini-batch's own objective — whatever hdp's plan — or is refused, on every
rank, before any round, with the keys named.

Reference: the HF ``transformers`` model (float32) on the same checkpoint, every sample whole in one process, and
verl's loss on the whole mini-batch in one call (``dp_size`` 1): for a loss additive over samples that is stock
verl's update; for GMPO's ``geo_mean`` (a plain mean of each call) it is hdp's documented definition, the mean
over the mini-batch's samples.  Tolerances as tests/distributed/verl/test_verl_worker_path.py
tests/slow/verl/test_verl_worker_path_slow.py: loss 1e-5 relative, grad norm
1e-4 relative, log-probs and Σp² 2e-5 absolute; metrics that are means over tokens (``actor/ppo_kl``,
``actor/pg_clipfrac``) 1e-5 absolute against the whole mini-batch's.

Also here: ``calculate_sum_pi_squared`` (the log-prob pass returns Σ_v p_v² per token, at the pass's temperature)
and an engine built without a tokenizer (``actor_rollout_ref.model.load_tokenizer=false``).
"""

from __future__ import annotations

import os

import pytest

from helpers.verl_loss_worker import _hf

pytest.importorskip("verl")
pytest.importorskip("mbridge")

from helpers.dist_helper import run_distributed  # noqa: E402

LENGTHS = [(5, 9), (3, 90), (7, 12), (4, 20), (6, 4), (2, 30)]  # (prompt, response); 93 > budget 64: a CP group
BUDGET = 64
TEMPERATURE = 0.7


def _cfg(model_path: str, *overrides: str):
    from hdp.integrations.verl.scaffolding.worker import compose

    return compose(model_path, budget=BUDGET, records=None, overrides=[
        f"actor_rollout_ref.actor.ppo_mini_batch_size={len(LENGTHS)}", "actor_rollout_ref.actor.entropy_coeff=0.01",
        "actor_rollout_ref.actor.optim.lr=1e-2", "actor_rollout_ref.actor.clip_ratio=0.1",
        "actor_rollout_ref.actor.hdp.cost_model=cpu-tiny@cpu-gloo", "actor_rollout_ref.actor.hdp.auto_calibrate=false",
        *overrides])


def _state(engine) -> str:
    import hashlib

    h = hashlib.sha256()
    for chunk in engine.module:
        for p in chunk.parameters():
            h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def _refused(act, batch, rank: int) -> str:
    """update_actor on ``batch`` must raise on this rank with the weights unchanged; returns the message."""
    engine = act.actor.engine
    before = _state(engine)
    with pytest.raises(ValueError) as info:
        act.update_actor(batch)
    assert _state(engine) == before, f"rank {rank}: a refused update changed the weights"
    return str(info.value)


def _worker(rank: int, world: int, tmp: str) -> dict:
    import logging
    from functools import partial

    import torch
    import torch.distributed as dist

    from hdp.integrations.verl.scaffolding import batches as B
    from hdp.integrations.verl.scaffolding.tiny import VOCAB, build_tiny
    from hdp.integrations.verl.scaffolding.worker import actor_worker, prepare_rank
    from verl.utils import tensordict_utils as tu
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.metric.utils import reduce_metrics as verl_reduce_metrics
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    model_path = prepare_rank(rank, world, tmp)
    logging.getLogger("verl").setLevel(logging.ERROR)
    samples = B.random_samples(LENGTHS, VOCAB, seed=1)
    padded = B.padded_batch(samples, pad_id=0)
    result: dict = {}

    # 1. GMPO (geo_mean) trains the mini-batch's mean over samples; Σp² from the log-prob pass
    cfg = _cfg(model_path, "actor_rollout_ref.actor.policy_loss.loss_mode=geo_mean", "+actor_rollout_ref.model.load_tokenizer=false")
    act = actor_worker(cfg)
    engine = act.actor.engine
    assert engine.model_config.tokenizer is None  # built without a tokenizer, as verl's weight-export test builds it
    src = [None] * world
    dist.all_gather_object(src, bool(engine.is_mp_src_rank_with_outputs()), group=dist.group.WORLD)
    src = src.index(True)
    probe = B.ref_batch(padded)
    from hdp.integrations.verl.batch import sample_lengths

    assert max(engine.planner.plan(sample_lengths(probe)).group_size) > 1, "the batch must put a sample on a CP group"
    asked = B._td(padded, temperature=TEMPERATURE, calculate_entropy=True, calculate_sum_pi_squared=True, compute_loss=False)
    out = act.compute_log_prob(asked)
    objs = [None]
    if rank == src:
        objs = [no_padding_2_padding(tu.get(out, "log_probs"), probe).float()]
    dist.broadcast_object_list(objs, src=src, group=dist.group.WORLD)
    g = torch.Generator().manual_seed(3)
    shape = padded["responses"].shape
    old = (objs[0] - 0.2 * torch.rand(shape, generator=g)) * padded["response_mask"]  # ratio != 1: clipping acts
    adv = torch.randn(shape[0], 1, generator=g).expand(shape).contiguous() * padded["response_mask"]  # per sequence
    extra = {"old_log_probs": old, "advantages": adv}
    got = act.update_actor(B.update_batch(padded, extra, mini_batch_size=len(LENGTHS), calculate_entropy=True))
    if rank == src:
        _, hf_lp, _, hf_sq = _hf(model_path, samples, TEMPERATURE)
        for i, (a, b, c, d) in enumerate(zip(tu.get(out, "log_probs").unbind(), hf_lp,
                                             tu.get(out, "sum_pi_squared").unbind(), hf_sq)):
            torch.testing.assert_close(a[:-1].float(), b[:-1].detach(), atol=2e-5, rtol=0, msg=lambda m, i=i: f"logp {i}: {m}")
            torch.testing.assert_close(c.float(), d, atol=2e-5, rtol=0, msg=lambda m, i=i: f"sum_pi_squared {i}: {m}")
        model, logps, ents, _ = _hf(model_path, samples)
        data = B.update_batch(padded, extra, mini_batch_size=len(LENGTHS), calculate_entropy=True)
        actor_cfg = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
        loss, metrics = B.whole_batch_loss(partial(ppo_loss, config=actor_cfg), data, log_probs=logps, entropy=ents)
        loss.backward()
        norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])))
        m = verl_reduce_metrics(tu.get(got, "metrics"))
        ref = {k: float(v.aggregate()) if hasattr(v, "aggregate") else float(v) for k, v in metrics.items()}
        result["geo_mean"] = {"hdp": {k: m[k] for k in ("loss", "grad_norm", "actor/pg_loss", "actor/ppo_kl",
                                                          "actor/pg_clipfrac", "hdp/rounds")},
                              "ref": {"loss": float(loss), "grad_norm": norm, **ref}}
        r = result["geo_mean"]
        assert m["hdp/rounds"] > 1, m["hdp/rounds"]
        assert abs(m["loss"] - float(loss)) <= 1e-5 * max(1.0, abs(float(loss))), r
        assert abs(m["grad_norm"] - norm) <= 1e-4 * norm, r
        assert abs(m["actor/pg_loss"] - ref["actor/pg_loss"]) <= 1e-5 * max(1.0, abs(ref["actor/pg_loss"])), r
        for k in ("actor/ppo_kl", "actor/pg_clipfrac"):
            assert abs(m[k] - ref[k]) <= 1e-5, (k, r)
        assert ref["actor/pg_clipfrac"] > 0, "the reference must clip some tokens for the metric to mean anything"

    # 2. losses whose value depends on how samples are grouped: refused on every rank, nothing applied
    batch = lambda: B.update_batch(padded, extra, mini_batch_size=len(LENGTHS), calculate_entropy=True)  # noqa: E731
    act = actor_worker(_cfg(model_path, "actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov"))
    msg = _refused(act, batch(), rank)
    assert "actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov" in msg, msg
    act = actor_worker(_cfg(model_path, "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm"))
    msg = _refused(act, batch(), rank)
    assert "loss_scale_factor" in msg and "seq-mean-token-sum-norm" in msg, msg
    # 3. a loss that runs a collective inside each call (bypass mode's batch-normalised IS weights)
    act = actor_worker(_cfg(
        model_path, "actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode",
        "+actor_rollout_ref.actor.policy_loss.rollout_correction.bypass_mode=true",
        "+actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_is=token",
        "+actor_rollout_ref.actor.policy_loss.rollout_correction.loss_type=reinforce",
        "+actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_is_batch_normalize=true"))
    msg = _refused(act, batch(), rank)
    assert "rollout_is_batch_normalize=True" in msg and "collective" in msg, msg
    result["refusals"] = "ok"
    return result


def test_policy_losses_train_the_mini_batchs_objective_or_are_refused(tmp_path):
    out = run_distributed(_worker, 2, str(tmp_path), timeout=900)
    got = [r for r in out if r.get("geo_mean")]
    assert len(got) == 1 and all(r.get("refusals") == "ok" for r in out), out
    print("geo_mean:", got[0]["geo_mean"])
