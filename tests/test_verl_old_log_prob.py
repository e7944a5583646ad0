"""The actor's old-log-prob pass skipped on an on-policy step (``actor_rollout_ref.actor.hdp.skip_old_log_prob``).

Decision (driver side, `hdp.integrations.verl.old_log_prob.resolve` on verl's composed config): ``auto`` skips
exactly when the step is on-policy and nothing reads the old log-probs before the update; ``true`` on a step
that needs the pass names the keys; ``false`` never skips.  Update (worker side, through verl's own
``ActorRolloutRefWorker`` on 2 gloo ranks with a CP group in the plan): the update given the NaN stand-in and
the skip flag equals the update given the pass's real old log-probs — ``actor/pg_loss``, ``actor/kl_loss``,
``actor/entropy`` (from the pass there, from the update here), ``grad_norm`` to ``1e-6`` relative (two
forwards against one) — and the weights after both updates (two actors from the same checkpoint) agree to ``1e-6``.  The whole trainer with the
pass skipped: ``tests/test_verl_main_ppo.py``; the two runs side by side: ``hdp bench verl-old-logprob``.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("verl")
pytest.importorskip("mbridge")

from dist_helper import run_distributed  # noqa: E402

LENGTHS = [(5, 9), (3, 90), (7, 12), (4, 20), (6, 4), (2, 30)]  # 93 > budget 64: a CP group
BUDGET = 64


def _cfg(overrides: list[str]):
    import verl.trainer.config as vtc
    from hydra import compose, initialize_config_dir

    import hdp.integrations.verl.plugin  # noqa: F401 - hdp's configs on Hydra's search path

    base = ["model_engine=hdp", "algorithm.adv_estimator=grpo", "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.rollout.calculate_log_probs=false"]
    with initialize_config_dir(config_dir=os.path.dirname(vtc.__file__), version_base=None):
        return compose("ppo_trainer", overrides=[*base, *overrides])


@pytest.mark.parametrize(("overrides", "skips", "reason"), [
    ([], True, None),
    (["actor_rollout_ref.actor.hdp.skip_old_log_prob=false"], False, None),
    (["actor_rollout_ref.actor.ppo_epochs=2"], False, "ppo_epochs=2"),
    (["actor_rollout_ref.actor.ppo_mini_batch_size=4"], False, "ppo_mini_batch_size=4 < data.train_batch_size=8"),
    (["algorithm.use_kl_in_reward=true"], False, "use_kl_in_reward"),
    (["actor_rollout_ref.rollout.calculate_log_probs=true"], False, "calculate_log_probs"),
    (["algorithm.rollout_correction.bypass_mode=true"], False, "bypass_mode"),
    (["algorithm.adv_estimator=optimal_token_baseline"], False, "optimal_token_baseline"),
    (["trainer.v1.trainer_mode=separate_async"], False, "trainer_mode=separate_async"),
])
def test_auto_skips_exactly_on_policy_steps(overrides, skips, reason):
    from hdp.integrations.verl import old_log_prob

    cfg = _cfg(overrides)
    assert old_log_prob.resolve(cfg) is skips
    if reason is not None:
        assert any(reason in r for r in old_log_prob.needed_by(cfg)), old_log_prob.needed_by(cfg)
        with pytest.raises(ValueError, match=r"skip_old_log_prob=true, but this job needs the old-log-prob pass"):
            old_log_prob.resolve(_cfg([*overrides, "actor_rollout_ref.actor.hdp.skip_old_log_prob=true"]))
    with pytest.raises(ValueError, match=r"skip_old_log_prob='maybe': pass auto, true or false"):
        from hdp.integrations.verl.config import HdpOptions

        HdpOptions(skip_old_log_prob="maybe")


def _worker(rank: int, world: int, tmp: str) -> dict:
    from hdp.integrations.verl.scaffolding.worker import actor_worker, compose, prepare_rank

    model_path = prepare_rank(rank, world, tmp)
    import torch
    import torch.distributed as dist

    from verl.utils import tensordict_utils as tu
    from verl.utils.metric.utils import reduce_metrics as verl_reduce_metrics
    from verl.workers.utils.padding import no_padding_2_padding
    from hdp.integrations.verl import old_log_prob
    from hdp.integrations.verl.scaffolding import batches as B
    from hdp.integrations.verl.scaffolding.tiny import VOCAB

    cfg = compose(model_path, budget=BUDGET, records=None, overrides=[
        "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.1",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={len(LENGTHS)}", "actor_rollout_ref.actor.optim.lr=1e-2",
        "actor_rollout_ref.actor.hdp.cost_model=cpu-tiny@cpu-gloo", "actor_rollout_ref.actor.hdp.auto_calibrate=false",
    ])
    act = actor_worker(cfg)
    engine = act.actor.engine
    samples = B.random_samples(LENGTHS, VOCAB, seed=1)
    padded = B.padded_batch(samples, pad_id=0)
    probe = B.ref_batch(padded)
    out = act.compute_log_prob(B.old_logp_batch(padded))  # the pass the driver would run
    flags = [None] * world
    dist.all_gather_object(flags, bool(engine.is_mp_src_rank_with_outputs()), group=dist.group.WORLD)
    src = flags.index(True)
    objs = [None, None]
    if rank == src:
        objs = [no_padding_2_padding(tu.get(out, "log_probs"), probe).float(),
                no_padding_2_padding(tu.get(out, "entropy"), probe).float()]
    dist.broadcast_object_list(objs, src=src, group=dist.group.WORLD)
    old, entropy = objs
    mask = padded["response_mask"]
    pass_entropy = float((entropy * mask).sum() / mask.sum())  # verl's actor/entropy (token-mean) from the pass
    adv = torch.randn(padded["responses"].shape, generator=torch.Generator().manual_seed(3)) * mask
    fresh = actor_worker(cfg)  # a second actor from the same checkpoint (one process, one parallel state)

    def update(act, skip: bool) -> tuple[dict, dict]:
        engine = act.actor.engine
        extra = {"old_log_probs": torch.full_like(old, float("nan")) if skip else old, "advantages": adv,
                 "ref_log_prob": old - 0.05}
        batch = B.update_batch(padded, extra, mini_batch_size=len(LENGTHS))
        if skip:
            tu.assign_non_tensor(batch, **{old_log_prob.SKIP_FLAG: True})
        res = act.update_actor(batch)
        weights = {n: t.detach().clone() for n, t in engine.get_per_tensor_param()[0]}
        if res is None:
            return {}, weights
        m = verl_reduce_metrics(tu.get(res, "metrics"))
        return {k: m.get(k) for k in ("actor/pg_loss", "kl_loss", "actor/entropy", "grad_norm", "actor/ppo_kl",
                                      "actor/entropy_loss")}, weights

    ran, w_ran = update(act, skip=False)
    skipped, w_skipped = update(fresh, skip=True)
    diff = max(float((w_ran[n] - w_skipped[n]).abs().max()) for n in w_ran)
    return {"ran": ran, "skipped": skipped, "pass_entropy": pass_entropy, "weights_diff": diff, "src": rank == src}


@pytest.mark.slow
def test_the_update_without_the_pass_equals_the_update_after_it(tmp_path):
    res = run_distributed(_worker, 2, str(tmp_path), timeout=300)
    src = next(r for r in res if r["src"])
    ran, skipped = src["ran"], src["skipped"]
    for key in ("actor/pg_loss", "kl_loss", "grad_norm"):
        assert abs(ran[key] - skipped[key]) <= 1e-6 * max(1.0, abs(ran[key])), (key, ran, skipped)
    assert skipped["actor/ppo_kl"] == 0.0  # the ratio is exactly 1
    assert skipped["actor/entropy_loss"] is None  # entropy_coeff 0: computed for actor/entropy only
    # the skipped pass's actor/entropy comes from the update's forward: the pass's own value
    assert abs(skipped["actor/entropy"] - src["pass_entropy"]) <= 1e-6 * src["pass_entropy"], (skipped, src["pass_entropy"])
    assert all(r["weights_diff"] <= 1e-6 for r in res), [r["weights_diff"] for r in res]
