"""The verl engine's memory model and limit: verl's model (its Hugging Face config) on verl's Megatron
layout, the same `hdp.packing.memory.MemoryModel` the library engine plans with.

The layout comes from ``actor_rollout_ref.actor.megatron.*`` (TP, PP, virtual PP, EP, expert TP; the
domain is the DP size with CP 1), the recompute mode from ``override_transformer_config``
(``recompute_granularity``: ``full`` / ``selective``), zero-memory and the CP algorithm from
``actor_rollout_ref.actor.hdp.*``, the dtype from the engine's ``dtype``, the log-prob path from
``use_fused_kernels`` (hdp's fused path: the logits term is its bytes).  The limit is
``hdp.max_memory_gb`` (``auto``: the device's memory × `hdp.trainer.memory.DEVICE_MEMORY_FRACTION`,
none on CPU).
"""

from __future__ import annotations

from typing import Any

import torch

from hdp.packing.memory import MemoryModel
from hdp.packing.model_shape import ModelShape
from hdp.trainer.memory import check_static_fits, engine_memory_model, resolve_memory_limit

__all__ = ["verl_memory", "recompute_mode"]


def recompute_mode(engine_config: Any) -> str:
    """``none``, ``selective`` or ``full`` from verl's ``override_transformer_config.recompute_granularity``."""
    gran = (getattr(engine_config, "override_transformer_config", None) or {}).get("recompute_granularity")
    return gran if gran in ("full", "selective") else "none"


def verl_memory(model_config: Any, engine_config: Any, *, world: int, device: torch.device, vpp: int | None = None,
                check_only: bool = False) -> tuple[MemoryModel | None, float | None]:
    """(memory model, limit in bytes) of the verl engine; ``(None, None)`` without a Hugging Face config.

    Pure: ValueError naming ``<role>.hdp.max_memory_gb`` when the limit is below the layout's static
    memory, raised alike on every rank before any collective (the engine calls it at construction with
    ``check_only``: then nothing is built when there is no limit).
    """
    hf = getattr(model_config, "hf_config", None)
    opts = engine_config.hdp
    limit = resolve_memory_limit(opts.max_memory_gb, device)
    if hf is None or (check_only and limit is None):
        return None, limit
    from hdp.integrations.verl.checks import role_key, uses_fused_logprobs

    shape = ModelShape.from_hf_config(hf, dtype=str(getattr(engine_config, "dtype", "bfloat16")))
    tp = int(engine_config.tensor_model_parallel_size)
    pp = int(engine_config.pipeline_model_parallel_size)
    vpp = vpp or int(getattr(engine_config, "virtual_pipeline_model_parallel_size", None) or 1)
    model = engine_memory_model(
        shape, tp=tp, pp=pp, vpp=vpp, ep=int(engine_config.expert_model_parallel_size or 1),
        # Megatron's expert TP defaults to TP; a dense model has no experts, so none of its layout
        etp=int(getattr(engine_config, "expert_tensor_parallel_size", None) or tp) if shape.is_moe else 1,
        domain=max(1, world // (tp * pp)),
        recompute=recompute_mode(engine_config), zero_memory=opts.zero_memory.value,
        cp_algorithm=opts.cp_algorithm.value, param_bytes=shape.dtype_bytes,
        fused_logprobs=uses_fused_logprobs(engine_config))
    if limit is not None:
        check_static_fits(model, limit, f"{role_key(engine_config)}.hdp.max_memory_gb")
    return model, limit
