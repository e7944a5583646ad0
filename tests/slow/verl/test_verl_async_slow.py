"""The slow tier (over ~20 s) of the tests tests/unit/verl/test_verl_async.py describes: its docstring says what they check and how."""

from __future__ import annotations

import pytest

pytest.importorskip("verl")
pytest.importorskip("mbridge")

from helpers.dist_helper import run_distributed  # noqa: E402

LENGTHS = [(5, 9), (3, 90), (7, 12), (4, 20)]  # 93 > budget 64: a CP group
BUDGET = 64


def _worker(rank: int, world: int, tmp: str, bypass: bool) -> dict:
    from hdp.integrations.verl.scaffolding.worker import compose, prepare_rank

    model_path = prepare_rank(rank, world, tmp)
    import torch
    import torch.distributed as dist

    from verl.experimental.separation.engine_workers import DetachActorWorker
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding
    from hdp.integrations.verl.engine import HdpMegatronEngine
    from hdp.integrations.verl.scaffolding import batches as B
    from hdp.integrations.verl.scaffolding.tiny import VOCAB

    cfg = compose(model_path, budget=BUDGET, records=None, overrides=[
        f"actor_rollout_ref.actor.ppo_mini_batch_size={len(LENGTHS)}", "actor_rollout_ref.actor.optim.lr=1e-2",
        "actor_rollout_ref.actor.hdp.cost_model=cpu-tiny@cpu-gloo", "actor_rollout_ref.actor.hdp.auto_calibrate=false",
        f"algorithm.rollout_correction.bypass_mode={bypass}",
    ])
    worker = DetachActorWorker(cfg.actor_rollout_ref, role="actor")  # the class both trainers map the actor to
    worker.init_model()
    engine = worker.actor.engine
    assert type(engine) is HdpMegatronEngine
    samples = B.random_samples(LENGTHS, VOCAB, seed=1)
    padded = B.padded_batch(samples, pad_id=0)
    probe = B.ref_batch(padded)
    flags = [None] * world
    dist.all_gather_object(flags, bool(engine.is_mp_src_rank_with_outputs()), group=dist.group.WORLD)
    src = flags.index(True)

    def weights() -> dict:
        return {n: t.detach().clone() for n, t in engine.get_per_tensor_param()[0]}

    def log_probs():
        out = worker.compute_log_prob(B.old_logp_batch(padded))
        objs = [no_padding_2_padding(tu.get(out, "log_probs"), probe).float() if rank == src else None]
        dist.broadcast_object_list(objs, src=src, group=dist.group.WORLD)
        return objs[0]

    def update(old) -> None:
        adv = torch.randn(padded["responses"].shape, generator=torch.Generator().manual_seed(3)) * padded["response_mask"]
        worker.update_actor(B.update_batch(padded, {"old_log_probs": old, "advantages": adv}, mini_batch_size=len(LENGTHS)))

    rollout_lp = torch.full(padded["responses"].shape, -4.0)  # what a rollout would return with its tokens
    w0 = weights()
    if bypass:  # the rollout's log-probs are the old ones: no pass, nothing saved
        update(rollout_lp)
        update(rollout_lp)
        return {"moved": any(not torch.equal(w0[n], t) for n, t in weights().items())}
    worker.save_model_to_cpu(0)  # local step 0: the start-of-cycle policy
    lp0 = log_probs()
    update(lp0)
    w1 = weights()
    # local step 1's old-log-prob pass, as the separate-async trainer runs it
    worker.save_model_to_cpu(1)
    worker.restore_model_from_cpu(0)
    restored = all(torch.equal(w0[n], t) for n, t in weights().items())
    lp_again = log_probs()
    worker.restore_model_from_cpu(1)
    back = all(torch.equal(w1[n], t) for n, t in weights().items())
    worker.clear_cpu_model(1)
    update(lp_again)  # and training goes on
    moved = any(not torch.equal(w1[n], t) for n, t in weights().items())
    return {"restored": restored, "same_log_probs": bool(torch.equal(lp0, lp_again)), "back": back, "moved": moved,
            "changed": any(not torch.equal(w0[n], w1[n]) for n in w0)}


@pytest.mark.parametrize("bypass", [False, True], ids=["decoupled", "bypass"])
def test_detached_actor_worker_runs_hdp_in_both_modes(tmp_path, bypass):
    res = run_distributed(_worker, 2, str(tmp_path), bypass, timeout=300)
    for r in res:
        assert r["moved"], r
        if not bypass:
            assert r["changed"] and r["restored"] and r["same_log_probs"] and r["back"], r
