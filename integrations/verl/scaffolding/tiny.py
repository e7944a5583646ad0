"""Tiny Qwen3 / Qwen3-MoE checkpoints (and the other families hdp computes exactly: Llama 3.1, Qwen3 with
YaRN, Qwen2 with a sliding window, Mistral) with random weights and a small tokenizer, built locally.

Nothing is downloaded: the config comes from ``transformers``' ``Qwen3Config`` / ``Qwen3MoeConfig`` (and
``LlamaConfig`` / ``Qwen2Config`` / ``MistralConfig``: :data:`FAMILIES`, :func:`family_config`),
the weights from a seeded random init, the tokenizer from ``tokenizers``' ``WordLevel`` model (one
token per word, digit or symbol) with a Qwen-style chat template, all written with ``save_pretrained``.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["VOCAB", "build_tokenizer", "build_tiny", "family_config", "FAMILIES", "PAD", "EOS"]

PAD = "<|endoftext|>"
EOS = "<|im_end|>"
_SPECIAL = [PAD, "<|im_start|>", EOS]
_WORDS = (
    [" ", "\n"]  # whitespace is kept as tokens: verl's Qwen token builder needs "\n" to be one token
    + [str(d) for d in range(10)]
    + list("+-*/=?.,:")
    + "what is the answer user assistant system you are a helpful please compute sum of and".split()
    + [f"w{i}" for i in range(87)]
)
VOCAB = len(_SPECIAL) + len(_WORDS) + 1  # + <unk>; 128: Megatron splits it over TP 2 without padding columns
_CHAT = (  # Qwen's ChatML layout
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(path: str | Path) -> None:
    """Save a word-level tokenizer (pad ``<|endoftext|>``, eos ``<|im_end|>``, chat template) at ``path``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(_SPECIAL + _WORDS + ["<unk>"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\s"), behavior="isolated"),  # " " and "\n" are tokens of their own
        pre_tokenizers.Split(Regex(r"[0-9]|[+\-*/=?.,:]"), behavior="isolated"),
    ])
    tok.decoder = decoders.Fuse()  # tokens carry their own whitespace
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token="<unk>", chat_template=_CHAT,
        additional_special_tokens=["<|im_start|>"],
    )
    fast.save_pretrained(str(path))


FAMILIES = ("qwen3", "llama3.1", "qwen3-yarn", "qwen2-window", "mistral-window", "deepseek-v3")
"""The tiny families :func:`family_config` builds (besides the Qwen3-MoE of :func:`build_tiny`)."""

WINDOW = 6
"""The sliding window of the tiny windowed families (HF ``sliding_window``: keys up to 5 positions back):
shorter than the CP chunks of the tests' long samples, so windows cross chunk boundaries and whole ring steps
fall outside them."""


def family_config(family: str, *, layers: int = 2, vocab: int = VOCAB) -> object:
    """The HF config of a tiny model of ``family`` (:data:`FAMILIES`): hidden 32, 4 query / 2 KV heads of dim
    16 (Mistral: 8), SwiGLU 64, untied embeddings, fp32.

    * ``llama3.1``: ``rope_type: llama3`` (factor 8, low/high 1/4, theta 5e5) with a pretraining length of 32
      so that short test samples already cross its smoothing band;
    * ``qwen3-yarn``: ``rope_type: yarn`` (factor 4 over a pretraining length of 32: attention factor 1.139);
    * ``qwen2-window``: Qwen2 (QKV bias) with ``use_sliding_window``: window :data:`WINDOW` on layers from
      ``max_window_layers`` = 1 on (layer 1 full, the others sliding);
    * ``mistral-window``: ``sliding_window`` :data:`WINDOW` on every layer (no mbridge bridge);
    * ``deepseek-v3``: multi-latent attention (q / kv latents of rank 16 / 12, query/key heads of 8 + a decoupled
      RoPE part of 4 with interleaved pairs, value heads of 6), YaRN (factor 4 over 32 positions, ``mscale`` 0.9 /
      ``mscale_all_dim`` 1: attention factor 0.986, softmax scale × 1.293), 3 layers of which the first is dense
      (``first_k_dense_replace`` 1), then MoE: 8 routed experts of width 16 in 4 groups, top-4 from the best 2
      groups (sigmoid scores plus the expert bias for the choice, normalised, × 2.5) and 2 shared experts.
    """
    from transformers import DeepseekV3Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=vocab, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=64, max_position_embeddings=1024, tie_word_embeddings=False,
                  pad_token_id=0, bos_token_id=None, eos_token_id=2, torch_dtype="float32")
    if family == "qwen3":
        return Qwen3Config(**common, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if family == "qwen3-yarn":
        return Qwen3Config(**common, head_dim=16, rope_parameters={
            "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 32})
    if family == "llama3.1":
        return LlamaConfig(**common, head_dim=16, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    if family == "qwen2-window":
        return Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                           use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    if family == "mistral-window":
        return MistralConfig(**common, head_dim=8, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                             sliding_window=WINDOW)
    if family == "deepseek-v3":
        ds = {k: v for k, v in common.items() if k not in ("num_hidden_layers", "num_key_value_heads",
                                                           "max_position_embeddings")}
        return DeepseekV3Config(
            **ds, num_hidden_layers=max(layers, 3), num_key_value_heads=4, max_position_embeddings=128,
            q_lora_rank=16, kv_lora_rank=12,
            qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, rope_interleave=True,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0,
                             "mscale": 0.9, "mscale_all_dim": 1.0},
            first_k_dense_replace=1, moe_intermediate_size=16, n_routed_experts=8, n_shared_experts=2,
            num_experts_per_tok=4, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
            rms_norm_eps=1e-6)  # HF's latent norms (q_a / kv_a_layernorm) have eps 1e-6 whatever rms_norm_eps is
    raise ValueError(f"family={family!r}: choose one of {list(FAMILIES)}")


def build_tiny(path: str | Path, *, moe: bool = False, seed: int = 0, layers: int = 2, family: str = "qwen3") -> Path:
    """Save a tiny Qwen3 (or Qwen3-MoE: 4 experts, top-2; or another ``family`` of :func:`family_config`) with
    random weights and the tokenizer; returns ``path``.

    hidden 32, 4 query / 2 KV heads of dim 16, vocab :data:`VOCAB`, untied embeddings, fp32 weights.
    """
    from transformers import Qwen3Config, Qwen3MoeConfig

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    build_tokenizer(path)
    if family != "qwen3" and not moe:
        cfg = family_config(family, layers=layers)
        _save_random(cfg, path, seed)
        return path
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},  # Qwen3's base, not the 1e4 default
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=2,
        torch_dtype="float32",
    )
    if moe:
        cfg = Qwen3MoeConfig(
            **common, intermediate_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
            decoder_sparse_step=1, norm_topk_prob=True, router_aux_loss_coef=0.0, mlp_only_layers=[],
        )
    else:
        cfg = Qwen3Config(**common, intermediate_size=64)
    _save_random(cfg, path, seed)
    return path


def _save_random(cfg: object, path: Path, seed: int) -> None:
    """``AutoModelForCausalLM`` of ``cfg`` with seeded random weights (norms in [0.5, 1.5], biases O(0.1)), saved."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # non-trivial norms and biases so a mis-mapped one shows up
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)
            elif name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
                p.normal_(0.0, 0.02)  # HF's fused expert weights (left uninitialised by from_config)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's router bias: it changes the choice
                b.normal_(0.0, 0.1)
    model.save_pretrained(str(path))
