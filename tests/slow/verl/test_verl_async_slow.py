"""verl's separate-async (v1) and fully-async trainers with the actor on hdp, through the worker their trainers
build: ``DetachActorWorker`` (``verl/experimental/separation/engine_workers.py``) on 2 gloo ranks.

What the trainers call, in both ``algorithm.rollout_correction.bypass_mode`` settings:

* bypass mode: the update on the rollout's log-probs as the old ones (no old-log-prob pass, nothing saved);
* decoupled mode (bypass off): the old-log-prob pass of a later local step runs on the *start-of-cycle*
  policy — ``save_model_to_cpu(k)``, ``restore_model_from_cpu(0)``, ``compute_log_prob``,
  ``restore_model_from_cpu(k)``, ``clear_cpu_model(k)`` (``trainer_separate_async.py``
  ``_compute_old_log_prob``; the fully-async trainer's is the same with 1-based steps).  Before hdp mapped
  Megatron's handlers to its strategy this raised ``NotImplementedError: Unsupported strategy: hdp``.

Checked: the restored weights are the saved ones bit for bit, the log-probs on them equal the log-probs taken at
the start of the cycle bit for bit, the current policy comes back bit for bit, and a further update runs.  Both
trainers' configs compose with ``model_engine=hdp`` and give the actor hdp's engine.

Not run here, and why: the trainers' rollout side.  Both put the rollout on its own resource pool and sync
weights to it through a checkpoint engine across processes (``actor_rollout_ref.rollout.checkpoint_engine.
backend``: nccl, nixl, hccl, mooncake, kimi: each needs GPUs or RDMA); verl 0.9.1's only CPU-capable one,
``naive``, serves colocated rollouts, which these trainers reject.
"""

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
