"""verl's *stock* Megatron engine on CPU, for the differential tests (hdp against stock on the same job).

verl 0.9.1 registers ``MegatronEngineWithLMHead`` / ``MegatronEngineWithValueHead`` for CUDA only, and two
things keep them off a machine without TransformerEngine:

* their packed path (``model.use_remove_padding=True``: THD, ``PackedSeqParams`` with ``cu_seqlens``) needs
  TE's core attention — Megatron's local ``DotProductAttention`` asserts ``packed_seq_params is None``
  (megatron-core 0.16.1 ``dot_product_attention.py:153``);
* ``McoreEngineConfig.__post_init__`` refuses ``dtype=float32`` (bf16 / fp16 only): a differential test in
  bf16 would compare two engines through 8 mantissa bits.

:func:`install` (after :func:`hdp.integrations.verl.scaffolding.install`) registers, under verl's own
``EngineRegistry`` key for the scaffolding's CPU platform (device "cpu", backend "megatron"), two subclasses
of the stock engines whose changes are the core attention of the model they build — `VarlenCoreAttention`,
causal attention over each packed sequence with torch's ``scaled_dot_product_attention`` (CP 1, the stock
engine's layout here; its own code and kernel, not hdp's, so the comparison is between two implementations) —
and a checkpoint load that behaves as on GPUs (`_load_as_on_gpus`: no autograd on the in-place load of fp32
main parameters, Adam's step restored as FusedAdam keeps it).  It also lets ``McoreEngineConfig`` take
``dtype=float32`` (the check is kept for every other value).
Everything else — micro-batching, Megatron's schedule, the loss, the optimizer, checkpoints, weight export —
is verl's stock code.  Test-only: GPU runs never import it.  Idempotent.
"""

from __future__ import annotations

import math
import os
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F

__all__ = ["install", "compose_stock", "VarlenCoreAttention", "stock_engine_classes"]

_installed = False
_classes: dict[str, type] = {}


class VarlenCoreAttention(torch.nn.Module):
    """Megatron core attention for the packed (THD) layout on CPU: per sequence of ``cu_seqlens`` (the padded
    ones where given, as TE reads them), causal softmax attention with grouped KV heads.

    Legend: T packed tokens, Hq query heads, Hkv key/value heads (of this TP rank), D head dim.
    Takes Megatron's core-attention call (query [T, Hq, D], key / value [T, Hkv, D] in THD; [S, B, H, D] without
    packing, B = 1 only) and returns [T, Hq, D] (THD) or [S, B, Hq·D]."""

    def __init__(self, config: Any, layer_number: int, softmax_scale: Optional[float] = None) -> None:
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("VarlenCoreAttention: attention_bias is not supported")
        if packed_seq_params is None:  # [S, B, H, D]: one unpacked batch row
            if query.shape[1] != 1:
                raise ValueError(f"VarlenCoreAttention: unpacked input needs batch 1, got {tuple(query.shape)}")
            s = query.shape[0]
            out = self._attend(query[:, 0], key[:, 0], value[:, 0], [0, s])  # [S, Hq, D]
            return out.reshape(s, 1, -1)  # [S, 1, Hq*D]
        cu = packed_seq_params.cu_seqlens_q_padded
        if cu is None:
            cu = packed_seq_params.cu_seqlens_q
        return self._attend(query, key, value, [int(x) for x in cu.tolist()])

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int]) -> torch.Tensor:
        """q [T, Hq, D], k / v [T, Hkv, D], cu [S+1] -> [T, Hq, D]; tokens past ``cu[-1]`` (none) stay 0."""
        group = q.shape[1] // k.shape[1]
        out = torch.zeros_like(q)  # [T, Hq, D]
        parts = []
        for a, b in zip(cu[:-1], cu[1:]):
            if b <= a:
                continue
            qs = q[a:b].transpose(0, 1)  # [Hq, L, D]
            ks = k[a:b].transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, L, D]
            vs = v[a:b].transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, L, D]
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=self.softmax_scale)  # [Hq, L, D]
            parts.append((a, b, o.transpose(0, 1)))  # [L, Hq, D]
        if len(parts) == 1 and parts[0][0] == 0 and parts[0][1] == q.shape[0]:
            return parts[0][2]
        for a, b, o in parts:  # out-of-place scatter keeps autograd through every part
            out = out.index_copy(0, torch.arange(a, b, device=q.device), o)
        return out


def _swap_attention(module: list[Any]) -> None:
    from hdp.integrations.verl import compat

    for chunk in module:
        model = compat.unwrap_model(chunk)
        for layer in model.decoder.layers:
            attn = layer.self_attention
            old = attn.core_attention
            attn.core_attention = VarlenCoreAttention(old.config, old.layer_number, getattr(old, "softmax_scale", None))


