"""mbridge bridges for Qwen3 / Qwen3-MoE / Qwen2 / Llama / DeepSeek-V3 on Megatron's *local* layer spec (CPU, no
TransformerEngine).

mbridge 0.15 builds every model with ``get_gpt_decoder_block_spec(config, use_transformer_engine=True)``
(``mbridge/core/llm_bridge.py``), and its name mappings assume TransformerEngine's layout (the input
norm fused into ``linear_qkv.layer_norm_weight``, grouped experts ``experts.linear_fc1.weight{i}``).
Without TransformerEngine (CPU) the local spec is the only one that builds, so these subclasses

* build the local spec, with the fused-kernel flags off (no Apex / TE on CPU) and, by default,
  ``moe_grouped_gemm=False`` (``SequentialMLP`` experts);
* with ``moe_grouped_gemm=True`` (verl's ``override_transformer_config.moe_grouped_gemm=True``; mbridge's
  own default for Qwen3-MoE) build the experts as on GPUs, Megatron's ``TEGroupedMLP``, over hdp's CPU
  stand-in of TransformerEngine's grouped linear (:mod:`hdp.megatron_compat.grouped_experts`: the same
  ``experts.linear_fc1.weight{i}`` parameters mbridge maps);
* translate the local parameter names to the TE names mbridge maps, so loading, EP expert
  numbering and export (``export_weights``) stay mbridge's own code.

DeepSeek-V3 (:class:`LocalDeepseekV3Bridge`): Megatron's local MLA layer (its latent norms ``q_layernorm`` /
``kv_layernorm`` under the TE names mbridge maps, ``linear_q_up_proj.layer_norm_weight`` /
``linear_kv_up_proj.layer_norm_weight``; the input norm stays ``input_layernorm``), shared experts without their
CUDA-stream overlap, and the checkpoint read as it is in any dtype (mbridge reads DeepSeek-V3 through its FP8
dequantising reader, for bfloat16 only); its MLA config keyword renamed as on GPUs
(:class:`hdp.integrations.verl.compat.MLAConfigNames`).

:func:`register` puts them into mbridge's registry under "qwen3", "qwen3_moe", "qwen2", "llama" and "deepseek_v3".
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional

from mbridge.core.bridge import Bridge, register_model
from mbridge.models.deepseek_v3 import DeepseekV3Bridge
from mbridge.models.llama import LLaMABridge
from mbridge.models.qwen2 import Qwen2Bridge
from mbridge.models.qwen3 import Qwen3Bridge
from mbridge.models.qwen3moe import Qwen3MoEBridge

from hdp.integrations.verl.compat import MLAConfigNames

__all__ = ["LocalQwen3Bridge", "LocalQwen3MoEBridge", "LocalQwen2Bridge", "LocalLlamaBridge", "LocalDeepseekV3Bridge",
           "register", "te_name"]

_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_CPU_FLAGS = {
    "moe_grouped_gemm": False,
    "use_cpu_initialization": True,
    "persist_layer_norm": False,
    "bias_activation_fusion": False,
    "bias_dropout_fusion": False,
    "masked_softmax_fusion": False,
    "gradient_accumulation_fusion": False,
    "apply_rope_fusion": False,
}


def te_name(name: str, dense_norm_fused: bool, mla: bool = False) -> str:
    """The TransformerEngine-layout name mbridge maps for a local-spec parameter name (``mla``: Megatron's MLA
    layer, whose latent norms TE fuses into the up-projections and whose input norm stays apart)."""
    if mla:
        name = name.replace(".self_attention.q_layernorm.weight", ".self_attention.linear_q_up_proj.layer_norm_weight")
        name = name.replace(".self_attention.kv_layernorm.weight",
                            ".self_attention.linear_kv_up_proj.layer_norm_weight")
    else:
        name = name.replace(".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight")
    if dense_norm_fused:
        name = name.replace(".pre_mlp_layernorm.weight", ".mlp.linear_fc1.layer_norm_weight")
    return _EXPERT.sub(lambda m: f".mlp.experts.{m.group(2)}.weight{m.group(1)}", name)


def _sp_norms(block: Any) -> Any:
    """The block spec with Megatron's torch norms replaced by hdp's ``HdpNorm`` (same torch module, runs
    under sequence parallelism, which ``WrappedTorchNorm`` refuses; TE's norms do this on GPUs)."""
    import dataclasses

    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from hdp.trainer.model import HdpNorm

    def swap(sub: Any, *names: str) -> Any:
        new = {n: HdpNorm for n in names if getattr(sub, n, None) is WrappedTorchNorm}
        return dataclasses.replace(sub, **new) if new else sub

    layers = []
    for layer in block.layer_specs:
        sub = swap(layer.submodules, "input_layernorm", "pre_mlp_layernorm")
        attn = sub.self_attention
        sub = dataclasses.replace(sub, self_attention=dataclasses.replace(
            attn, submodules=swap(attn.submodules, "q_layernorm", "k_layernorm", "kv_layernorm")))
        layers.append(dataclasses.replace(layer, submodules=sub))
    out = dataclasses.replace(block, layer_specs=layers)
    return swap(out, "layer_norm")


class _LocalSpec:
    """Mixin: local layer spec, CPU-safe flags, local -> TE parameter names."""

    _dense_norm_fused = True
    _mla = False
    _cpu_flags: dict[str, Any] = {}
    """Further CPU-safe flags of the family."""

    def _build_base_config(self, text_config_key: Any = None, **kwargs: Any) -> Any:
        kwargs.update(_CPU_FLAGS, **self._cpu_flags)
        return super()._build_base_config(text_config_key, **kwargs)  # type: ignore[misc]

    def _get_transformer_layer_spec(self, vp_stage: Optional[int] = None) -> Any:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        from hdp.megatron_compat.grouped_experts import with_te_grouped_experts

        self.has_vp_stage = True
        spec = get_gpt_decoder_block_spec(self.config, use_transformer_engine=False, vp_stage=vp_stage)  # type: ignore[attr-defined]
        if self.config.moe_grouped_gemm:  # type: ignore[attr-defined]
            # TE's experts, as mbridge builds them on GPUs (the local spec's would be the legacy GroupedMLP)
            spec = dataclasses.replace(spec, layer_specs=[with_te_grouped_experts(s) for s in spec.layer_specs])
        return _sp_norms(spec)

    def _weight_name_mapping_mcore_local_to_global(self, model: Any, consider_ep: bool = True) -> dict[str, str]:
        base = super()._weight_name_mapping_mcore_local_to_global(model, consider_ep=False)  # type: ignore[misc]
        out = {k: te_name(v, self._dense_norm_fused, self._mla) for k, v in base.items()}
        mpu = self.mpu  # type: ignore[attr-defined]
        if consider_ep and mpu.ep_size > 1:  # local expert i on EP rank r is global expert i + r * E/EP
            per_rank = self.config.num_moe_experts // mpu.ep_size  # type: ignore[attr-defined]
            for k, v in out.items():
                if ".mlp.experts.linear_fc" in v:
                    prefix, local = v.split(".weight")
                    out[k] = f"{prefix}.weight{int(local) + per_rank * mpu.ep_rank}"
        return out


class LocalQwen3Bridge(_LocalSpec, Qwen3Bridge):
    """Qwen3 (dense) on the local spec."""


class LocalQwen3MoEBridge(_LocalSpec, Qwen3MoEBridge):
    """Qwen3-MoE on the local spec (``pre_mlp_layernorm`` is mapped by the MoE bridge itself)."""

    _dense_norm_fused = False


class LocalQwen2Bridge(_LocalSpec, Qwen2Bridge):
    """Qwen2 (dense, QKV bias) on the local spec."""


class LocalLlamaBridge(_LocalSpec, LLaMABridge):
    """Llama (2 / 3.x) on the local spec."""


class LocalDeepseekV3Bridge(_LocalSpec, MLAConfigNames, DeepseekV3Bridge):
    """DeepSeek-V3 (MLA, DeepSeek MoE with shared experts, dense first layers) on the local spec."""

    _dense_norm_fused = False  # the dense layers' pre_mlp_layernorm is mapped by the bridge itself
    _mla = True
    _cpu_flags = {"moe_shared_expert_overlap": False}  # the overlap runs the shared experts on a CUDA stream

    def _get_transformer_layer_spec(self, vp_stage: Optional[int] = None) -> Any:
        """The local MLA spec with hdp's core attention: Megatron's local ``DotProductAttention`` does not take
        MLA's ``k_channels`` / ``v_channels`` (TE's does); verl's hdp engine swaps it for its own anyway."""
        from hdp.core.attention_spec import HdpCoreAttention

        block = super()._get_transformer_layer_spec(vp_stage)
        layers = []
        for layer in block.layer_specs:
            attn = layer.submodules.self_attention
            attn = dataclasses.replace(attn, submodules=dataclasses.replace(attn.submodules,
                                                                            core_attention=HdpCoreAttention))
            layers.append(dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules,
                                                                                    self_attention=attn)))
        return dataclasses.replace(block, layer_specs=layers)

    def _get_safetensor_io(self, weights_path: str) -> Any:
        """The checkpoint as it is (mbridge's DeepSeek-V3 reader dequantises FP8 and takes bfloat16 only)."""
        return Bridge._get_safetensor_io(self, weights_path)


def register() -> None:
    """Make mbridge's ``AutoBridge`` build Qwen3 / Qwen3-MoE / Qwen2 / Llama / DeepSeek-V3 with the local spec."""
    register_model("qwen3")(LocalQwen3Bridge)
    register_model("qwen3_moe")(LocalQwen3MoEBridge)
    register_model("qwen2")(LocalQwen2Bridge)
    register_model("llama")(LocalLlamaBridge)
    register_model("deepseek_v3")(LocalDeepseekV3Bridge)
