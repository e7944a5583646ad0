"""An engine's training state on and off disk: checkpoint formats, the distributed optimizer's shards,
and the Megatron-core 0.16.1 fixes they need on CPU (Adam's per-parameter ``step``, a fresh
optimizer's state).  Used by :class:`hdp.trainer.engine.HdpEngine` and the verl engine.
"""

from __future__ import annotations

import enum
import importlib.util
import multiprocessing
from typing import Any, Mapping

import torch

__all__ = ["CheckpointFormat", "checkpoint_format", "dist_checkpoint_problem", "to_host", "to_device",
           "optimizers", "ensure_optimizer_state", "restore_adam_steps", "shard_state", "load_shard_state"]


def to_host(obj: Any) -> Any:
    """A deep copy of ``obj`` with every tensor copied to host memory."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return type(obj)((k, to_host(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_host(v) for v in obj)
    return obj


def to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor moved to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return type(obj)((k, to_device(v, device)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


class CheckpointFormat(str, enum.Enum):
    """On-disk format of :meth:`HdpEngine.save_checkpoint`."""

    AUTO = "auto"
    """``dist`` when every rank can write it (psutil installed, non-daemonic process), else ``per-rank``."""
    DIST = "dist"
    """Megatron distributed checkpointing (``megatron.core.dist_checkpointing``, torch_dist)."""
    PER_RANK = "per-rank"
    """One ``rank_{r}.pt`` per rank (model, optimizer common state and shard); same layout to load."""


def checkpoint_format(value: CheckpointFormat | str) -> CheckpointFormat:
    try:
        fmt = CheckpointFormat(value)
    except ValueError as exc:
        raise ValueError(f"format={value!r}: choose one of {[f.value for f in CheckpointFormat]}") from exc
    return fmt


def dist_checkpoint_problem() -> str | None:
    """Why this process cannot write a Megatron distributed checkpoint, or ``None``."""
    if importlib.util.find_spec("psutil") is None:
        return "megatron-core's checkpoint writer imports psutil, which is not installed (pip install psutil)"
    if multiprocessing.current_process().daemon:
        return (
            "megatron-core's checkpoint writer starts worker processes, which a daemonic process "
            "(this rank) may not do; start the ranks as non-daemonic processes"
        )
    return None


def optimizers(optimizer: Any) -> list[Any]:
    """The distributed optimizers inside Megatron's (possibly chained) optimizer."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def ensure_optimizer_state(optimizer: Any) -> None:
    """Allocate the inner torch optimizer's state where no step has created it yet.

    megatron-core 0.16.1 ``DistributedOptimizer.state_dict`` (called by ``sharded_state_dict``,
    also when loading) reads the ``step`` of every state entry when neither Apex nor
    TransformerEngine is installed (the CPU case) and asserts that there is exactly one, so it
    fails on an optimizer that has not stepped yet (a fresh engine about to load).  Zero moments
    and ``step = 0`` are what torch Adam/AdamW start from anyway, and loading overwrites them.
    """
    for opt in optimizers(optimizer):
        inner = opt.optimizer
        params = [p for group in inner.param_groups for p in group["params"]]
        if all(len(inner.state[p]) for p in params):
            continue
        opt.init_state_fn(inner, opt.config)  # Megatron's own allocation of exp_avg / exp_avg_sq
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            for p in params:
                inner.state[p].setdefault("step", torch.tensor(0.0, dtype=torch.float32))


def restore_adam_steps(optimizer: Any, loaded: Mapping[Any, Any]) -> None:
    """Set the torch Adam ``step`` of every state entry to the loaded step, one tensor per entry.

    megatron-core 0.16.1, no Apex/TE (the CPU case), ``dp_reshardable``: ``load_state_dict``
    first sets every entry's ``step`` to the step saved in the param groups (one tensor shared by
    all entries), then ``load_parameter_state_from_dp_reshardable`` copies into it the *local
    placeholder* ``step`` captured when the loading state dict was built (``LocalNonpersistentObject``,
    the fresh optimizer's 0).  torch's AdamW also increments ``step`` in place, so a shared tensor
    would advance once per parameter.  ``loaded`` is the optimizer part of the loaded state dict.
    """
    subs = optimizers(optimizer)
    states = [loaded] if len(subs) == 1 else [v for _, v in sorted(loaded.items())]
    for opt, st in zip(subs, states):
        steps = {g["step"] for g in st["optimizer"]["param_groups"] if g.get("step") is not None}
        if len(steps) != 1:
            continue  # Apex/TE optimizers keep the step in their param groups
        step = float(steps.pop())
        for entry in opt.optimizer.state.values():
            if "step" in entry:
                entry["step"] = torch.tensor(step, dtype=entry["step"].dtype, device=entry["step"].device)


def shard_state(opt: Any) -> dict[str, Any]:
    """This rank's optimizer shard: the inner torch optimizer state (exp_avg, exp_avg_sq, step) and,
    for low-precision models, the fp32 main parameters (for fp32 models they are views of the
    model parameters, saved with the model)."""
    return {
        "inner": opt.optimizer.state_dict(),
        "main_params": [[t.detach().clone() for t in g] for g in getattr(opt, "shard_fp32_from_float16_groups", [])],
    }


def load_shard_state(opt: Any, shard: Mapping[str, Any]) -> None:
    opt.optimizer.load_state_dict(shard["inner"])
    with torch.no_grad():
        for group, saved in zip(getattr(opt, "shard_fp32_from_float16_groups", []), shard["main_params"]):
            for t, v in zip(group, saved):
                t.copy_(v)
