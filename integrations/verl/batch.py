"""verl's batch into hdp and hdp's outputs back into verl's shapes.

In: a mini-batch's sample lengths (`sample_lengths`, from verl's nested ``input_ids``) and a group's rows
of it (`SampleRows`, for verl's loss function on the group's samples).  Out: verl's output dict of one
pass (`verl_outputs`: log-probs / entropies in verl's sample order on verl's collect rank, verl's loss and
metrics reduced over the groups, hdp's metrics added) and verl's metrics of the groups (`reduce_metrics`).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from hdp.dispatch import gather_outputs, gather_whole_samples
from hdp.groups import LayoutGroups
from hdp.integrations.verl import compat
from hdp.integrations.verl.data import reduce_metrics
from hdp.trainer.step import Pass

__all__ = ["verl_outputs"]


def verl_outputs(done: Pass, layout: LayoutGroups, whole_dtype: torch.dtype) -> dict[str, Any]:
    """verl's output dict of the pass ``done`` on its collect rank (TP rank 0 of the last stage, domain rank
    0): ``model_output`` (log-probs, entropies) in verl's sample order, ``loss`` and ``metrics``; ``{}``
    elsewhere.  The gathers run over the domain of TP rank 0 on the last stage only; ``whole_dtype``: the
    dtype of the samples the groups' leaders hold whole (training passes)."""
    plan, adapter = done.plan, done.adapter
    if not (layout.is_last_stage and layout.tp_rank == 0):
        return {}
    rank, group = layout.domain.domain_rank, layout.domain.domain
    if adapter.rows is not None:  # training: the groups' leaders hold their samples whole already
        full = gather_whole_samples(plan, rank, adapter.whole, group, dst=0, trailing=(2,),
                                    dtype=whole_dtype)  # S x [L_i, 2] on rank 0
    else:  # log-prob passes: every rank's chunks
        none = torch.zeros((0, 2))
        local = [adapter.outputs.get(r, none).cpu() for r in range(plan.num_rounds)]  # R x [T_r, 2]
        full = gather_outputs(plan, rank, local, group, dst=0)  # S x [L_i, 2] on rank 0
    mine = (adapter.leader_metrics, [float(x) for x in adapter.leader_losses])
    gathered: list[Any] = [None] * layout.domain.size
    dist.all_gather_object(gathered, mine, group=group)
    if rank != 0:
        return {}
    assert full is not None
    if adapter.loss_function is not None:
        metrics = reduce_metrics([m for m, _ in gathered])
        loss = [sum(sum(ls) for _, ls in gathered)]  # the groups' shares of the mini-batch loss
    else:
        metrics, loss = {}, [1.0] * plan.num_rounds  # stock verl: 1.0 per micro-batch without a loss
    for name, value in done.metrics().items():  # verl's metrics are lists; the histogram one per degree
        if name == "hdp/cp_degree_hist":
            metrics.update({f"{name}/{k}": [v] for k, v in value.items()})
        else:
            metrics[name] = [value]
    if done.train:
        metrics["hdp/nonfinite_skipped"] = [float(done.nonfinite is not None)]
    if done.outcome is not None:  # the update ran (train_batch): verl's grad_norm, the calibration's metrics
        metrics.update({k: [v] for k, v in done.outcome.calibration.items()})
        metrics["grad_norm"] = done.outcome.grad_norm
    out: dict[str, Any] = {"log_probs": compat.as_nested([x[:, 0] for x in full])}
    if adapter.entropy:
        out["entropy"] = compat.as_nested([x[:, 1] for x in full])
    return {"model_output": out, "loss": loss, "metrics": metrics}
