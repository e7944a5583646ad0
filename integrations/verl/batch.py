"""verl's batch into hdp and hdp's outputs back into verl's shapes.

In: a mini-batch's sample lengths (`sample_lengths`, from verl's nested ``input_ids``) and a group's rows
of it (`SampleRows`, for verl's loss function on the group's samples).  Out: verl's output dict of one
pass (`verl_outputs`: log-probs / entropies in verl's sample order on verl's collect rank, verl's loss (the
groups' shares added) and metrics (verl's loss on the whole mini-batch), hdp's metrics added) and verl's metric
shapes (`reduce_metrics`).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from hdp.dispatch import gather_outputs, gather_whole_samples
from hdp.groups import LayoutGroups
from hdp.integrations.verl import compat
from hdp.objects import gather_objects
from hdp.trainer.step import Pass

__all__ = ["sample_lengths", "SampleRows", "SameRows", "reduce_metrics", "verl_outputs"]


def sample_lengths(data: Any) -> list[int]:
    """L_i of every sample of verl's batch (``input_ids`` is a jagged nested tensor [S, j1])."""
    ids = data["input_ids"]
    if not getattr(ids, "is_nested", False):
        raise ValueError(
            "the hdp engine takes verl's no-padding batch (nested input_ids); "
            "set actor_rollout_ref.model.use_remove_padding=True"
        )
    return [int(x) for x in ids.offsets().diff().tolist()]


class SameRows:
    """verl's batch-wide non-tensor data (``NonTensorData``: the same value on every row — ``temperature``,
    ``dp_size``, ``global_batch_size``) at the batch sizes of the groups' sub-batches, made once per
    (field, value, size) for an engine's life rather than once per step (making one costs about 10 µs, a
    sub-batch holds about 15 and a step makes sub-batches of several sizes).  Only plain values (numbers,
    strings, booleans, None) are kept; any other (a tensor, a list) is made anew each time.  Holds at most
    ``limit`` entries (then starts over)."""

    PLAIN = (bool, int, float, str, type(None))

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self._made: dict[tuple[str, int, type, Any], Any] = {}

    def get(self, key: str, value: Any, n: int) -> Any:
        """The ``NonTensorData`` of ``value`` with batch size [n] (for field ``key``)."""
        from tensordict import NonTensorData

        if type(value) not in self.PLAIN:
            return NonTensorData(data=value, batch_size=torch.Size([n]))
        slot = (key, n, type(value), value)
        made = self._made.get(slot)
        if made is None:
            if len(self._made) >= self.limit:
                self._made.clear()
            made = self._made[slot] = NonTensorData(data=value, batch_size=torch.Size([n]))
        return made


class SampleRows:
    """The rows of one verl batch for many sample subsets (a group's samples, round after round).

    `select` returns what ``verl.utils.tensordict_utils.index_select_tensor_dict`` does — every field
    indexed by the samples, a nested one rebuilt from its selected samples — with less work per call: the
    batch's fields are sorted once per batch (plain tensors, nested tensors unbound once — verl's function
    unbinds every nested field of the whole batch at each call —, batch-wide non-tensor data, anything
    else), each plain tensor is one ``index_select``, a nested field of 1-d samples is one concatenation
    viewed as a jagged tensor, the batch-wide non-tensor data (verl's settings such as ``temperature``,
    ``dp_size``: the same value on every row) is made once per value and size (`SameRows`), and the sub-batch is built
    once, without the constructor's per-value checks (`compat.tensordict_of`).  ``unbound``: fields
    already unbound by the caller (``input_ids``); ``same``: the engine's `SameRows`.
    """

    def __init__(self, data: Any, unbound: dict[str, Sequence[torch.Tensor]] | None = None,
                 same: SameRows | None = None) -> None:
        from tensordict import NonTensorData

        unbound = unbound or {}
        self._dense: dict[str, torch.Tensor] = {}  # key -> [S, ...]
        self._nested: dict[str, tuple[Sequence[torch.Tensor], int]] = {}  # key -> (S x [..., L_i, ...], ragged dim)
        self._same: dict[str, Any] = {}  # key -> the batch-wide value
        other: list[str] = []  # per-sample non-tensor stacks and anything else: TensorDict indexing
        for key in data.keys():
            value = data.get(key)
            if isinstance(value, torch.Tensor) and value.is_nested:
                per_sample = unbound[key] if key in unbound else value.unbind()
                self._nested[key] = (per_sample, getattr(value, "_ragged_idx", value.dim() - 1))
            elif isinstance(value, torch.Tensor):
                self._dense[key] = value
            elif isinstance(value, NonTensorData):
                self._same[key] = value.data
            else:
                other.append(key)
        self._other = data.select(*other) if other else None
        self._same_rows = same or SameRows()

    def select(self, samples: Sequence[int]) -> Any:
        """The TensorDict of ``samples`` (caller indices, in that order)."""
        from verl.utils.tensordict_utils import nested_tensor_from_tensor_list

        n = len(samples)
        index = torch.tensor(list(samples), dtype=torch.int64)  # [n]
        source: dict[str, Any] = {k: v.index_select(0, index.to(v.device)) for k, v in self._dense.items()}
        for key, (per_sample, ragged) in self._nested.items():
            rows = [per_sample[i] for i in samples]
            if rows[0].dim() == 1:  # what as_nested_tensor makes of them (verl's path for 1-d samples)
                source[key] = compat.nested_from_flat(torch.cat(rows), [r.shape[0] for r in rows])
            else:
                source[key] = nested_tensor_from_tensor_list(rows, ragged_idx=ragged)
        for key, value in self._same.items():  # every row holds the same value
            source[key] = self._same_rows.get(key, value, n)
        sub = compat.tensordict_of(source, n, None)  # no device, as verl's selection
        if self._other is not None:
            sub.update(self._other[index])
        return sub


