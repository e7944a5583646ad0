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
from hdp.trainer.step import Pass

__all__ = ["sample_lengths", "SampleRows", "reduce_metrics", "verl_outputs"]


def sample_lengths(data: Any) -> list[int]:
    """L_i of every sample of verl's batch (``input_ids`` is a jagged nested tensor [S, j1])."""
    ids = data["input_ids"]
    if not getattr(ids, "is_nested", False):
        raise ValueError(
            "the hdp engine takes verl's no-padding batch (nested input_ids); "
            "set actor_rollout_ref.model.use_remove_padding=True"
        )
    return [int(x) for x in ids.offsets().diff().tolist()]


class SampleRows:
    """The rows of one verl batch for many sample subsets (a group's samples, round after round).

    `select` returns what ``verl.utils.tensordict_utils.index_select_tensor_dict`` does — every field
    indexed by the samples, a nested one rebuilt from its selected samples — with less work per call:
    each nested field is unbound once per batch (verl's function unbinds every nested field of the
    whole batch at each call), the tensors and per-sample non-tensor stacks are indexed in one
    TensorDict indexing, and the batch-wide non-tensor data (the same value on every row: verl's
    settings such as ``temperature``, ``dp_size``) is sliced once per subset size.
    """

    def __init__(self, data: Any) -> None:
        import torch
        from tensordict import NonTensorData

        nested = [k for k, v in data.items() if isinstance(v, torch.Tensor) and v.is_nested]
        same = [k for k, v in data.items() if isinstance(v, NonTensorData)]
        self._rows = data.exclude(*nested, *same)  # tensors and per-sample non-tensor stacks
        self._same = data.select(*same)
        self._same_of_size: dict[int, Any] = {}
        self._nested = [(k, data[k].unbind(), getattr(data[k], "_ragged_idx", data[k].dim() - 1)) for k in nested]

    def select(self, samples: Sequence[int]) -> Any:
        """The TensorDict of ``samples`` (caller indices, in that order)."""
        import torch
        from verl.utils.tensordict_utils import nested_tensor_from_tensor_list

        n = len(samples)
        sub = self._rows[torch.tensor(list(samples), dtype=torch.int64)]
        same = self._same_of_size.get(n)
        if same is None:
            same = self._same_of_size[n] = self._same[:n]  # every row holds the same value
        sub.update(same)
        for key, per_sample, ragged in self._nested:
            sub[key] = nested_tensor_from_tensor_list([per_sample[i] for i in samples], ragged_idx=ragged)
        return sub


def reduce_metrics(per_rank: Sequence[Sequence[dict[str, Any]]]) -> dict[str, Any]:
    """verl metrics of one step from every rank's group-leader metric dicts.

    ``per_rank[r]`` holds the metric dicts of the groups rank r led (one per round it led).  verl's
    ``Metric`` values: SUM metrics (``actor/pg_loss``: each group's loss is its share of the
    mini-batch's, computed with ``dp_size = 1``) add up over groups, which is verl's "mean over DP
    ranks of per-rank sums" of a stock run; MEAN metrics
    average over groups (verl: over micro-batches and DP ranks); MIN/MAX reduce.  Plain numbers are
    averaged.  The shapes are those of verl's own engines (``postprocess_batch_func`` through
    ``append_to_dict``): one ``Metric`` per name for Metric-valued metrics, a list of floats for
    plain ones — the worker all-gathers them over its (one-rank) DP group and the trainer reduces.
    """
    from verl.utils.metric.utils import AggregationType, Metric

    values: dict[str, list[float]] = {}
    kinds: dict[str, Any] = {}
    for dicts in per_rank:
        for d in dicts:
            for name, m in d.items():
                if isinstance(m, Metric):
                    kinds[name] = m.aggregation
                    values.setdefault(name, []).append(float(Metric._aggregate(m.values, m.aggregation)))
                else:
                    kinds.setdefault(name, None)
                    values.setdefault(name, []).append(float(m))
    out: dict[str, Any] = {}
    for name, vals in values.items():
        kind = kinds[name]
        if kind is AggregationType.SUM:
            out[name] = Metric(AggregationType.SUM, sum(vals))
        elif kind is AggregationType.MIN:
            out[name] = Metric(AggregationType.MIN, min(vals))
        elif kind is AggregationType.MAX:
            out[name] = Metric(AggregationType.MAX, max(vals))
        elif kind is AggregationType.MEAN:
            out[name] = Metric(AggregationType.MEAN, sum(vals) / len(vals))
        else:
            out[name] = [sum(vals) / len(vals)]
    return out


def verl_outputs(done: Pass, layout: LayoutGroups, whole_dtype: torch.dtype) -> dict[str, Any]:
    """verl's output dict of the pass ``done`` on its collect rank (TP rank 0 of the last stage, domain rank
    0): ``model_output`` (log-probs and entropies, or a value model's values) in verl's sample order, ``loss`` and ``metrics``; ``{}``
    elsewhere.  The gathers run over the domain of TP rank 0 on the last stage only; ``whole_dtype``: the
    dtype of the samples the groups' leaders hold whole (training passes)."""
    plan, adapter = done.plan, done.adapter
    if not (layout.is_last_stage and layout.tp_rank == 0):
        return {}
    rank, group = layout.domain.domain_rank, layout.domain.domain
    fields = adapter.fields()  # verl's output names of the adapter's columns
    width = adapter.width
    if adapter.rows is not None:  # training: the groups' leaders hold their samples whole already
        full = gather_whole_samples(plan, rank, adapter.whole, group, dst=0, trailing=(width,),
                                    dtype=whole_dtype)  # S x [L_i, C] on rank 0
    else:  # log-prob / value passes: every rank's chunks
        none = torch.zeros((0, width))
        local = [adapter.outputs.get(r, none).cpu() for r in range(plan.num_rounds)]  # R x [T_r, C]
        full = gather_outputs(plan, rank, local, group, dst=0)  # S x [L_i, C] on rank 0
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
    flat = torch.cat(full) if full else torch.zeros((0, width))  # [Σ L_i, C] in verl's sample order
    lengths = [x.shape[0] for x in full]  # [S]
    out = {name: compat.nested_from_flat(flat[:, col], lengths) for name, col in fields.items()}
    return {"model_output": out, "loss": loss, "metrics": metrics}
