"""TransformerEngine's grouped experts without TransformerEngine: a stand-in for its grouped linear.

Megatron's ``TEGroupedMLP`` builds fc1 and fc2 from TransformerEngine's ``GroupedLinear``
(``TEColumnParallelGroupedLinear`` / ``TERowParallelGroupedLinear``): one module per projection
holding ``weight0`` … ``weight{L-1}``, each ``[out, in]`` as ``nn.Linear`` has it.  That is the expert
layout mbridge and Megatron-Bridge build on GPUs and map HF weights to (``mlp.experts.linear_fc1.
weight{i}`` = [gate; up] of expert i, ``linear_fc2.weight{i}`` = its down projection).

Without TransformerEngine (CPU), :class:`ColumnGroupedLinear` and :class:`RowGroupedLinear` hold the
same parameters under the same names and compute the same ``y_l = x_l W_lᵀ`` through hdp's grouped
GEMM seam (:func:`hdp.kernels.grouped_gemm.grouped_linear`); their checkpoint entries are TE's
(per-expert sharded tensors on the expert axis, without TE's fp8 ``_extra_state``).  Expert TP 1,
no bias, no fp8 (refused at construction).  :func:`te_grouped_experts_spec` gives a MoE layer
spec whose experts are ``TEGroupedMLP`` over them (TransformerEngine's own classes where it imports).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from hdp.kernels.grouped_gemm import grouped_linear
from hdp.megatron_compat.names import (
    MLPSubmodules,
    ModuleSpec,
    TEColumnParallelGroupedLinear,
    TEGroupedMLP,
    TERowParallelGroupedLinear,
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
    replace_prefix_for_sharding,
    tensor_parallel,
)

__all__ = ["GroupedLinearStandIn", "ColumnGroupedLinear", "RowGroupedLinear", "te_grouped_experts_spec",
           "with_te_grouped_experts"]


class GroupedLinearStandIn(torch.nn.Module):
    """TransformerEngine ``GroupedLinear``'s parameters (``weight{i}`` [out, in]) and forward
    ``(x [R, in], m_splits) -> (y [R, out], None)``, bias-free, expert TP 1, through hdp's seam."""

    _tp_axis = 0

    def __init__(
        self,
        num_gemms: int,
        input_size: int,
        output_size: int,
        *,
        config: Any,
        init_method: Callable[[torch.Tensor], Any],
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool = False,
        tp_comm_buffer_name: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__()
        del skip_bias_add, tp_comm_buffer_name
        where = f"{type(self).__name__} (TEGroupedMLP without TransformerEngine)"
        if bias:
            raise ValueError(f"{where}: add_bias_linear=True is not supported; set add_bias_linear=False")
        if not is_expert:
            raise ValueError(f"{where}: builds expert projections only (is_expert=True)")
        if config.fp8 or config.fp4:
            raise ValueError(f"{where}: fp8/fp4 needs TransformerEngine")
        etp = pg_collection.expt_tp.size() if pg_collection is not None else (config.expert_tensor_parallel_size or 1)
        if etp != 1:
            raise ValueError(f"{where}: expert_tensor_parallel_size={etp}: needs 1")
        self.num_gemms = num_gemms
        self.in_features, self.out_features = input_size, output_size
        self._pg_collection = pg_collection
        expert_parallel = config.expert_model_parallel_size > 1
        tracker = tensor_parallel.get_cuda_rng_tracker()
        for i in range(num_gemms):
            # on torch's default device (the module moves with its model, as hdp's builders do)
            w = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
            if config.perform_initialization:
                with torch.no_grad():
                    if tracker.is_initialized():
                        with tracker.fork(tensor_parallel.random.get_expert_parallel_rng_tracker_name()):
                            init_method(w)
                    else:
                        init_method(w)
            setattr(w, "allreduce", not expert_parallel)  # as TE's wrapper: expert grads reduce over expert DP
            self.register_parameter(f"weight{i}", w)

    def forward(self, x: torch.Tensor, m_splits: Any) -> tuple[torch.Tensor, None]:
        """``y`` [R, out] for ``x`` [R, in] whose rows are ``m_splits[l]`` rows of expert l, in order."""
        sizes = m_splits.tolist() if torch.is_tensor(m_splits) else list(m_splits)
        weights = [getattr(self, f"weight{i}") for i in range(self.num_gemms)]
        return grouped_linear(x, weights, sizes), None

    def backward_dw(self) -> None:
        """TE's delayed weight-gradient hook (``TEGroupedMLP.backward_dw``): nothing is delayed here."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """TE's grouped entries: ``{prefix}weight{i}`` as expert i's sharded tensor on the expert axis
        (Megatron's ``TEGroupedLinear._sharded_state_dict_grouped``, without fp8 extra state)."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        pg = self._pg_collection
        ep_size, ep_rank = (pg.ep.size(), pg.ep.rank()) if pg is not None else (1, 0)
        num_global = ep_size * self.num_gemms
        ep_axis = len(sharded_offsets)
        out: dict[str, Any] = {}
        for i in range(self.num_gemms):
            glob = ep_rank * self.num_gemms + i
            sub = make_sharded_tensors_for_checkpoint(
                {f"{i}.weight": getattr(self, f"weight{i}")}, "", {f"{i}.weight": self._tp_axis},
                (*sharded_offsets, (ep_axis, glob, num_global)),
                tp_group=pg.expt_tp if pg is not None else None, dp_cp_group=metadata["dp_cp_group"],
            )
            replace_prefix_for_sharding(sub, f"{i}.", prefix)
            sh = sub[f"{i}.weight"]
            replica = sh.replica_id
            sh.replica_id = (*replica[:2], pg.expt_dp.rank() if pg is not None else 0)
            out[f"{prefix}weight{i}"] = sh
        return out


class ColumnGroupedLinear(GroupedLinearStandIn):
    """Stands in for ``TEColumnParallelGroupedLinear`` (expert fc1)."""

    _tp_axis = 0


class RowGroupedLinear(GroupedLinearStandIn):
    """Stands in for ``TERowParallelGroupedLinear`` (expert fc2)."""

    _tp_axis = 1


def te_grouped_experts_spec() -> ModuleSpec:
    """``TEGroupedMLP`` experts over TransformerEngine's grouped linears where TE imports, else over
    :class:`ColumnGroupedLinear` / :class:`RowGroupedLinear` (same parameter names and math)."""
    if TEColumnParallelGroupedLinear is None or TERowParallelGroupedLinear is None:
        fc1, fc2 = ColumnGroupedLinear, RowGroupedLinear
    else:
        fc1, fc2 = TEColumnParallelGroupedLinear, TERowParallelGroupedLinear
    return ModuleSpec(module=TEGroupedMLP, submodules=MLPSubmodules(linear_fc1=fc1, linear_fc2=fc2))


def with_te_grouped_experts(layer_spec: Any) -> Any:
    """A copy of a transformer-layer spec whose MoE experts are :func:`te_grouped_experts_spec`'s (a spec
    without MoE MLP is returned unchanged)."""
    mlp = layer_spec.submodules.mlp
    experts = getattr(getattr(mlp, "submodules", None), "experts", None)
    if experts is None:
        return layer_spec
    new_mlp = dataclasses.replace(mlp, submodules=dataclasses.replace(mlp.submodules, experts=te_grouped_experts_spec()))
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(layer_spec.submodules, mlp=new_mlp))