def _load_as_on_gpus(engine: Any, base: type, *args: Any, **kwargs: Any) -> Any:
    """verl's ``load_checkpoint`` as it behaves on GPUs, where two things differ from this CPU, fp32 setting:
    in bf16 the optimizer's fp32 main parameters are copies (here, in fp32, they are views of the model's leaf
    parameters, which Megatron's load writes in place: run under ``torch.no_grad()``), and TE / Apex FusedAdam
    keeps Adam's step in its parameter groups (torch's Adam keeps it per parameter, which megatron-core 0.16.1's
    ``dp_reshardable`` load leaves at a placeholder: restored from the loaded state, as hdp's engine does,
    `hdp.core.optim_state.restore_adam_steps`)."""
    from hdp.core.optim_state import restore_adam_steps

    opt = getattr(engine, "optimizer", None)
    loaded: list[Any] = []
    if opt is not None:
        orig = opt.load_state_dict

        def capture(state_dict: Any, *a: Any, **k: Any) -> Any:
            loaded.append(state_dict)
            return orig(state_dict, *a, **k)

        opt.load_state_dict = capture  # this instance, for this call only
    try:
        with torch.no_grad():
            out = base.load_checkpoint(engine, *args, **kwargs)
    finally:
        if opt is not None:
            del opt.load_state_dict
    if opt is not None and loaded:
        restore_adam_steps(opt, loaded[-1])
    return out


def _allow_fp32_engine_config() -> None:
    """``McoreEngineConfig`` with ``dtype=float32`` accepted (its other checks unchanged)."""
    from verl.workers.config import engine as engine_config

    cls = engine_config.McoreEngineConfig
    orig = cls.__post_init__
    if getattr(orig, "_hdp_fp32", False):
        return

    def __post_init__(self: Any) -> None:
        dtype = self.dtype
        if dtype == "float32":
            object.__setattr__(self, "dtype", "bfloat16")
        try:
            orig(self)
        finally:
            object.__setattr__(self, "dtype", dtype)

    __post_init__._hdp_fp32 = True  # type: ignore[attr-defined]
    cls.__post_init__ = __post_init__


def compose_stock(model_path: str, *, budget: int, overrides: Sequence[str] = ()) -> Any:
    """verl's ``ppo_trainer`` with ``model_engine=megatron`` (verl's stock Megatron engine for every role) for the
    scaffolding's tiny fp32 model on CPU, packed (``use_remove_padding``), dynamic batch sizes with ``budget``
    tokens per rank, plus ``overrides`` — the stock twin of :func:`~hdp.integrations.verl.scaffolding.worker.compose`."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import verl.trainer.config as vtc

    base = [
        "algorithm.adv_estimator=grpo",
        "model_engine=megatron",
        f"actor_rollout_ref.model.path={model_path}",
        "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={budget}",
        f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={budget}",
        f"actor_rollout_ref.ref.log_prob_max_token_len_per_gpu={budget}",
        "actor_rollout_ref.actor.megatron.vanilla_mbridge=true",
        "actor_rollout_ref.ref.megatron.vanilla_mbridge=true",
        "actor_rollout_ref.actor.megatron.dtype=float32",
        "actor_rollout_ref.ref.megatron.dtype=float32",
        "actor_rollout_ref.actor.optim.total_training_steps=100",
    ]
    with initialize_config_dir(config_dir=os.path.dirname(vtc.__file__), version_base=None):
        return hydra_compose("ppo_trainer", overrides=[*base, *overrides])


def stock_engine_classes() -> dict[str, type]:
    """``{"language_model": ..., "value_model": ...}``: the CPU subclasses :func:`install` registered."""
    install()
    return dict(_classes)


def install() -> None:
    """Register verl's stock Megatron engines for the CPU platform (see the module docstring)."""
    global _installed
    if _installed:
        return
    from hdp.integrations.verl.scaffolding import install as install_scaffolding

    install_scaffolding()
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead, MegatronEngineWithValueHead

    from hdp.integrations.verl.scaffolding.platform import PLATFORM

    _allow_fp32_engine_config()
    for model_type, base in (("language_model", MegatronEngineWithLMHead), ("value_model", MegatronEngineWithValueHead)):
        def build(self: Any, _base: type = base) -> Any:
            module = _base._build_megatron_module(self)
            _swap_attention(module)
            return module

        def load_checkpoint(self: Any, *args: Any, _base: type = base, **kwargs: Any) -> Any:
            return _load_as_on_gpus(self, _base, *args, **kwargs)

        cls = type(f"Cpu{base.__name__}", (base,), {
            "__doc__": f"verl's stock {base.__name__} with `VarlenCoreAttention` (CPU tests).",
            "_build_megatron_module": build, "load_checkpoint": load_checkpoint})
        EngineRegistry.register(model_type=model_type, backend="megatron", device=PLATFORM)(cls)
        _classes[model_type] = cls
    _installed = True
