"""The slow tier (over ~20 s) of the tests tests/unit/verl/test_verl_old_log_prob.py describes: its docstring says what they check and how."""

from __future__ import annotations

import pytest

pytest.importorskip("verl")
pytest.importorskip("mbridge")

from helpers.dist_helper import run_distributed  # noqa: E402

LENGTHS = [(5, 9), (3, 90), (7, 12), (4, 20), (6, 4), (2, 30)]  # 93 > budget 64: a CP group
BUDGET = 64


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

    def read_stand_in(**over: torch.Tensor) -> dict:
        """The update of a flagged batch carrying what verl's driver derives from the NaN stand-ins."""
        nan = torch.full_like(old, float("nan"))
        extra = {"old_log_probs": nan, "advantages": adv, "ref_log_prob": old - 0.05, **over}
        batch = B.update_batch(padded, extra, mini_batch_size=len(LENGTHS))
        tu.assign_non_tensor(batch, **{old_log_prob.SKIP_FLAG: True})
        held = {n: t.detach().clone() for n, t in fresh.actor.engine.get_per_tensor_param()[0]}
        try:
            res = fresh.update_actor(batch)
            grad = None if res is None else float(verl_reduce_metrics(tu.get(res, "metrics"))["grad_norm"])
            error = None
        except ValueError as exc:
            grad, error = None, str(exc)
        now = {n: t.detach().clone() for n, t in fresh.actor.engine.get_per_tensor_param()[0]}
        return {"error": error, "grad_norm": grad, "unchanged": all(torch.equal(held[n], now[n]) for n in held)}

    nan = torch.full_like(old, float("nan"))
    net = {"weights": read_stand_in(rollout_is_weights=nan),  # rollout correction computed from the stand-ins
           "advantages": read_stand_in(advantages=adv + nan * mask)}  # an estimator that read them
    return {"ran": ran, "skipped": skipped, "pass_entropy": pass_entropy, "weights_diff": diff, "src": rank == src,
            "net": net}


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
    # the worker's safety net: a flagged update whose batch carries what the driver derived from the NaN stand-ins
    # is refused on every rank, naming the option, with nothing applied (before: trained on NaN, every update
    # skipped with grad_norm NaN while the job went on)
    for r in res:
        for what, needle in (("weights", "rollout_is_weights (computed from them)"), ("advantages", "NaN in advantages")):
            got = r["net"][what]
            assert got["error"] is not None and needle in got["error"], (what, got)
            assert "set actor_rollout_ref.actor.hdp.skip_old_log_prob=false" in got["error"], got
            assert got["unchanged"], (what, got)
