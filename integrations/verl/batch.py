"""verl's batch into hdp and hdp's outputs back into verl's shapes.

In: a mini-batch's sample lengths (`sample_lengths`, from verl's nested ``input_ids``) and a group's rows
of it (`SampleRows`, for verl's loss function on the group's samples).  Out: verl's output dict of one
pass (`verl_outputs`: log-probs / entropies in verl's sample order on verl's collect rank, verl's loss (the
groups' shares added) and metrics (verl's loss on the whole mini-batch), hdp's metrics added) in the shapes of
verl's own engines (`metric_shapes`).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from hdp.dispatch import gather_outputs, gather_whole_samples
from hdp.groups import LayoutGroups
from hdp.integrations.verl import compat
from hdp.objects import gather_objects
from hdp.core.step import Pass

__all__ = ["sample_lengths", "SampleRows", "SameRows", "metric_shapes", "verl_outputs"]


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


def metric_shapes(metrics: dict[str, Any]) -> dict[str, Any]:
    """verl's metrics of one training pass (``metrics``: verl's loss function's metrics on the whole mini-batch,
    `hdp.integrations.verl.loss.VerlLoss.whole_metrics`) in the shapes of verl's own engines
    (``postprocess_batch_func`` through ``append_to_dict``): one ``Metric`` per name, of the aggregation verl's
    loss gave it, for Metric-valued metrics; a one-element list for plain numbers (``kl_coef``,
    ``critic/vf_clipfrac``).  The worker all-gathers them over its (one-rank) DP group and the trainer reduces:
    every metric reaches verl's logger as the mini-batch's own value (docs/verl.md, "Metrics")."""
    from verl.utils.metric.utils import Metric

    out: dict[str, Any] = {}
    for name, m in metrics.items():
        if isinstance(m, Metric):
            out[name] = Metric(m.aggregation, float(Metric._aggregate(m.values, m.aggregation)))
        else:
            out[name] = [float(m)]
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
        metrics = metric_shapes(adapter.whole_metrics(full))
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
