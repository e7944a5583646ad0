"""Stock verl's mini-batches, formed for an hdp engine: switching the engine keeps the training trajectory.

An hdp engine tells verl its data-parallel size is 1 (every rank of the domain receives the whole
batch; hdp decides who runs what).  Stock verl at the same world size has D = world / (TP × PP)
data-parallel ranks (CP 1), and D decides which samples train together, in two places:

1. **the trainer's** ``_balance_batch`` (verl 0.9.1 ``trainer/ppo/v1/trainer_base.py`` and the legacy
   ``trainer/ppo/ray_trainer.py``, which the separate-, fully-async and one-step-off trainers inherit)
   partitions the batch into D equal-count parts of balanced workload (Karmarkar–Karp on verl's
   ``calculate_workload``) and orders it part after part; verl's dispatch hands part r (a contiguous
   slice) to DP rank r;
2. **each DP rank's** ``TrainingWorker.train_mini_batch`` (``workers/engine_workers.py``) cuts its part
   into mini-batches of ``mini_batch_size / D`` samples with ``tensordict_utils.make_iterator`` (a
   DataLoader over the part: seed ``seed + r``, the actor's ``dataloader_kwargs`` such as ``shuffle``,
   ``ppo_epochs`` passes).  The global mini-batch k is the union of every rank's k-th.

With a DP size of 1 both collapse (one part in the batch's order, contiguous mini-batches: all
responses of a prompt together, their lengths correlated).  So for an hdp engine the trainer balances
for D parts (:func:`trainer_dp_size`; ``patches.balance_batch_for_stock_dp`` applies it) and the
worker's loop iterates :func:`stock_minibatch_indices` (``patches.own_mini_batch_loop``): every
mini-batch holds the samples stock verl's does, as the concatenation of the D ranks' shares.  Within a
mini-batch the order does not change the step beyond round-off (the loss is a sum over samples with
global normalisers).  Where stock verl cannot split the batch (D does not divide the mini-batch or the
batch: its worker asserts), :func:`stock_minibatch_indices` returns None and the loop keeps verl's
contiguous mini-batches.

Pure functions: no verl import (verl's ``make_iterator`` is passed in).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch

__all__ = ["stock_dp_size", "trainer_dp_size", "stock_minibatch_indices", "stock_minibatches"]

HDP_STRATEGY = "hdp"


def stock_dp_size(world: int, tp: int = 1, pp: int = 1) -> int:
    """Stock verl's data-parallel size on ``world`` ranks under TP × PP with CP 1 (hdp's domain size)."""
    if world < 1 or tp < 1 or pp < 1 or world % (tp * pp):
        raise ValueError(f"world {world} is not a multiple of TP {tp} x PP {pp}")
    return world // (tp * pp)


def _select(node: Any, key: str, default: Any) -> Any:
    value = node.get(key, default) if hasattr(node, "get") else getattr(node, key, default)
    return default if value is None else value


def trainer_dp_size(config: Any, world: int, role: str = "actor") -> int | None:
    """The DP size verl's trainer must balance the batch for when ``role``'s engine is hdp's (its
    ``strategy`` is ``hdp``): stock's, :func:`stock_dp_size` from the role's ``megatron`` TP and PP (1
    on verl's FSDP-shaped configs) on the ``world`` ranks of its worker group; None for any other engine."""
    node = config.actor_rollout_ref.actor if role == "actor" else config.get(role)
    if node is None or _select(node, "strategy", None) != HDP_STRATEGY:
        return None
    mcore = _select(node, "megatron", {})
    tp = int(_select(mcore, "tensor_model_parallel_size", 1))
    pp = int(_select(mcore, "pipeline_model_parallel_size", 1))
    return stock_dp_size(world, tp, pp)


def stock_minibatch_indices(batch_size: int, dp_size: int, mini_batch_size: int, epochs: int, seed: int | None,
                            dataloader_kwargs: dict[str, Any] | None,
                            make_iterator: Callable[..., Iterator[Any]]) -> list[torch.Tensor] | None:
    """The sample indices of every mini-batch (all epochs, in order) stock verl trains on ``dp_size``
    ranks; None where stock verl cannot split the batch (``dp_size`` 1, or it divides neither
    ``mini_batch_size`` nor ``batch_size``, or the parts do not split into whole mini-batches).

    ``make_iterator``: verl's ``tensordict_utils.make_iterator`` (run here on each rank's part, as that
    rank would: seed ``seed + r``, the same ``dataloader_kwargs`` and ``epochs``).  ``seed``: the seed
    verl's loop passes on DP rank 0.  Each index tensor is rank 0's share, then rank 1's, ...
    """
    if dp_size <= 1 or batch_size % dp_size or mini_batch_size % dp_size:
        return None
    part, local = batch_size // dp_size, mini_batch_size // dp_size
    if part % local:
        return None
    from tensordict import TensorDict

    ranks = []
    for r in range(dp_size):
        rows = TensorDict({"i": torch.arange(r * part, (r + 1) * part)}, batch_size=[part])
        ranks.append(make_iterator(rows, mini_batch_size=local, epochs=epochs,
                                   seed=None if seed is None else seed + r, dataloader_kwargs=dataloader_kwargs))
    return [torch.cat([share["i"] for share in shares]) for shares in zip(*ranks)]


def stock_minibatches(data: Any, indices: list[torch.Tensor], index_select: Callable[[Any, torch.Tensor], Any]) -> Iterator[Any]:
    """The mini-batches of ``data`` at ``indices`` (:func:`stock_minibatch_indices`), each selected when
    reached (``index_select``: verl's ``tensordict_utils.index_select_tensor_dict``, as verl's loop)."""
    for idx in indices:
        yield index_select(data, idx)
