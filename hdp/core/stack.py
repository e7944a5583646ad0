"""The step stack both doors build, built once: the round core, the one planner and the step sequence.

    steps = build_steps(options, StackParts(...), loss_name="loss_fn")   # the library's HdpEngine, verl's engine
    steps.core, steps.planner                                             # what the door reads afterwards

A door hands over what is its own — its groups and Megatron's, the model chunks and the optimizer it built,
the memory model of its model description, its token budgets, what a failure aborts — and the options both
doors share (:class:`~hdp.core.options.HdpOptions`); everything else is decided here, at one moment for both:
the cost model (``cost_model="auto"``: this model's shape on this device's profile), the token budgets
(`HdpOptions.token_budgets`), the calibration records' path, the static memory measure (one all-reduce over
the job, so call it on every rank) and the step's skip limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from hdp.core.memory import MemoryCalibration, static_bytes
from hdp.core.optim_state import optimizers
from hdp.core.options import HdpOptions
from hdp.core.planning import DomainPlanner, auto_cost_model
from hdp.core.rounds import RoundCore
from hdp.core.step import Steps
from hdp.groups import LayoutGroups
from hdp.packing import CostModel
from hdp.packing.model_shape import ModelShape
from hdp.packing.memory import MemoryModel

__all__ = ["StackParts", "build_steps", "resolve_cost"]


@dataclass(frozen=True, eq=False)
class StackParts:
    """What a door built and hands to the stack (nothing here is an option)."""

    groups: LayoutGroups
    """hdp's groups: the job's agreement group, the domain (with its CP rings), TP, PP, EP."""
    megatron_groups: Any
    """Megatron's process-group collection of the model (its schedules and its DDP read it)."""
    chunks: Sequence[Any]
    """The DDP-wrapped model chunks of this rank (one, or the virtual stages)."""
    optimizer: Any
    """Megatron's distributed optimizer (``None``: a forward-only engine)."""
    device: torch.device
    shape: Callable[[], ModelShape]
    """The model's shape (for ``cost_model="auto"``; called only then)."""
    pad_token_id: int
    memory_model: MemoryModel | None
    """The job's per-rank memory model (`hdp.core.memory.engine_memory_model`)."""
    memory_limit: float | None
    """Bytes per device every round stays within (``None``: the token budget only)."""
    abort_groups: Callable[[], set[dist.ProcessGroup]]
    """The groups a failure inside a phase aborts."""
    on_broken: Callable[[], None]
    """What the door releases when a phase broke off."""
    fused_logprobs: bool = False
    """Log-probs from the hidden states and the output weight (`hdp.fused_logprobs`)."""
    door_budgets: tuple[int | None, int | None] = (None, None)
    """The door's own (training, log-prob) token budgets, which a null ``max_tokens_per_rank`` defers to."""
    records_role: str | None = None
    """The role the calibration records are named by (``None``: no records, e.g. a forward-only engine)."""


def resolve_cost(options: HdpOptions, shape: Callable[[], ModelShape], device: torch.device | str) -> CostModel:
    """The cost model of ``options``: the preset or file read when the options were built, or, for
    ``cost_model="auto"``, this model's shape on the device's profile (`hdp.core.planning.auto_cost_model`)."""
    return options.with_cost(lambda: auto_cost_model(shape(), device))


def build_steps(options: HdpOptions, parts: StackParts, *, loss_name: str) -> Steps:
    """The round core, the planner and the step sequence of one engine (collective: the static memory
    measure is one all-reduce over the job).  ``loss_name`` names the door's loss in errors."""
    core = RoundCore(groups=parts.groups, megatron_groups=parts.megatron_groups, chunks=list(parts.chunks),
                     device=parts.device, pad_token_id=parts.pad_token_id, cp_algorithm=options.cp_algorithm,
                     timeout_s=options.collective_timeout_s, optimizer=parts.optimizer,
                     abort_groups=parts.abort_groups, on_broken=parts.on_broken, fused_logprobs=parts.fused_logprobs)
    train, infer = options.token_budgets(*parts.door_budgets, memory_limit=parts.memory_limit)
    groups = parts.groups
    config = options.planner_config(groups.domain.size, groups.pp_size, door_budget=train,
                                    cost=resolve_cost(options, parts.shape, parts.device),
                                    memory_model=parts.memory_model, memory_limit=parts.memory_limit)
    records = options.records_path(parts.records_role) if parts.records_role is not None else None
    planner = DomainPlanner(config, options.auto_calibrate, groups, collective_device=core.collective_device,
                            records_path=records, memory=MemoryCalibration(), infer_budget=infer)
    planner.measure_static(static_bytes(list(parts.chunks), optimizers(parts.optimizer)))  # the job's most
    return Steps(core, planner, measure_memory=options.measure_memory, loss_name=loss_name,
                 max_consecutive_skips=options.max_consecutive_skips,
                 skips_option=options.field_name("max_consecutive_skips"))
