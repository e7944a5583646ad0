"""What a verl Megatron checkpoint holds, and what the hdp engine would load from it: the two sides of
:func:`hdp.core.checkpoint.check_fit` for ``HdpMegatronEngine.load_checkpoint``.

verl 0.9.1's ``MegatronCheckpointManager`` (checkpoint layout v2) writes, under a checkpoint directory:

* ``model/huggingface/`` — the model as Hugging Face safetensors through mbridge (verl's default,
  ``megatron.use_dist_checkpointing=false``; also with ``hf_model`` in ``save_contents``);
* ``model/dist_ckpt/`` — the model as a Megatron distributed checkpoint (``use_dist_checkpointing=true``);
* ``optimizer/dist_ckpt/`` — the distributed optimizer (a Megatron distributed checkpoint, always);
* ``extra/dist_ckpt/`` — the RNG states, one object per (pipeline stage, tensor rank);
* ``ckpt_contents.json`` (the role, ``actor`` or ``critic``, and the architecture) and
  ``transformer_config.json`` (the layout).

verl's load writes these parts one after the other — the Hugging Face weights tensor by tensor — and raises
only where one does not fit (an actor's checkpoint loaded into the critic had overwritten 18 parameters
before its optimizer state failed), from inside collectives.  So the engine checks the whole checkpoint
first: :func:`saved_view` reads every part the load will read (metadata and safetensors headers only), and
:func:`loaded_view` lists what this rank's engine would load from each, computed as verl computes it (its
content metadata, its sharded state dicts, mbridge's Hugging Face names).  Under Megatron-Bridge
(``vanilla_mbridge=false``) the Hugging Face names are not compared (no mapping hdp can read); the role and
architecture still are.

Legend: TP / PP / VPP / EP: tensor, pipeline, virtual pipeline and expert parallel sizes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hdp.integrations.verl import compat
from hdp.core import checkpoint as ckpt
from hdp.core.optim_state import ensure_optimizer_state

__all__ = ["HF_MODEL", "DIST_MODEL", "OPTIMIZER", "EXTRA", "CONTENTS", "TRANSFORMER_CONFIG", "LOCAL_OPTIMIZER_FORMATS",
           "saved_view", "loaded_view"]

HF_MODEL = "model/huggingface"
"""The model as Hugging Face safetensors (relative to the checkpoint directory; verl 0.9.1 layout v2)."""
DIST_MODEL = "model/dist_ckpt"
"""The model as a Megatron distributed checkpoint."""
OPTIMIZER = "optimizer/dist_ckpt"
"""The distributed optimizer's state (Megatron distributed checkpoint)."""
EXTRA = "extra/dist_ckpt"
"""The RNG states (Megatron distributed checkpoint)."""
CONTENTS = "ckpt_contents.json"
"""verl's contents manifest: role, architecture, what was saved."""
TRANSFORMER_CONFIG = "transformer_config.json"
"""Megatron's TransformerConfig of the saving engine (its layout)."""
LOCAL_OPTIMIZER_FORMATS = ("dp_reshardable", "fully_sharded_model_space")
"""Distributed-optimizer checkpoint formats (``distrib_optim_sharding_type``) whose sharded state dict a rank builds
without communication; the others (``fully_reshardable``, ...) gather over the domain to build it, so their
optimizer part is not described here (the model's parts, the role and the architecture still are)."""


def _manager(engine: Any) -> Any:
    manager = compat.checkpoint_manager(engine)
    if manager is None:
        raise ckpt.CheckpointError(f"{engine.role_key}: this engine is forward-only (verl builds no checkpoint manager "
                                   "for it) and loads no checkpoint")
    return manager


def _parts(manager: Any) -> list[tuple[str, str]]:
    """(part, directory) of every part verl's load reads, in its order (``checkpoint.load_contents``)."""
    if getattr(manager, "use_megatron_fsdp", False) or getattr(manager, "peft_cls", None) is not None:
        return []  # other layouts (Megatron-FSDP, PEFT adapters): only the role and architecture are compared
    parts = []
    if manager.should_load_dist_ckpt_model:
        parts.append(("model", DIST_MODEL))
    elif manager.should_load_hf_model:
        parts.append(("model (Hugging Face)", HF_MODEL))
    if manager.should_load_optimizer:
        parts.append(("optimizer", OPTIMIZER))
    if manager.should_load_extra:
        parts.append(("extra", EXTRA))
    return parts


def _has_files(path: Path) -> bool:
    return path.is_dir() and any(path.iterdir())


