"""`ModelShape`: the shape of a transformer as the planner needs it (pure, no torch).

One frozen description of a model — layers, widths, heads, experts, vocabulary, dtype — that the
cost model's ``auto`` preset (`ModelShape.cost_preset`) and the memory model read.  Built from an
hdp `ModelConfig` by the library engine, from a Hugging Face config by the verl engine
(`from_hf_config`), or taken from `SHAPES` by name on the command line.

Counting conventions: parameters exclude the embedding and the output layer (what the linear
FLOPs per token scale with, as in the cost model's ``a ≈ N_active / (n_layers · d_attn)``); a gated
MLP (SwiGLU) has 3 · H · F weights, a plain one 2 · H · F.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["ModelShape", "SHAPES", "get_shape"]

_DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """A transformer's shape (every count per model, widths in elements)."""

    name: str = "custom"
    """Name shown in plans and errors."""
    num_layers: int
    """L: transformer layers."""
    hidden_size: int
    """H: model width."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (GQA)."""
    head_dim: int
    """Query/key head width."""
    ffn_hidden_size: int
    """Dense MLP width (dense layers; the shared expert's width is ``shared_ffn_hidden_size``)."""
    vocab_size: int
    """Vocabulary."""
    num_experts: int = 0
    """Routed experts per MoE layer (0: dense)."""
    topk: int = 0
    """Experts each token is routed to."""
    moe_ffn_hidden_size: int = 0
    """Routed expert MLP width."""
    shared_ffn_hidden_size: int = 0
    """Shared-expert MLP width (0: none)."""
    gated: bool = True
    """Gated MLP (SwiGLU: fc1 is 2F wide) or plain (GELU)."""
    dtype_bytes: int = 2
    """Bytes per parameter / activation element (bf16: 2, fp32: 4)."""
    v_head_dim: int | None = None
    """Value head width when it differs from ``head_dim`` (MLA); ``None``: ``head_dim``."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "ffn_hidden_size",
                     "vocab_size", "dtype_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ModelShape.{name}={v!r}: pass a positive integer")
        for name in ("num_experts", "topk", "moe_ffn_hidden_size", "shared_ffn_hidden_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"ModelShape.{name}={v!r}: pass an integer >= 0")
        if self.num_experts and not (1 <= self.topk <= self.num_experts and self.moe_ffn_hidden_size >= 1):
            raise ValueError(
                f"ModelShape {self.name!r}: num_experts={self.num_experts} needs 1 <= topk <= num_experts "
                f"(topk={self.topk}) and moe_ffn_hidden_size >= 1 (it is {self.moe_ffn_hidden_size})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelShape.num_kv_heads={self.num_kv_heads}: must divide num_heads={self.num_heads}")

    @property
    def is_moe(self) -> bool:
        """Whether the MLPs are mixture-of-experts layers."""
        return self.num_experts > 0

    @property
    def attn_dim(self) -> int:
        """Query width per token: heads × head dim."""
        return self.num_heads * self.head_dim

    @property
    def kv_elems(self) -> int:
        """K plus V elements per token per layer."""
        return self.num_kv_heads * (self.head_dim + (self.v_head_dim or self.head_dim))

    def _mlp(self, width: int) -> int:
        return (3 if self.gated else 2) * self.hidden_size * width

    def attention_params(self) -> int:
        """Weights of one attention block (Q, K, V, output projection)."""
        v = self.v_head_dim or self.head_dim
        q = self.hidden_size * self.attn_dim
        kv = self.hidden_size * self.num_kv_heads * (self.head_dim + v)
        out = self.num_heads * v * self.hidden_size
        return q + kv + out

    def layer_params(self) -> int:
        """Weights of one layer (attention, every expert or the dense MLP, router, norms)."""
        if self.is_moe:
            mlp = self.num_experts * self._mlp(self.moe_ffn_hidden_size) + self.hidden_size * self.num_experts
            mlp += self._mlp(self.shared_ffn_hidden_size) if self.shared_ffn_hidden_size else 0
        else:
            mlp = self._mlp(self.ffn_hidden_size)
        return self.attention_params() + mlp + 2 * self.hidden_size

    def active_layer_params(self) -> int:
        """Weights one token meets in one layer (top-k experts only)."""
        if self.is_moe:
            mlp = self.topk * self._mlp(self.moe_ffn_hidden_size)
            mlp += self._mlp(self.shared_ffn_hidden_size) if self.shared_ffn_hidden_size else 0
        else:
            mlp = self._mlp(self.ffn_hidden_size)
        return self.attention_params() + mlp

    def embedding_params(self) -> int:
        """Input embedding plus output layer (untied)."""
        return 2 * self.vocab_size * self.hidden_size

    def cost_preset(self, name: str | None = None) -> Any:
        """The `hdp.packing.profiles.ModelPreset` of this shape: linear coefficient
        ``a = active params (no embeddings) / (L · d_attn)``, layers, attention and K/V widths, dtype."""
        from hdp.packing.profiles import ModelPreset

        a = self.num_layers * self.active_layer_params() / (self.num_layers * self.attn_dim)
        return ModelPreset(name=name or self.name, linear_coef=float(a), n_layers=self.num_layers,
                           attn_dim=self.attn_dim, kv_elems=self.kv_elems, dtype_bytes=self.dtype_bytes,
                           source=f"derived from the model's shape ({self.name})")

    @classmethod
    def from_hf_config(cls, cfg: Any, *, dtype: str = "bfloat16", name: str | None = None) -> "ModelShape":
        """The shape of a Hugging Face causal-LM config (Llama / Qwen2 / Qwen3 / Qwen3-MoE / Mixtral naming)."""
        get = cfg.get if isinstance(cfg, Mapping) else (lambda k, d=None: getattr(cfg, k, d))
        text = get("text_config", None)
        if text is not None:
            return cls.from_hf_config(text, dtype=dtype, name=name)
        missing = [k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
                   if get(k, None) is None]
        if missing:
            raise ValueError(f"model config: fields {missing} are missing; pass a Hugging Face causal-LM config")
        heads = int(get("num_attention_heads"))
        hidden = int(get("hidden_size"))
        experts = int(get("num_experts", None) or get("num_local_experts", None) or get("n_routed_experts", None) or 0)
        return cls(
            name=name or str(get("model_type", "hf")),
            num_layers=int(get("num_hidden_layers")),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(get("num_key_value_heads", None) or heads),
            head_dim=int(get("head_dim", None) or hidden // heads),
            ffn_hidden_size=int(get("intermediate_size", None) or 4 * hidden),
            vocab_size=int(get("vocab_size")),
            num_experts=experts,
            topk=int(get("num_experts_per_tok", None) or 0) if experts else 0,
            moe_ffn_hidden_size=int(get("moe_intermediate_size", None) or get("intermediate_size", None) or 0)
            if experts else 0,
            shared_ffn_hidden_size=int(get("shared_expert_intermediate_size", None) or 0),
            gated=str(get("hidden_act", "silu")) in ("silu", "swiglu"),
            dtype_bytes=_DTYPE_BYTES.get(str(dtype), 2),
        )


SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in (
        ModelShape(name="qwen3-235b-a22b", num_layers=94, hidden_size=4096, num_heads=64, num_kv_heads=4,
                   head_dim=128, ffn_hidden_size=12288, vocab_size=151936, num_experts=128, topk=8,
                   moe_ffn_hidden_size=1536),
        ModelShape(name="qwen3-30b-a3b", num_layers=48, hidden_size=2048, num_heads=32, num_kv_heads=4,
                   head_dim=128, ffn_hidden_size=6144, vocab_size=151936, num_experts=128, topk=8,
                   moe_ffn_hidden_size=768),
        ModelShape(name="dense-8b", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
                   head_dim=128, ffn_hidden_size=14336, vocab_size=128256),
        ModelShape(name="cpu-tiny", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=4, head_dim=64,
                   ffn_hidden_size=1024, vocab_size=512, gated=False, dtype_bytes=4),
    )
}
"""Model shapes by name (public configs: Qwen3-235B-A22B, Qwen3-30B-A3B, Llama-3-8B; the CPU demo GPT)."""


def get_shape(name: str | ModelShape) -> ModelShape:
    """A `ModelShape` by name (`SHAPES`); ValueError naming the known ones."""
    if isinstance(name, ModelShape):
        return name
    try:
        return SHAPES[name]
    except KeyError:
        raise ValueError(f"model={name!r} is unknown; choose one of: {', '.join(sorted(SHAPES))}") from None