def reduce_metrics(per_rank: Sequence[Sequence[tuple[dict[str, Any], float]]]) -> dict[str, Any]:
    """verl metrics of one step from every rank's group-leader metric dicts.

    ``per_rank[r]`` holds (metrics, weight) of the groups rank r led (one per round it led); the weight is
    the group's response tokens.  verl's ``Metric`` values: SUM metrics (``actor/pg_loss``: each group's
    loss is its share of the mini-batch's, computed with ``dp_size = 1``) add up over groups, which is
    verl's "mean over DP ranks of per-rank sums" of a stock run; MEAN metrics average over groups weighted
    by their response tokens, so a metric that is a mean over tokens (``actor/ppo_kl``, ``actor/pg_clipfrac``,
    ``critic/vf_clipfrac``, ``critic/vpred_mean``) is the mini-batch's own, whatever the plan (stock verl
    averages its micro-batches' values unweighted: docs/verl.md, "Metrics"); MIN/MAX reduce.  Plain numbers
    (constants such as ``kl_coef``) are averaged alike.  `verl_outputs` passes it one entry, the metrics of verl's
    loss on the whole mini-batch (`hdp.integrations.verl.loss.VerlLoss.whole_metrics`), for verl's shapes.  The shapes are those of verl's own engines
    (``postprocess_batch_func`` through ``append_to_dict``): one ``Metric`` per name for Metric-valued
    metrics, a list of floats for plain ones — the worker all-gathers them over its (one-rank) DP group and
    the trainer reduces.
    """
    from verl.utils.metric.utils import AggregationType, Metric

    values: dict[str, list[tuple[float, float]]] = {}  # name -> (value, weight) per group
    kinds: dict[str, Any] = {}
    for dicts in per_rank:
        for d, weight in dicts:
            for name, m in d.items():
                if isinstance(m, Metric):
                    kinds[name] = m.aggregation
                    value = float(Metric._aggregate(m.values, m.aggregation))
                else:
                    kinds.setdefault(name, None)
                    value = float(m)
                values.setdefault(name, []).append((value, float(weight)))
    out: dict[str, Any] = {}
    for name, pairs in values.items():
        kind, vals = kinds[name], [v for v, _ in pairs]
        if kind is AggregationType.SUM:
            out[name] = Metric(AggregationType.SUM, sum(vals))
        elif kind is AggregationType.MIN:
            out[name] = Metric(AggregationType.MIN, min(vals))
        elif kind is AggregationType.MAX:
            out[name] = Metric(AggregationType.MAX, max(vals))
        else:
            total = sum(w for _, w in pairs)
            mean = (sum(v * w for v, w in pairs) / total) if total > 0 else sum(vals) / len(vals)
            out[name] = Metric(AggregationType.MEAN, mean) if kind is AggregationType.MEAN else [mean]
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
    gathered = gather_objects([float(x) for x in adapter.leader_losses], group, dst=0)  # every rank's losses on rank 0
    if rank != 0:
        return {}
    assert full is not None and gathered is not None
    if adapter.loss_function is not None:
        # verl's metrics: its loss function on the mini-batch whole (the mini-batch's own values), verl's shapes
        metrics = reduce_metrics([[(adapter.whole_metrics(full), 1.0)]])
        loss = [sum(sum(ls) for ls in gathered)]  # the groups' shares of the mini-batch loss
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
