"""verl's own ``ActorRolloutRefWorker`` builds and drives the hdp engine (CPU, gloo: domain 2 on 2 ranks,
TP 2 x domain 2 and PP 2 x domain 2 on 4 ranks, with TP / PP taken from verl's ``megatron.*`` keys).

The door users use: verl's Hydra config (``ppo_trainer`` + ``model_engine=hdp``), verl's
``ActorRolloutRefWorker.init_model`` (``TrainingWorker`` -> ``EngineRegistry.new`` -> the lazily
registered ``hdp`` backend -> ``HdpMegatronEngine``; model built by verl's ``vanilla_mbridge`` path
with the PyPI ``mbridge`` package from a tiny Qwen3 / Qwen3-MoE saved with ``save_pretrained``),
then ``compute_ref_log_prob``, ``compute_log_prob`` (log-probs and entropies), ``update_actor`` x2 (PPO
loss with KL and entropy bonus), ``save_checkpoint`` -> ``load_checkpoint`` -> the same step again, and HF
weight export (``get_per_tensor_param``); then (qwen3) the patches in place in the worker are the table's
(``hdp.integrations.verl.patches``).

Reference: the HF ``transformers`` model (float32) on the same checkpoint, every sample whole in one
process, and verl's own ``ppo_loss`` with ``dp_size = 1``.  Tolerances:

* float32 engine (``megatron.dtype=float32``): log-probs and entropies ``2e-5`` absolute (values O(1..10); the
  paths differ in summation order: packed zigzag chunks, ring attention, fused QKV), loss ``1e-5``
  relative, grad norm ``1e-4`` relative;
* bfloat16 reference model (the MoE case's ref, verl's default dtype): log-probs ``0.1`` absolute
  (bf16 weights and activations, 8 mantissa bits, 2 layers);
* checkpoint continuation and HF export: exact (``torch.equal``; the same kernels on the same data):
  the metrics of the repeated step and the weights after it equal the uninterrupted step's bit for bit
  (Adam's per-parameter step is restored by the engine's ``load_checkpoint``).

CPU scaffolding (verl CPU platform, local layer spec for mbridge) lives in ``hdp.integrations.verl.scaffolding``.
"""

from __future__ import annotations

import os

import pytest

from helpers.verl_worker_path import BUDGET

pytest.importorskip("verl")
pytest.importorskip("mbridge")

from helpers.dist_helper import run_distributed  # noqa: E402


# ---- the launcher's topology through verl's worker: a value that differs or is bad on one rank ----


def _topology_worker(rank: int, world: int, tmp: str, case: str) -> str:
    """verl's worker building the hdp engine with the launcher's ranks per node differing between the ranks
    (``case``); returns the error the build raised on this rank (it must raise on every rank)."""
    from hdp.integrations.verl.scaffolding.worker import actor_worker, compose, prepare_rank

    model = prepare_rank(rank, world, tmp)  # RAY_LOCAL_WORLD_SIZE = world on every rank, as verl's Ray group says
    if rank == 1:
        os.environ["RAY_LOCAL_WORLD_SIZE"] = {"differ": "1", "bad": str(10**30)}[case]
    cfg = compose(model, budget=BUDGET, records=None)
    try:
        actor_worker(cfg)
    except ValueError as exc:
        return str(exc)
    raise AssertionError(f"rank {rank}: the worker built its engine with RAY_LOCAL_WORLD_SIZE differing ({case})")


@pytest.mark.parametrize("case", ["differ", "bad"])
def test_verl_worker_names_a_ranks_per_node_that_differs_on_every_rank(case: str, tmp_path) -> None:
    """Before: a RAY_LOCAL_WORLD_SIZE of 10**30 on one rank raised an OverflowError naming no variable there and
    left its peer a gloo "Connection closed by peer"; ranks with different values planned with different node
    maps (a plan mismatch naming no variable).  Now every rank raises, naming the variable and each rank's value."""
    errors = run_distributed(_topology_worker, 2, str(tmp_path), case, timeout=300)
    value = {"differ": "'1'", "bad": f"'{10**30}'"}[case]
    for err in errors:
        assert "the launcher's topology differs across the job" in err, err
        assert f"RAY_LOCAL_WORLD_SIZE: '2' on world rank 0, {value} on world rank 1" in err, err
