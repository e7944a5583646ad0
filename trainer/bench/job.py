"""The model of a `hdp bench train` job, and what its shape says about a step: model FLOPs and their utilisation.

A job's model (`TrainBenchSpec.model`) is one of

* ``tiny`` (the default): the bench's small GPT, its size from the spec's ``num_layers`` / ``hidden_size`` /
  ``num_attention_heads`` / ``vocab_size`` (what CI runs on CPU ranks);
* a shape preset by name (`hdp.packing.model_shape.SHAPES`: ``dense-8b``, ``qwen3-30b-a3b``,
  ``qwen3-235b-a22b``, ``cpu-tiny``);
* the path of a ``config.json`` (or of the model folder holding it): a Hugging Face causal-LM config (``num_hidden_layers``, Llama / Qwen2 / Qwen3 /
  Qwen3-MoE / Mixtral naming, `ModelShape.from_hf_config`) or a Megatron ``TransformerConfig`` written as JSON
  (``num_layers``, ``hidden_size``, ``num_attention_heads``, ``num_query_groups``, ``ffn_hidden_size``,
  ``kv_channels``, ``num_moe_experts``, ``moe_router_topk``, ``moe_ffn_hidden_size``, ``gated_linear_unit``,
  ``padded_vocab_size`` or ``vocab_size``).

``layers`` overrides the model's layer count (a slice of a large model on a few devices).  Weights are random:
the bench measures speed, not quality.  A shape hdp's GPT (`hdp.trainer.model.ModelConfig`) cannot build --
shared experts, MLA's separate value head width -- is refused, naming the field, rather than timed as
something else.

**Model FLOPs** (`train_flops`, the usual MFU convention: what the model needs, not what recompute adds):
per sample of n tokens, forward = 2 n (L · active weights per layer + H · V) for the matrix products (the
output layer included, the embedding lookup not) + 2 L · Hq · (d + dv) · n(n+1)/2 for causal attention's two
products; a training step = 3 × forward.  Sliding windows are not discounted.  **MFU** = achieved model FLOP/s
per device / the device's peak: ``--peak-tflops``, else `PEAK_TFLOPS` by the device's name (bf16 dense,
vendors' datasheets); none on CPU or an unknown device (the result says so).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["MODEL_CHOICES", "PEAK_TFLOPS", "model_shape", "model_config", "train_flops", "peak_tflops"]

MODEL_CHOICES = ("tiny",)
"""Model names besides the shape presets (`hdp.packing.model_shape.SHAPES`) and a config.json path."""

PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("H800", 989.0),
    ("H20", 148.0),
    ("A100", 312.0),
    ("A800", 312.0),
)
"""Dense bf16 TFLOP/s per device by a substring of its name (the first match), from NVIDIA's datasheets (no
sparsity).  An NPU or another device: pass ``--peak-tflops``."""

MAX_CONFIG_BYTES = 4 << 20
"""Largest config.json read."""


def _read_config(path: Path) -> dict[str, Any]:
    from hdp.packing.cost_file import read_bounded_text

    fix = "pass a shape preset name, 'tiny', or a Hugging Face / Megatron config.json"
    text = read_bounded_text(path, MAX_CONFIG_BYTES, "--model", fix)
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"--model={str(path)!r}: not valid JSON ({exc}); {fix}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"--model={str(path)!r}: holds a JSON {type(doc).__name__}, not a config object; {fix}")
    return doc


def _megatron_shape(cfg: Mapping[str, Any], name: str) -> Any:
    """The `ModelShape` of a Megatron ``TransformerConfig`` as JSON."""
    from hdp.packing.model_shape import ModelShape

    def need(key: str) -> int:
        v = cfg.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"--model={name!r}: field {key!r} is {v!r}; a Megatron config needs a positive integer")
        return v

    hidden, heads = need("hidden_size"), need("num_attention_heads")
    vocab = cfg.get("padded_vocab_size") or cfg.get("vocab_size")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise ValueError(f"--model={name!r}: field 'padded_vocab_size' / 'vocab_size' is {vocab!r}; add the vocabulary "
                         "size (a Megatron config.json has no tokenizer)")
    experts = int(cfg.get("num_moe_experts") or 0)
    ffn = int(cfg.get("ffn_hidden_size") or 4 * hidden)
    return ModelShape(
        name=str(cfg.get("name", "megatron")), num_layers=need("num_layers"), hidden_size=hidden, num_heads=heads,
        num_kv_heads=int(cfg.get("num_query_groups") or heads), head_dim=int(cfg.get("kv_channels") or hidden // heads),
        ffn_hidden_size=ffn, vocab_size=vocab, num_experts=experts,
        topk=int(cfg.get("moe_router_topk") or 2) if experts else 0,
        moe_ffn_hidden_size=int(cfg.get("moe_ffn_hidden_size") or ffn) if experts else 0,
        shared_ffn_hidden_size=int(cfg.get("moe_shared_expert_intermediate_size") or 0),
        gated=bool(cfg.get("gated_linear_unit", False)),
    )


def model_shape(spec: Any) -> Any:
    """The `hdp.packing.model_shape.ModelShape` of the job's model (``spec``: a `TrainBenchSpec`), its layers
    overridden by ``spec.layers``; ValueError naming ``--model`` and the fix."""
    import dataclasses

    from hdp.packing.model_shape import SHAPES, ModelShape

    name = spec.model
    if name in (None, "tiny"):
        shape = ModelShape(name="tiny", num_layers=spec.num_layers, hidden_size=spec.hidden_size,
                           num_heads=spec.num_attention_heads, num_kv_heads=spec.num_attention_heads,
                           head_dim=spec.hidden_size // spec.num_attention_heads, ffn_hidden_size=4 * spec.hidden_size,
                           vocab_size=spec.vocab_size, gated=False, dtype_bytes=4)
    elif name in SHAPES:
        shape = SHAPES[name]
    elif os.path.exists(name):
        path = Path(name) / "config.json" if os.path.isdir(name) else Path(name)  # a model folder: its config.json
        cfg = _read_config(path)
        if "num_hidden_layers" in cfg or "text_config" in cfg:
            try:
                shape = ModelShape.from_hf_config(cfg, name=path.parent.name or "hf")
            except ValueError as exc:
                raise ValueError(f"--model={name!r}: {exc}") from None
        elif "num_layers" in cfg:
            shape = _megatron_shape(cfg, name)
        else:
            raise ValueError(f"--model={name!r}: neither a Hugging Face config (num_hidden_layers) nor a Megatron one "
                             "(num_layers); pass a model's config.json")
    else:
        raise ValueError(f"--model={name!r}: no such file and no shape preset of that name; choose tiny, "
                         f"{', '.join(sorted(SHAPES))}, or the path of a config.json")
    if spec.layers is not None:
        shape = dataclasses.replace(shape, num_layers=spec.layers)
    if shape.shared_ffn_hidden_size:
        raise ValueError(f"--model={name!r}: shared experts (width {shape.shared_ffn_hidden_size}) are not built by hdp's "
                         "GPT (ModelConfig has none); time a model without them")
    if shape.v_head_dim not in (None, shape.head_dim):
        raise ValueError(f"--model={name!r}: a value head width ({shape.v_head_dim}) other than the key's (MLA) is not "
                         "built by hdp's GPT")
    return shape


def model_config(spec: Any, dtype: str, max_sequence_length: int) -> Any:
    """The `hdp.trainer.model.ModelConfig` of the job's model (`model_shape`), parameters in ``dtype``."""
    from hdp.trainer.model import ModelConfig

    shape = model_shape(spec)
    moe = shape.num_experts > 0
    return ModelConfig(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size, num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads if shape.num_kv_heads != shape.num_heads else None,
        kv_channels=shape.head_dim if shape.head_dim * shape.num_heads != shape.hidden_size else None,
        ffn_hidden_size=shape.ffn_hidden_size, vocab_size=shape.vocab_size, max_sequence_length=max_sequence_length,
        num_moe_experts=shape.num_experts if moe else None, moe_router_topk=shape.topk if moe else 2,
        moe_ffn_hidden_size=shape.moe_ffn_hidden_size if moe else None,
        activation="swiglu" if shape.gated else "gelu", params_dtype=dtype, recompute=spec.recompute,
    )


def train_flops(shape: Any, lengths: Sequence[int]) -> float:
    """Model FLOPs of one training step (forward + backward) over samples of ``lengths`` (see the module
    docstring)."""
    tokens = float(sum(lengths))
    pairs = float(sum(n * (n + 1) / 2 for n in lengths))  # causal (query, key) pairs
    dv = shape.v_head_dim or shape.head_dim
    linear = 2.0 * tokens * (shape.num_layers * shape.active_layer_params() + shape.hidden_size * shape.vocab_size)
    attention = 2.0 * shape.num_layers * shape.num_heads * (shape.head_dim + dv) * pairs
    return 3.0 * (linear + attention)


def peak_tflops(device_name: str, given: float | None) -> tuple[float | None, str]:
    """(the peak TFLOP/s per device MFU is taken against, where it comes from): ``given``, else `PEAK_TFLOPS` by
    name, else (None, why)."""
    if given is not None:
        return float(given), "--peak-tflops"
    for key, value in PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            return value, f"datasheet bf16 dense ({key})"
    return None, f"no peak known for {device_name!r}: pass --peak-tflops"
