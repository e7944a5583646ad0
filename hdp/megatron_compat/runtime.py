"""Megatron's parallel state for hdp: initialisation with explicit groups, and everything an engine
must release when it closes (DDP's grad-accumulator cycle, leftover group globals, the checkpoint
writer's helper process)."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from hdp.megatron_compat.cpu_shim import CpuShim, apply_cpu_shim
from hdp.megatron_compat.names import ProcessGroupCollection, parallel_state, tensor_parallel

__all__ = ["MegatronRuntime", "initialize_megatron", "checkpoint_writers_die_with_parent", "release_ddp",
           "stop_checkpoint_writer", "megatron_groups", "manual_seed", "destroy_megatron", "default_group"]

logger = logging.getLogger(__name__)



_GENERATION = [0]  # bumped by every initialize_megatron; a runtime tears down only its own state


@dataclass(eq=False)
class MegatronRuntime:
    """What :func:`initialize_megatron` set up: the explicit process groups and the CPU shim hold.

    :meth:`close` releases the shim hold and, if no later :func:`initialize_megatron` replaced
    this one, destroys Megatron's parallel state.
    """

    groups: ProcessGroupCollection
    """Megatron's process groups of this rank, named explicitly (pass them down; never ``None``)."""
    shim: CpuShim | None
    """The CPU shim hold (``None`` on an accelerator)."""
    generation: int
    """Which initialisation this is (internal)."""

    @property
    def current(self) -> bool:
        """Whether Megatron's parallel state is still this initialisation's (no later
        :func:`initialize_megatron` replaced it and nothing destroyed it)."""
        return self.generation == _GENERATION[0] and parallel_state.model_parallel_is_initialized()

    def close(self) -> None:
        """Release the CPU shim hold and this initialisation's Megatron state (idempotent)."""
        if self.generation == _GENERATION[0] and parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
            _forget_parallel_state_groups()
        if self.shim is not None:
            self.shim.undo()


def _forget_parallel_state_groups() -> None:
    """Drop the process groups ``destroy_model_parallel`` leaves in Megatron's module globals.

    megatron-core 0.16.1's ``destroy_model_parallel`` does not reset
    ``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP`` and its gloo twin, so those groups (and their
    transport threads) outlive the parallel state.  Every module-level global of ``parallel_state``
    that still holds a process group is set to ``None``.  Can go when Megatron resets them itself.
    """
    for name, value in list(vars(parallel_state).items()):
        if name.startswith("_") and name.isupper() and isinstance(value, torch.distributed.ProcessGroup):
            setattr(parallel_state, name, None)


def initialize_megatron(
    *,
    device: torch.device | str,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int = 1,
    seed: int = 1234,
    collective_timeout_s: float | None = None,
) -> MegatronRuntime:
    """Initialise Megatron's parallel state over the world: TP × PP × DP, CP = 1.

    hdp supplies context parallelism itself, so Megatron sees data parallelism over the domain
    (the DP×CP ranks of one TP rank and PP stage), plus expert parallelism carved from the
    TP × DP ranks of each stage.  ``torch.distributed`` must be initialised.  ``device`` is
    required: the CPU shim is taken for ``cpu`` only.  Seeds Megatron's RNG tracker.  Returns the
    :class:`MegatronRuntime` (explicit groups, shim hold).  ``collective_timeout_s`` bounds every
    op on the groups Megatron creates (its ``distributed_timeout_minutes``; default 30 min).
    """
    if not torch.distributed.is_initialized():
        raise ValueError("initialize_megatron: torch.distributed is not initialised; call init_process_group first")
    world = torch.distributed.get_world_size()
    tp, pp, ep = tensor_model_parallel_size, pipeline_model_parallel_size, expert_model_parallel_size
    for name, value in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp),
                        ("expert_model_parallel_size", ep), ("expert_tensor_parallel_size", expert_tensor_parallel_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"initialize_megatron: {name}={value!r}: pass a positive integer")
    if world % (tp * pp):
        raise ValueError(f"initialize_megatron: TP {tp} x PP {pp} must divide the world size {world}")
    if (world // pp) % (ep * expert_tensor_parallel_size):
        raise ValueError(
            f"initialize_megatron: expert_model_parallel_size={ep} x expert_tensor_parallel_size="
            f"{expert_tensor_parallel_size} must divide the {world // pp} ranks of a pipeline stage"
        )
    shim = apply_cpu_shim(device)
    try:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
            context_parallel_size=1,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=expert_tensor_parallel_size,
            **({} if collective_timeout_s is None else {"distributed_timeout_minutes": collective_timeout_s / 60.0}),
        )
        manual_seed(seed)
        groups = ProcessGroupCollection.use_mpu_process_groups()
    except BaseException:
        if shim is not None:
            shim.undo()
        raise
    _GENERATION[0] += 1
    return MegatronRuntime(groups=groups, shim=shim, generation=_GENERATION[0])


