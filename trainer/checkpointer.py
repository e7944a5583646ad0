"""The library engine's checkpoints: what a save writes and a load reads, for both formats.

:class:`Checkpointer` saves and loads one :class:`~hdp.trainer.engine.HdpEngine`'s model, optimizer and step
counter (as torchtitan's trainer saves through its checkpointer): the call's agreement, the format decision,
the atomic, verified slots (:mod:`hdp.core.checkpoint`), the fit check from metadata before anything is
touched, and the restore of the previous state when a load fails on any rank.  Formats: ``dist`` (Megatron's
distributed checkpointing, reshardable over the domain size) and ``per-rank`` (one file per rank, same layout).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import torch

from hdp import megatron_compat as mc
from hdp.core import checkpoint as ckpt
from hdp.core.optim_state import (
    CheckpointFormat,
    checkpoint_format,
    dist_checkpoint_problem,
    ensure_optimizer_state,
    load_shard_state,
    optimizers,
    restore_adam_steps,
    shard_state,
    to_device,
    to_host,
)
from hdp.megatron_compat import dist_checkpointing
from hdp.trainer.calls import check_path, describe_call

if TYPE_CHECKING:
    from hdp.trainer.engine import HdpEngine

__all__ = ["Checkpointer", "model_digest"]

logger = logging.getLogger(__name__)


def model_digest(model: Any) -> str:
    """sha256 (16 hex digits) of a model configuration (a dataclass): a checkpoint loads only into the same model."""
    cfg = json.dumps(dataclasses.asdict(model), sort_keys=True, default=str)
    return hashlib.sha256(cfg.encode()).hexdigest()[:16]


class Checkpointer:
    """Saves and loads one engine's training state (collective over the job: call on every rank)."""

    def __init__(self, engine: "HdpEngine") -> None:
        self.engine = engine

    def _model_sharded_state_dict(self) -> dict[str, Any]:
        if len(self.engine.model_chunks) == 1:
            return self.engine.model_chunks[0].module.sharded_state_dict()
        return {f"model{i}": c.module.sharded_state_dict() for i, c in enumerate(self.engine.model_chunks)}

    def _sharded_state_dict(self, is_loading: bool) -> dict[str, Any]:
        ensure_optimizer_state(self.engine.optimizer)
        model_sd = self._model_sharded_state_dict()
        # megatron-core 0.16.1: the default 'fully_sharded_model_space' relies on flattened_range,
        # which dist_checkpointing rejects, and 'fully_reshardable' gathers through a hard-coded
        # ``.cuda()``; 'dp_reshardable' saves each rank's optimizer shard without communication
        # (load with the same layout).
        meta = {"distrib_optim_sharding_type": "dp_reshardable"}
        return {
            "model": model_sd,
            "optimizer": self.engine.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=meta),
            "hdp_step": self.engine.step,
        }

    def _load_model_state(self, model_state: Mapping[str, Any]) -> None:
        if len(self.engine.model_chunks) == 1:
            self.engine.model_chunks[0].module.load_state_dict(model_state)
        else:
            for i, c in enumerate(self.engine.model_chunks):
                c.module.load_state_dict(model_state[f"model{i}"])

    def _layout(self) -> dict[str, int]:
        par = self.engine.config.parallel
        return {"world_size": self.engine.groups.world_size, "domain_size": self.engine.num_ranks, "tp": par.tp, "pp": par.pp,
                "virtual_pp": par.vpp, "ep": par.ep}

    def _checkpoint_meta(self, fmt: CheckpointFormat) -> dict[str, Any]:
        return {"model_config": model_digest(self.engine.config.model), "hdp_format": fmt.value, **self._layout()}

    def _saved_view(self, manifest: ckpt.Manifest, slot: Path) -> ckpt.StateView:
        """What the checkpoint's slot holds, from metadata (`hdp.core.checkpoint.check_fit`): a ``dist`` slot's
        Megatron metadata (the whole job), or this rank's ``per-rank`` file, memory-mapped."""
        if manifest.format == CheckpointFormat.DIST.value:
            entries = ckpt.dist_checkpoint_tensors(slot)
        else:
            entries = ckpt.torch_file_tensors(slot / f"rank_{self.engine.groups.world_rank}.pt")
        layout = {k: manifest.meta.get(k) for k in self._layout()}
        return ckpt.StateView(parts={"state": entries}, meta={"model_config": manifest.meta.get("model_config")},
                              layout=layout)

    def _loaded_view(self, fmt: str) -> ckpt.StateView:
        """What this rank would load in format ``fmt``: the Megatron sharded state dict a ``dist`` save writes, or the
        state a ``per-rank`` save writes (no copy of the tensors: shapes and dtypes only)."""
        if fmt == CheckpointFormat.DIST.value:
            entries = ckpt.sharded_state_tensors(self._sharded_state_dict(is_loading=False))
        else:
            entries = ckpt.state_tensors(self._payload())
        return ckpt.StateView(parts={"state": entries}, meta={"model_config": model_digest(self.engine.config.model)},
                              layout=self._layout())

    def _check_layout(self, manifest: ckpt.Manifest) -> None:
        """A per-rank checkpoint loads only on the layout that wrote it; a ``dist`` one on another domain size,
        but with the TP and PP sizes that wrote it (the optimizer state is saved ``dp_reshardable``)."""
        if manifest.format != CheckpointFormat.PER_RANK.value:
            mine = self._layout()
            changed = {k: (manifest.meta.get(k), mine[k]) for k in ("tp", "pp") if k in manifest.meta
                       and manifest.meta.get(k) != mine[k]}
            if changed:
                what = ", ".join(f"{k.upper()} {old} -> {new}" for k, (old, new) in changed.items())
                raise ckpt.CheckpointError(
                    f"checkpoint (step {manifest.step}, format 'dist') was saved with TP {manifest.meta.get('tp')} x "
                    f"PP {manifest.meta.get('pp')}; this engine has TP {mine['tp']} x PP {mine['pp']} (the layout "
                    f"changed: {what}). A dist checkpoint reshards over the domain size only (megatron-core 0.16.1 "
                    "saves the distributed optimizer's state as dp_reshardable): load it with the TP and PP that "
                    "saved it"
                )
            return
        saved = {k: manifest.meta.get(k) for k in self._layout()}
        if saved != self._layout():
            raise ckpt.CheckpointError(
                f"checkpoint (step {manifest.step}, format 'per-rank') was saved with layout {saved}; this engine has "
                f"{self._layout()}. A per-rank checkpoint loads only on the same layout (save with format='dist')"
            )

    def _payload(self) -> dict[str, Any]:
        """This rank's whole training state (what a per-rank checkpoint holds; tensors are live references)."""
        ensure_optimizer_state(self.engine.optimizer)  # a fresh optimizer: Adam's zero state, as its first step makes
        return {
            "format": CheckpointFormat.PER_RANK.value,
            "layout": self._layout(),
            "model": self.engine.state_dict(),
            "optimizer": self.engine.optimizer.state_dict(),
            "optimizer_shards": [shard_state(o) for o in optimizers(self.engine.optimizer)],
            "hdp_step": self.engine.step,
        }

    def _apply_payload(self, state: Mapping[str, Any]) -> None:
        """Put :meth:`_payload`'s state (on this engine's device) into the model and the optimizer."""
        model = state["model"]
        self._load_model_state(model["model"] if len(self.engine.model_chunks) == 1 else model)
        self.engine.optimizer.load_state_dict(state["optimizer"])
        for opt, shard in zip(optimizers(self.engine.optimizer), state["optimizer_shards"]):
            load_shard_state(opt, shard)
        self.engine.step = int(state["hdp_step"])

    def save(self, path: str | os.PathLike[str], *, format: CheckpointFormat | str = "auto") -> None:
        """Save model, optimizer and step counter into the directory ``path`` (collective over the job).

        Atomic and verified (:mod:`hdp.core.checkpoint`): every rank writes into the free data
        slot of ``path``, flushes and hashes its files, and one manifest (format version, world and
        domain size, layout, model-config digest, step, sha256 of every file) is renamed into place
        once every rank has written — a process killed during the save leaves the previous
        checkpoint loadable.  Any error on any rank raises on every rank and leaves the previous
        checkpoint as it was.

        ``dist``: Megatron distributed checkpointing (model + distributed-optimizer sharded state
        dicts, torch_dist backend, optimizer as ``dp_reshardable``); its forked writer processes
        die with their rank.  megatron-core 0.16.1's writer needs ``psutil`` and starts worker
        processes, so the rank must not run in a daemonic process.  ``per-rank``: every rank writes
        ``rank_{global rank}.pt`` with its model chunks, the optimizer's common state and its own
        optimizer shard (load with the same layout).  ``auto``: ``dist`` when every rank of the job
        can write it, else ``per-rank``.  Raises ``ValueError`` on every rank when ``dist`` is asked
        for and some rank cannot write it.
        """
        def check() -> tuple[tuple[CheckpointFormat, str | None], int]:
            check_path(path, "save_checkpoint")
            fmt = checkpoint_format(format)
            problem = dist_checkpoint_problem() if fmt is not CheckpointFormat.PER_RANK else None
            return (fmt, problem), 0 if problem is None else 1  # the vote: some rank cannot write 'dist'

        # the call's one agreement: the same call and arguments everywhere, and one format decision for all
        step = self.engine.step
        (fmt, problem), cannot = self.engine.core.agree_call(
            "save_checkpoint", step, describe_call("save_checkpoint", step, path=path, format=format), check)
        if fmt is not CheckpointFormat.PER_RANK:
            if not cannot:
                fmt = CheckpointFormat.DIST
            elif fmt is CheckpointFormat.AUTO:
                logger.info("save_checkpoint: per-rank format (%s)", problem or "another rank cannot write 'dist'")
                fmt = CheckpointFormat.PER_RANK
            else:
                raise ValueError(
                    f"save_checkpoint(format='dist'): {problem or 'another rank cannot write it (see its error)'}; "
                    "use format='per-rank' or 'auto'"
                )
        with self.engine.core.collectives("save", self.engine.step):

            def write(slot: Path) -> None:
                if fmt is CheckpointFormat.DIST:
                    mc.checkpoint_writers_die_with_parent()  # its spawned helper dies with this rank
                    with self.engine.core.checkpoint_collectives():  # Megatron's collectives: the engine's timeout, released on failure
                        dist_checkpointing.save(self._sharded_state_dict(is_loading=False), str(slot))
                else:
                    torch.save(self._payload(), slot / f"rank_{self.engine.groups.world_rank}.pt")

            ckpt.save_slots(path, guard=self.engine.core.guard, group=self.engine.groups.world, rank=self.engine.groups.world_rank,
                            size=self.engine.groups.world_size, step=self.engine.step, format=fmt.value,
                            meta=self._checkpoint_meta(fmt), write=write)

    def load(self, path: str | os.PathLike[str]) -> None:
        """Load what :meth:`save` wrote (collective); the next step continues bit for bit.

        Verified before anything is touched, on every rank: the manifest (format version, the layout)
        and the sha256 of every file, then whether the checkpoint fits this engine
        (:func:`~hdp.core.checkpoint.check_fit`, from metadata: every key, shape and dtype against
        what this engine loads, and the model-config digest); any problem on any rank raises
        :class:`~hdp.core.checkpoint.CheckpointError` (a ``ValueError``, through the step guard) on
        every rank, naming the first differing tensor and both sides, and the engine stays usable.
        Then every rank loads; if loading fails on any rank
        — whatever the exception type, Megatron's ``CheckpointException`` included — every rank puts
        back the state it had before the call (model, optimizer, step) and raises.  A ``dist``
        checkpoint also loads on another domain size.
        """
        step = self.engine.step
        self.engine.core.agree_call("load_checkpoint", step, describe_call("load_checkpoint", step, path=path),
                                    lambda: (check_path(path, "load_checkpoint"), 0))
        with self.engine.core.collectives("load", self.engine.step):
            manifest = ckpt.verify_checkpoint(
                path, guard=self.engine.core.guard, rank=self.engine.groups.world_rank, size=self.engine.groups.world_size, step=step,
                expect={}, check=self._check_layout)
            slot = Path(path) / manifest.slot
            ckpt.check_fit(path, guard=self.engine.core.guard, step=step, checkpoint=lambda: self._saved_view(manifest, slot),
                           engine=lambda: self._loaded_view(manifest.format),
                           gather=manifest.format == CheckpointFormat.DIST.value)
            before: dict[str, Any] | None = None
            try:
                with self.engine.core.guard.phase("load: apply", step):
                    before = to_host(self._payload())  # the state to restore if any rank fails to load
                    if manifest.format == CheckpointFormat.DIST.value:
                        with self.engine.core.checkpoint_collectives():  # Megatron's collectives: released when this rank fails
                            self._load_dist(slot)
                    else:
                        state = torch.load(slot / f"rank_{self.engine.groups.world_rank}.pt", map_location=self.engine.device,
                                           weights_only=False)
                        self._apply_payload(state)
            except BaseException:
                if before is not None:
                    with torch.no_grad():
                        self._apply_payload(to_device(before, self.engine.device))
                raise

    def _load_dist(self, slot: Path) -> None:
        state = dist_checkpointing.load(self._sharded_state_dict(is_loading=True), str(slot))
        self._load_model_state(state["model"])
        # no_grad: for fp32 models the optimizer's main parameters are views of the model's
        # leaf parameters, which Megatron's loader copies into in place
        with torch.no_grad():
            self.engine.optimizer.load_state_dict(state["optimizer"])
        restore_adam_steps(self.engine.optimizer, state["optimizer"])
        self.engine.step = int(state["hdp_step"])

