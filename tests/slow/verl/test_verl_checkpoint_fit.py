"""A checkpoint of another role loaded through verl's own workers: the actor's into the critic and the critic's into
the actor, in both formats verl's Megatron engine writes the model in (Hugging Face safetensors through mbridge,
verl's default, on domain 2; a Megatron distributed checkpoint, ``megatron.use_dist_checkpointing=true``, on PP 2).

Through the door users take (verl's ``ppo_trainer`` config with ``model_engine=hdp``, the critic's
``TrainingWorker`` and the ``ActorRolloutRefWorker``, their ``save_checkpoint`` / ``load_checkpoint``), each
refused load must: raise a ``ValueError`` on every rank within seconds, naming the first differing tensor with
both sides' shapes and dtypes and the two roles; leave every parameter and optimizer-state tensor bit for bit as
before (sha256); and leave the engine working — its own checkpoint still loads and the next update runs.  Before,
verl's load had written the model (18 parameters of the tiny model) before the optimizer state failed, from inside
collectives, and the engine was unusable after ("Megatron groups are not built").
"""

from __future__ import annotations

import math
import os
import time

import pytest

pytest.importorskip("verl")
pytest.importorskip("mbridge")

from helpers.dist_helper import run_distributed  # noqa: E402

LENGTHS = [(5, 9), (3, 30), (7, 12), (4, 20), (6, 4), (2, 30)]  # (prompt, response)
BUDGET = 64
FAST_S = 10.0
"""Seconds within which every rank must have raised (a loaded 2-core machine; typically 0.1 s)."""


def _worker(rank: int, world: int, fmt: str, tmp: str) -> None:
    from hdp.integrations.verl.scaffolding.worker import actor_worker, compose, critic_worker, prepare_rank

    model_path = prepare_rank(rank, world, tmp, layers=2)
    import torch
    import torch.distributed as dist

    from verl.utils import tensordict_utils as tu
    from verl.utils.metric.utils import reduce_metrics as verl_reduce_metrics

    from hdp.integrations.verl import compat
    from hdp.integrations.verl.scaffolding import batches as B
    from hdp.integrations.verl.scaffolding.tiny import VOCAB
    from benchmarks.faults import digest_of, state_tensors

    overrides = [
        "algorithm.adv_estimator=gae", f"critic.model.path={model_path}", "critic.model.use_remove_padding=True",
        "critic.megatron.dtype=float32", f"critic.ppo_max_token_len_per_gpu={BUDGET}",
        f"critic.ppo_mini_batch_size={len(LENGTHS)}", "critic.optim.total_training_steps=10",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={len(LENGTHS)}",
        "actor_rollout_ref.actor.optim.total_training_steps=10",
        "actor_rollout_ref.actor.hdp.cost_model=cpu-tiny@cpu-gloo", "actor_rollout_ref.actor.hdp.auto_calibrate=false",
    ]
    if fmt == "dist":
        overrides += [f"actor_rollout_ref.{r}.megatron.pipeline_model_parallel_size=2" for r in ("actor", "ref")]
        # verl builds a model with use_dist_checkpointing from a Megatron checkpoint of its weights: write one (a
        # fixture) from an engine built from the Hugging Face model
        init = actor_worker(compose(model_path, budget=BUDGET, records=None, overrides=overrides))
        from hdp.megatron_compat import dist_checkpointing

        if rank == 0:
            os.makedirs(f"{tmp}/init", exist_ok=True)
        dist.barrier(group=dist.group.WORLD)
        dist_checkpointing.save(compat.unwrap_model(init.actor.engine.module[0]).sharded_state_dict(), f"{tmp}/init")
        overrides += [f"{r}.megatron.{k}" for r in ("critic", "actor_rollout_ref.actor")
                      for k in ("use_dist_checkpointing=true", f"dist_checkpointing_path={tmp}/init")]
    cfg = compose(model_path, budget=BUDGET, records=None, overrides=overrides)
    critic, _ = critic_worker(cfg)
    act = actor_worker(cfg, role="actor")
    engines = {"critic": critic.engine, "actor": act.actor.engine}
    assert engines["actor"].domain.layout.pp_size == (2 if fmt == "dist" else 1)

    padded = B.padded_batch(B.random_samples(LENGTHS, VOCAB, seed=1), pad_id=0)
    mask = padded["response_mask"].float()
    g = torch.Generator().manual_seed(3)
    extra = {"actor": {"old_log_probs": -mask, "advantages": torch.randn(mask.shape, generator=g) * mask},
             "critic": {"values": 0 * mask, "returns": torch.randn(mask.shape, generator=g) * mask}}

    def update(role: str) -> dict | None:
        if role == "actor":
            out = act.update_actor(B.update_batch(padded, extra["actor"], mini_batch_size=len(LENGTHS)))
        else:
            out = critic.train_mini_batch(B.critic_update_batch(padded, extra["critic"], mini_batch_size=len(LENGTHS)))
        return None if out is None else verl_reduce_metrics(tu.get(out, "metrics"))

    workers = {"critic": critic, "actor": act}
    for role in ("critic", "actor"):
        update(role)  # Adam holds moments from here on
        workers[role].save_checkpoint(f"{tmp}/{role}", global_step=1)
    saved = "lm_head.weight" if fmt == "huggingface" else "output_layer.weight"
    for role, other in (("critic", "actor"), ("actor", "critic")):
        engine = engines[role]
        held = state_tensors(engine.module, engine.optimizer)
        before = digest_of(held)
        rows = {"critic": 1, "actor": VOCAB}
        t0 = time.monotonic()
        with pytest.raises(ValueError) as info:
            workers[role].load_checkpoint(f"{tmp}/{other}", del_local_after_load=False)
        secs = time.monotonic() - t0
        msg = str(info.value)
        tensor = f"entry '{saved}': checkpoint [{rows[other]}, 32] float32, this engine [{rows[role]}, 32] float32"
        for needle in ("does not fit this engine", tensor, f"role: checkpoint '{other}', this engine '{role}'",
                       "Nothing was loaded"):
            assert needle in msg, f"{role} <- {other}: {needle!r} not in {msg}"
        assert secs < FAST_S, (role, secs)
        assert digest_of(held) == before, f"the refused load of the {other}'s checkpoint changed the {role}'s state"
        workers[role].load_checkpoint(f"{tmp}/{role}", del_local_after_load=False)  # its own still loads
        m = update(role)  # and the engine trains on
        assert m is None or math.isfinite(m["loss"]), m
    # a path that does not exist: refused on every rank before verl's loader runs; the engine stays usable
    with pytest.raises(ValueError, match="does not exist"):
        critic.load_checkpoint(f"{tmp}/nowhere", del_local_after_load=False)
    update("critic")


@pytest.mark.parametrize("fmt", ["huggingface", "dist"])
def test_a_checkpoint_of_the_other_role_is_refused_on_every_rank_and_changes_nothing(fmt: str, tmp_path) -> None:
    run_distributed(_worker, 2, fmt, str(tmp_path), timeout=400)