def checkpoint_writers_die_with_parent() -> None:
    """Make the helper process of Megatron's checkpoint writer die with this rank (Linux).

    megatron-core 0.16.1's ``FileSystemWriterAsync`` collects write results through a queue of a
    ``multiprocessing`` Manager it *spawns* on first use and keeps for the life of the process; a
    rank killed during a save leaves that server behind as an orphan.  This starts the manager
    first, with :func:`hdp.procs.die_with_parent` as its initializer, and hands its queue to
    Megatron (its module-level ``_results_queue``).  The forked write workers are covered by
    ``hdp.core.checkpoint.writers_die_with_parent``.  Idempotent.
    """
    import multiprocessing as mp
    import os
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from hdp.procs import die_with_parent

    if getattr(filesystem_async, "_results_queue", None) is not None:
        return
    manager = SyncManager(ctx=mp.get_context("spawn"))
    manager.start(initializer=die_with_parent, initargs=(os.getpid(),))
    filesystem_async._results_queue = manager.Queue()
    _WRITER_MANAGER.append(manager)  # keep it alive with the process


_WRITER_MANAGER: list[Any] = []


def release_ddp(ddp: Any) -> None:
    """Let a Megatron DDP wrapper be freed: drop the gradient-accumulator nodes it keeps.

    megatron-core 0.16.1 ``DistributedDataParallel`` registers its backward hook on each
    parameter's ``AccumulateGrad`` node and keeps the node in ``grad_accs``: node -> hook -> DDP ->
    node is a cycle through C++ that Python's garbage collector cannot see, so a DDP wrapper (its
    model, its process groups and their transport threads) lives as long as the process.  Dropping
    the list frees the nodes (parameters hold them weakly) and with them the cycle.  The wrapper
    no longer reduces gradients afterwards: call it only when its engine closes.
    """
    accs = getattr(ddp, "grad_accs", None)
    if isinstance(accs, list):
        accs.clear()


def stop_checkpoint_writer() -> None:
    """Stop the helper process :func:`checkpoint_writers_die_with_parent` started (idempotent); the
    next dist save starts a new one."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    while _WRITER_MANAGER:
        manager = _WRITER_MANAGER.pop()
        filesystem_async._results_queue = None
        manager.shutdown()


def megatron_groups() -> ProcessGroupCollection:
    """Megatron's process groups of this rank, read once from its parallel state.

    For callers whose Megatron was initialised elsewhere (verl's Megatron engine, Megatron-Bridge):
    hdp's builders take the groups explicitly, never ``None``.
    """
    if not parallel_state.model_parallel_is_initialized():
        raise ValueError("megatron_groups: Megatron's parallel state is not initialised (initialize_megatron)")
    return ProcessGroupCollection.use_mpu_process_groups()


def manual_seed(seed: int) -> None:
    """Seed torch and Megatron's named RNG states (data-, tensor- and expert-parallel)."""
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_megatron() -> None:
    """Tear down Megatron's parallel state (before ``destroy_process_group``); CPU shim holds are
    released separately (:meth:`MegatronRuntime.close`, :meth:`CpuShim.undo`)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()




@contextlib.contextmanager
def default_group(group: "torch.distributed.ProcessGroup") -> Iterator[None]:
    """While active, ``group=None`` collectives run on ``group`` (a group over the whole world, ranks in
    order) instead of the default group.

    megatron-core 0.16.1's ``dist_checkpointing.save`` / ``load`` run ``gather_object``, ``barrier``
    and friends on the default group, whose timeout is torch's (10-30 min) rather than the
    engine's: a rank interrupted mid-save left its peers blocked there for that long.  With the
    engine's job group as the default for the call, every collective of the checkpoint code has the
    engine's timeout and is released by its alarm (:mod:`hdp.alarm`).  Restored on exit.  Can go when
    Megatron's checkpoint functions take a process group.
    """
    from torch.distributed import distributed_c10d as c10d

    if torch.distributed.get_world_size(group) != torch.distributed.get_world_size():
        raise ValueError("default_group: the group must span the whole world")
    old = c10d._world.default_pg
    c10d._update_default_pg(group)
    try:
        yield
    finally:
        c10d._update_default_pg(old)