def _read_json(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ckpt.CheckpointError(f"checkpoint file {str(path)!r} is unreadable ({exc})") from exc
    return doc if isinstance(doc, dict) else {}


def _layout(tp: Any, pp: Any, vpp: Any, ep: Any) -> dict[str, int]:
    return {"tp": int(tp or 1), "pp": int(pp or 1), "vpp": int(vpp or 1), "ep": int(ep or 1)}


def saved_view(engine: Any, path: str | os.PathLike[str]) -> ckpt.StateView:
    """What the verl checkpoint at ``path`` holds, for every part ``engine``'s load reads: safetensors headers,
    Megatron metadata; its role and architecture (``ckpt_contents.json``) and layout (``transformer_config.json``)
    where saved.  :class:`~hdp.core.checkpoint.CheckpointError` names a missing checkpoint or part."""
    manager = _manager(engine)
    root = Path(path)
    if not root.is_dir():
        raise ckpt.CheckpointError(f"checkpoint {str(root)!r} does not exist or is not a directory; pass a directory "
                                   "written by the engine's save_checkpoint")
    parts: dict[str, dict[str, ckpt.TensorSpec]] = {}
    for part, rel in _parts(manager):
        where = root / rel
        if not _has_files(where):
            raise ckpt.CheckpointError(
                f"checkpoint {str(root)!r} holds no {part} ({rel}/ is missing or empty), which this engine loads "
                f"(checkpoint.load_contents={list(manager.checkpoint_load_contents)}, "
                f"megatron.use_dist_checkpointing={manager.use_dist_checkpointing}); load a checkpoint saved with the "
                "same contents and format")
        if rel == HF_MODEL:
            parts[part] = ckpt.safetensors_tensors(where)
        else:
            parts[part] = ckpt.dist_checkpoint_tensors(where)
    meta: dict[str, Any] = {}
    if (root / CONTENTS).is_file():
        doc = _read_json(root / CONTENTS)
        meta = {"role": doc.get("role"), "architecture": doc.get("arch")}
    layout: dict[str, Any] = {}
    if (root / TRANSFORMER_CONFIG).is_file():
        tc = _read_json(root / TRANSFORMER_CONFIG)
        layout = _layout(tc.get("tensor_model_parallel_size"), tc.get("pipeline_model_parallel_size"),
                         tc.get("virtual_pipeline_model_parallel_size"), tc.get("expert_model_parallel_size"))
    return ckpt.StateView(parts=parts, meta=meta, layout=layout)


def loaded_view(engine: Any, path: str | os.PathLike[str]) -> ckpt.StateView:
    """What this rank of ``engine`` would load from the checkpoint at ``path``, part by part as verl's load composes
    it: the Hugging Face names, shapes and dtypes mbridge reads for this rank's weights, or the model's sharded
    state dict; the distributed optimizer's (in a format a rank describes alone, `LOCAL_OPTIMIZER_FORMATS`; its
    state allocated as Adam's first step would, when it has not stepped yet); the RNG states'.  Its role and
    architecture as verl's manager records them.  No collective: `check_fit` joins the ranks' views."""
    manager = _manager(engine)
    ps = compat.mpu()
    parts: dict[str, dict[str, ckpt.TensorSpec]] = {}
    named = _parts(manager)
    dists = [Path(path) / rel for _, rel in named if rel != HF_MODEL]
    source = next((d for d in dists if _has_files(d)), Path(path) / DIST_MODEL)
    metadata = compat.checkpoint_content_metadata(manager, str(source)) if dists else None
    for part, rel in named:
        if rel == HF_MODEL:
            hf = compat.hf_weights(engine.bridge, engine.module, ps.get_tensor_model_parallel_world_size(),
                                   ps.get_expert_tensor_parallel_world_size())
            if hf is not None:  # else (Megatron-Bridge) the part is not compared
                parts[part] = {k: ckpt.TensorSpec(shape, str(dtype).removeprefix("torch."))
                               for k, (shape, dtype) in hf.items()}
        elif rel == DIST_MODEL:
            parts[part] = ckpt.sharded_state_tensors(compat.model_sharded_state_dict(manager, metadata))
        elif rel == OPTIMIZER:
            kind = (metadata or {}).get("distrib_optim_sharding_type", "fully_sharded_model_space")
            if manager.use_distributed_optimizer and kind not in LOCAL_OPTIMIZER_FORMATS:
                continue
            ensure_optimizer_state(engine.optimizer)  # megatron-core 0.16.1 cannot describe a fresh optimizer's state
            model = compat.model_sharded_state_dict(manager, metadata)
            parts[part] = ckpt.sharded_state_tensors(
                engine.optimizer.sharded_state_dict(model, is_loading=False, metadata=metadata))
        else:
            parts[part] = ckpt.sharded_state_tensors({"rng_state": manager.get_rng_state()})
    layout = _layout(ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                     len(engine.module), ps.get_expert_model_parallel_world_size())
    return ckpt.StateView(parts=parts, meta={"role": manager.role, "architecture": manager.arch}, layout=layout)
