"""The model families hdp computes exactly, checked against HF ``transformers``' own model on the same weights
through both doors (the tests and ``hdp bench models`` share this).

A family (:data:`CASES`) is a tiny HF checkpoint (:func:`hdp.integrations.verl.scaffolding.tiny.family_config`)
plus what it exercises: a RoPE frequency variant (``llama3``, ``yarn``), a sliding window (every layer, or a
per-layer pattern), softmax sinks (``off-by-one``, or learned as gpt-oss's), a custom ``softmax_scale``,
DeepSeek-V3's multi-latent attention and MoE (both doors with the case's expert parallelism and MoE zero-memory
level, :attr:`Case.ep` / :attr:`Case.zero_memory`).  The
reference is the HF model in one process, each sample whole; where HF's model class has no such setting
(sinks on Mistral, a custom scale on Qwen3), the reference gets it through HF's own extension points:
gpt-oss's ``eager_attention_forward`` registered as an attention implementation (it reads ``module.sinks``),
and the attention modules' ``scaling`` attribute.

* **library door** (:func:`library_door`): ``HdpEngine.build`` with a :class:`~hdp.trainer.model.ModelConfig`
  read from the HF config (:func:`model_config`) and the HF weights through ``init_fn`` (:func:`hf_init_fn`:
  Megatron's fused QKV and gate/up layouts), then ``engine.forward`` (log-probs) and one ``train_step``
  (token-mean NLL: loss and grad norm) against HF;
* **verl door** (:func:`verl_door`): verl's ``ActorRolloutRefWorker`` with ``model_engine=hdp`` building the
  model with mbridge (vanilla_mbridge) from the checkpoint — for the families mbridge knows (:attr:`Case.mbridge`)
  — then ``compute_log_prob`` and one ``update_actor`` against HF (verl's ``ppo_loss``).

Both runs put a sample longer than the token budget on a CP group (a window of :data:`tiny.WINDOW` crosses its
chunk boundaries).  Tolerances (float32, values O(1..10), summation orders differ): log-probs ``2e-5``
absolute, loss ``1e-5`` relative, grad norm ``1e-4`` relative.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

__all__ = ["Case", "CASES", "SINKS", "LOGP_TOL", "LOSS_RTOL", "NORM_RTOL", "reference_model", "hf_logprobs",
           "model_config", "hf_init_fn", "library_door", "verl_door"]

LOGP_TOL = 2e-5
LOSS_RTOL = 1e-5
NORM_RTOL = 1e-4
SINKS = (-1.0, 0.5, 2.0, 0.0)
"""Learned sink logits of the 4 heads (both signs, one large): the library door's ``softmax_offset`` and the
HF reference's ``sinks``."""
_SINKS_ATTENTION = "hdp_reference_sinks"

LIBRARY_LENGTHS = (93, 12, 30, 9, 40, 7)
"""Library door samples: 93 > budget 48 puts the first on a CP group of 2."""
LIBRARY_BUDGET = 48
VERL_LENGTHS = ((5, 9), (3, 90), (7, 12), (4, 20), (6, 4), (2, 30))
"""verl door (prompt, response) samples: 93 tokens > budget 64 puts one on a CP group of 2."""
VERL_BUDGET = 64


@dataclass(frozen=True)
class Case:
    """One family row: which tiny checkpoint, what it exercises, what the reference adds."""

    hf: str
    """The :func:`~hdp.integrations.verl.scaffolding.tiny.family_config` name."""
    what: str
    """What it exercises (the model matrix's words)."""
    mbridge: bool
    """Whether mbridge (0.15) has a bridge for the family (the verl door builds it)."""
    sinks: str | None = None
    """``off-by-one`` / ``learnable``: the model has softmax sinks (the reference adds them)."""
    softmax_scale: float | None = None
    """A custom logit scale (the reference sets it on every attention module)."""
    model_kw: dict[str, Any] = field(default_factory=dict)
    """Extra :class:`~hdp.trainer.model.ModelConfig` fields of the library door."""
    ep: int = 1
    """Expert parallelism of both doors (MoE families)."""
    zero_memory: str = "none"
    """hdp's MoE zero-memory level of both doors (``none``, ``level0``, ``level1``)."""

    @property
    def overrides(self) -> list[str]:
        """verl's ``override_transformer_config`` entries (and EP, zero-memory) for the actor and the reference."""
        out = []
        for role in ("actor", "ref"):
            key = f"actor_rollout_ref.{role}.megatron.override_transformer_config"
            if self.sinks is not None:
                out.append(f"++{key}.softmax_type={self.sinks}")
            if self.softmax_scale is not None:
                out.append(f"++{key}.softmax_scale={self.softmax_scale}")
            if self.ep > 1:
                out.append(f"actor_rollout_ref.{role}.megatron.expert_model_parallel_size={self.ep}")
        if self.zero_memory != "none":
            out.append(f"actor_rollout_ref.actor.hdp.zero_memory={self.zero_memory}")
        return out


CASES: dict[str, Case] = {
    "llama3.1": Case("llama3.1", "RoPE rope_type llama3 (Llama 3.1 / 3.2 / 3.3)", mbridge=True),
    "qwen3-yarn": Case("qwen3-yarn", "RoPE rope_type yarn with its attention factor (Qwen3 past 32K)", mbridge=True),
    "qwen2-window": Case("qwen2-window", "sliding window on a per-layer pattern (Qwen2 use_sliding_window)",
                         mbridge=True),
    "mistral-window": Case("mistral-window", "sliding window on every layer (Mistral)", mbridge=False),
    "mistral-sinks": Case("mistral-window", "learned softmax sinks with a sliding window (gpt-oss style)",
                          mbridge=False, sinks="learnable"),
    "qwen3-off-by-one": Case("qwen3", "softmax_type off-by-one", mbridge=True, sinks="off-by-one"),
    "qwen3-scale": Case("qwen3", "custom softmax_scale", mbridge=True, softmax_scale=0.2),
    "deepseek-v3": Case("deepseek-v3", "multi-latent attention (decoupled interleaved RoPE, YaRN with mscale, Dv != D) "
                        "and DeepSeek MoE (sigmoid router with expert bias, group-limited top-k, shared experts, "
                        "dense first layer) under EP 2 and zero-memory level1", mbridge=True, ep=2,
                        zero_memory="level1"),
}
"""The families, by row name."""


# ---- the HF reference -------------------------------------------------------------------------------------


def _register_sinks_attention() -> None:
    """gpt-oss's eager attention (sinks read from ``module.sinks``) as an HF attention implementation, with the
    eager mask."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    AttentionInterface.register(_SINKS_ATTENTION, eager_attention_forward)
    AttentionMaskInterface.register(_SINKS_ATTENTION, eager_mask)


def reference_model(path: str, case: Case, sinks: Sequence[float] | None = None) -> torch.nn.Module:
    """The fp32 HF model of ``path`` with ``case``'s sinks (``sinks``: the learned values, or
    :data:`SINKS`) and scale."""
    from transformers import AutoModelForCausalLM

    kw: dict[str, Any] = {"dtype": torch.float32}
    if case.sinks is not None:
        _register_sinks_attention()
        kw["attn_implementation"] = _SINKS_ATTENTION
    model = AutoModelForCausalLM.from_pretrained(path, **kw)
    for layer in model.model.layers:
        attn = layer.self_attn
        if case.sinks == "off-by-one":
            attn.sinks = torch.zeros(model.config.num_attention_heads)
        elif case.sinks == "learnable":
            attn.sinks = torch.nn.Parameter(torch.tensor(sinks if sinks is not None else SINKS, dtype=torch.float32))
        if case.softmax_scale is not None:
            attn.scaling = case.softmax_scale
    return model


def hf_logprobs(model: torch.nn.Module, samples: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Per sample [L] log p(token t | tokens < t), 0 at t = 0 (each sample whole, batch of one)."""
    out = []
    for s in samples:
        ids = torch.tensor(list(s))[None]  # [1, L]
        logits = model(input_ids=ids).logits[0].float()  # [L, V]
        lp = torch.log_softmax(logits[:-1], dim=-1).gather(-1, ids[0, 1:, None])[:, 0]  # [L-1]
        out.append(torch.cat([lp.new_zeros(1), lp]))
    return out


# ---- the library door ---------------------------------------------------------------------------------------


def _deepseek_v3_config(hf_config: Any, max_sequence_length: int) -> Any:
    """The :class:`~hdp.trainer.model.ModelConfig` of a DeepSeek-V3 HF config (MLA, MoE with shared experts)."""
    from hdp.integrations.verl.rope import hf_rope_parameters, hf_rope_scaling
    from hdp.trainer.model import MLAConfig, ModelConfig

    c = hf_config
    layers = c.num_hidden_layers
    dense = min(int(c.first_k_dense_replace or 0), layers)
    return ModelConfig(
        num_layers=layers, hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
        ffn_hidden_size=c.intermediate_size, vocab_size=c.vocab_size, max_sequence_length=max_sequence_length,
        rotary_base=float(hf_rope_parameters(c)["rope_theta"]), rope_scaling=hf_rope_scaling(c),
        normalization="RMSNorm", norm_epsilon=c.rms_norm_eps, activation="swiglu", qk_layernorm=True,
        mla=MLAConfig(q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank, qk_head_dim=c.qk_nope_head_dim,
                      qk_pos_emb_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
                      rope_interleaved=bool(c.rope_interleave)),
        num_moe_experts=c.n_routed_experts, moe_router_topk=c.num_experts_per_tok,
        moe_ffn_hidden_size=c.moe_intermediate_size, moe_layer_freq=(0,) * dense + (1,) * (layers - dense),
        moe_shared_expert_intermediate_size=c.moe_intermediate_size * c.n_shared_experts,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_num_groups=c.n_group, moe_router_group_topk=c.topk_group,
        moe_router_topk_scaling_factor=c.routed_scaling_factor,
    )


def model_config(hf_config: Any, case: Case, *, max_sequence_length: int = 1024) -> Any:
    """The :class:`~hdp.trainer.model.ModelConfig` of a tiny HF config (Llama / Qwen2 / Qwen3 / Mistral /
    DeepSeek-V3)."""
    from hdp.integrations.verl.attention import hf_layer_windows
    from hdp.integrations.verl.rope import hf_rope_parameters, hf_rope_scaling
    from hdp.trainer.model import ModelConfig

    if hf_config.model_type == "deepseek_v3":
        return _deepseek_v3_config(hf_config, max_sequence_length)
    layers = hf_config.num_hidden_layers
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    windows = hf_layer_windows(hf_config, layers)
    lefts = {w for w in windows if w is not None}
    window_kw: dict[str, Any] = {}
    if lefts:
        (left,) = lefts
        window_kw = {"window_size": left}
        if any(w is None for w in windows):
            window_kw["window_attn_skip_freq"] = tuple(w is not None for w in windows)
    model_type = hf_config.model_type
    return ModelConfig(
        num_layers=layers, hidden_size=hf_config.hidden_size, num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads, kv_channels=head_dim,
        ffn_hidden_size=hf_config.intermediate_size, vocab_size=hf_config.vocab_size,
        max_sequence_length=max_sequence_length, rotary_base=float(hf_rope_parameters(hf_config)["rope_theta"]),
        rope_scaling=hf_rope_scaling(hf_config), normalization="RMSNorm", norm_epsilon=hf_config.rms_norm_eps,
        activation="swiglu", qk_layernorm=model_type == "qwen3", add_qkv_bias=model_type == "qwen2",
        softmax_type=case.sinks or "vanilla", softmax_scale=case.softmax_scale, **window_kw, **case.model_kw,
    )


def _qkv(state: dict[str, torch.Tensor], prefix: str, heads: int, groups: int, suffix: str) -> torch.Tensor:
    """Megatron's fused QKV rows: per query group, its query heads, then its key head, then its value head."""
    q, k, v = (state[f"{prefix}.{n}_proj.{suffix}"] for n in "qkv")
    per = heads // groups
    rest = q.shape[1:]
    q = q.reshape(groups, per, -1, *rest)  # [G, Hq/G, D, ...]
    k = k.reshape(groups, 1, -1, *rest)  # [G, 1, D, ...]
    v = v.reshape(groups, 1, -1, *rest)  # [G, 1, D, ...]
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)  # [G·(Hq/G+2)·D, ...]


_MLA_NAMES = {"self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
              "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
              "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
              "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
              "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
              "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
              "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
              "mlp.router.weight": "mlp.gate.weight",
              "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
              "mlp.shared_experts.linear_fc2.weight": "mlp.shared_experts.down_proj.weight"}
"""Megatron's MLA / DeepSeek-MoE names -> HF DeepSeek-V3's, per layer (same layouts: per head [nope, rope] rows
of q_b_proj, [nope, v] rows of kv_b_proj, [kv_lora, rope] rows of kv_a_proj_with_mqa)."""


def hf_init_fn(state: dict[str, torch.Tensor], hf_config: Any, sinks: Sequence[float] = SINKS) -> Any:
    """``init_fn(name, full)`` for ``HdpEngine.build``: each parameter of hdp's Megatron GPT from the HF weights
    (DeepSeek-V3: MLA's projections, the router and its expert bias, routed experts from HF's fused 3-D
    ``gate_up_proj`` / ``down_proj``, shared experts)."""
    heads = hf_config.num_attention_heads
    groups = getattr(hf_config, "num_key_value_heads", None) or heads
    direct = {"embedding.word_embeddings.weight": "model.embed_tokens.weight", "output_layer.weight": "lm_head.weight",
              "decoder.final_layernorm.weight": "model.norm.weight"}
    per_layer = {"input_layernorm.weight": "input_layernorm.weight",
                 "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
                 "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
                 "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
                 "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
                 "mlp.linear_fc2.weight": "mlp.down_proj.weight"}
    if hf_config.model_type == "deepseek_v3":
        per_layer.update(_MLA_NAMES)

    def init(name: str, full: torch.Tensor) -> None:
        if name in direct:
            full.copy_(state[direct[name]])
            return
        _, _, index, rest = name.split(".", 3)  # decoder.layers.{i}.{rest}
        hf = f"model.layers.{index}"
        expert = rest.startswith("mlp.experts.local_experts.")
        if expert:  # mlp.experts.local_experts.{j}.linear_fc{1,2}.weight (global expert j)
            j, proj = rest.split(".")[3], rest.split(".")[4]
            fused = state[f"{hf}.mlp.experts.{'gate_up_proj' if proj == 'linear_fc1' else 'down_proj'}"]
            full.copy_(fused[int(j)])  # [2F, H] (gate rows, then up) / [H, F]
        elif rest in per_layer:
            full.copy_(state[f"{hf}.{per_layer[rest]}"])
        elif rest == "mlp.shared_experts.linear_fc1.weight":
            full.copy_(torch.cat([state[f"{hf}.mlp.shared_experts.gate_proj.weight"],
                                  state[f"{hf}.mlp.shared_experts.up_proj.weight"]]))
        elif rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            full.copy_(_qkv(state, f"{hf}.self_attn", heads, groups, rest.rsplit(".", 1)[1]))
        elif rest == "mlp.linear_fc1.weight":
            full.copy_(torch.cat([state[f"{hf}.mlp.gate_proj.weight"], state[f"{hf}.mlp.up_proj.weight"]]))
        elif rest == "self_attention.core_attention.softmax_offset":
            full.copy_(torch.tensor(sinks, dtype=full.dtype))
        else:
            raise KeyError(f"no HF weight for {name}")

    return init


def _random_tokens(lengths: Sequence[int], vocab: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g) for n in lengths]


def library_door(rank: int, world: int, name: str, root: str, tp: int = 1) -> dict[str, Any]:
    """One family through ``HdpEngine.build`` on ``world`` gloo ranks (TP ``tp`` × a domain of the rest; the case's
    EP and MoE zero-memory level): log-probs, loss and grad norm against HF.  Returns ``{"logp_err", "loss_rel",
    "norm_rel", "cp_groups", "ok"}`` (the same on every rank)."""
    import torch.distributed as dist

    from hdp.integrations.verl.scaffolding.tiny import build_tiny
    from hdp.packing import cost_model
    from hdp.trainer.config import EngineConfig, ParallelConfig, PlanningConfig
    from hdp.trainer.engine import Batch, HdpEngine
    from hdp.trainer.model import OptimConfig

    case = CASES[name]
    path = os.path.join(root, f"lib-{name}")
    if rank == 0:
        build_tiny(path, family=case.hf)
    dist.barrier(group=dist.group.WORLD)
    ref = reference_model(path, case)
    state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    cfg = EngineConfig(
        model=model_config(ref.config, case),
        parallel=ParallelConfig(tp=tp, ep=case.ep),
        optim=OptimConfig(lr=1e-3),
        planning=PlanningConfig(max_tokens_per_rank=LIBRARY_BUDGET, cost_model=cost_model("cpu-tiny", "cpu-gloo"),
                                zero_memory=case.zero_memory),
        device="cpu",
    )
    engine = HdpEngine.build(cfg, dist.group.WORLD, init_fn=hf_init_fn(state, ref.config))
    try:
        tokens = _random_tokens(LIBRARY_LENGTHS, ref.config.vocab_size, seed=11)
        batch = Batch(tokens=tokens)
        plan = engine.plan(batch)
        got = engine.forward(batch, plan=plan).logprobs
        with torch.no_grad():
            want = hf_logprobs(ref, tokens)
        err = max(float((a.float() - b).abs().max()) for a, b in zip(got, want))
        metrics = engine.train_step(batch, plan=plan)
    finally:
        engine.close()
    n_tok = sum(len(t) - 1 for t in tokens)
    loss = -sum(w[1:].sum() for w in hf_logprobs(ref, tokens)) / n_tok
    loss.backward()
    norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in ref.parameters() if p.grad is not None))
    loss_rel = abs(float(metrics["loss"]) - loss.item()) / max(1.0, abs(loss.item()))
    norm_rel = abs(float(metrics["grad_norm"]) - norm) / norm
    return {"logp_err": err, "loss_rel": loss_rel, "norm_rel": norm_rel, "cp_groups": int((plan.group_size > 1).sum()),
            "ok": bool(err <= LOGP_TOL and loss_rel <= LOSS_RTOL and norm_rel <= NORM_RTOL)}


# ---- the verl door --------------------------------------------------------------------------------------------


def verl_door(rank: int, world: int, name: str, root: str) -> dict[str, Any]:
    """One family through verl's ``ActorRolloutRefWorker`` (``model_engine=hdp``, mbridge-built) on ``world`` gloo
    ranks: ``compute_log_prob`` and one ``update_actor`` (loss, grad norm) against HF with verl's ``ppo_loss``.
    Returns ``{"logp_err", "loss_rel", "norm_rel", "cp_groups", "ok"}`` (the same on every rank)."""
    import logging
    from functools import partial

    import torch.distributed as dist

    from hdp.integrations.verl.batch import sample_lengths
    from hdp.integrations.verl.scaffolding import batches as B
    from hdp.integrations.verl.scaffolding import install
    from hdp.integrations.verl.scaffolding.tiny import VOCAB, build_tiny
    from hdp.integrations.verl.scaffolding.worker import actor_worker, compose, environment_for_rank

    case = CASES[name]
    if not case.mbridge:
        raise ValueError(f"family {name!r}: mbridge has no bridge for {case.hf!r}; the verl door cannot build it")
    environment_for_rank(rank, world)
    install()
    from verl.utils import tensordict_utils as tu
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.metric.utils import reduce_metrics
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    logging.getLogger("verl").setLevel(logging.ERROR)
    path = os.path.join(root, f"verl-{name}")
    if rank == 0:
        build_tiny(path, family=case.hf)
    dist.barrier(group=dist.group.WORLD)
    n = len(VERL_LENGTHS)
    cfg = compose(path, budget=VERL_BUDGET, records=None, overrides=[
        f"actor_rollout_ref.actor.ppo_mini_batch_size={n}", "actor_rollout_ref.actor.optim.lr=1e-2",
        "actor_rollout_ref.actor.hdp.cost_model=cpu-tiny@cpu-gloo", "actor_rollout_ref.actor.hdp.auto_calibrate=false",
        "actor_rollout_ref.actor.use_kl_loss=false", "actor_rollout_ref.actor.entropy_coeff=0.0", *case.overrides])
    act = actor_worker(cfg, role="actor")
    engine = act.actor.engine
    samples = B.random_samples(VERL_LENGTHS, VOCAB, seed=1)
    padded = B.padded_batch(samples, pad_id=0)
    probe = B.ref_batch(padded)
    tu.assign_non_tensor(probe, max_token_len_per_gpu=VERL_BUDGET)
    plan = engine.planner.plan(sample_lengths(probe))
    flags = [None] * world
    dist.all_gather_object(flags, bool(engine.is_mp_src_rank_with_outputs()), group=dist.group.WORLD)
    src = flags.index(True)
    sinks = None
    if case.sinks == "learnable":  # the model's own (mbridge does not load them from an HF checkpoint)
        offset = engine.module[0].module.decoder.layers[0].self_attention.core_attention.softmax_offset
        sinks = offset.detach().float().tolist()
    out = act.compute_log_prob(B.old_logp_batch(padded))
    objs = [no_padding_2_padding(tu.get(out, "log_probs"), probe).float() if rank == src else None]
    got = list(tu.get(out, "log_probs").unbind()) if rank == src else None
    dist.broadcast_object_list(objs, src=src, group=dist.group.WORLD)
    adv = torch.randn(padded["responses"].shape, generator=torch.Generator().manual_seed(3)) * padded["response_mask"]
    extra = {"old_log_probs": objs[0], "advantages": adv, "ref_log_prob": objs[0]}
    upd = act.update_actor(B.update_batch(padded, extra, mini_batch_size=n, calculate_entropy=False))
    result: dict[str, Any] = {}
    if rank == src:
        ref = reference_model(path, case, sinks)
        with torch.no_grad():
            want = hf_logprobs(ref, [p + r for p, r in samples])
        # verl aligns log-probs with the inputs: position p holds log p(token p+1)
        err = max(float((a[:-1].float() - b[1:]).abs().max()) for a, b in zip(got, want))
        data = B.update_batch(padded, extra, mini_batch_size=n, calculate_entropy=False)
        mask = data["loss_mask"]
        n_tok = int(mask.values().sum() if mask.is_nested else mask.sum())
        tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=n_tok)
        aligned = [torch.cat([w[1:], w.new_zeros(1)]) for w in hf_logprobs(ref, [p + r for p, r in samples])]
        lp = torch.nested.as_nested_tensor(aligned, layout=torch.jagged)
        actor_cfg = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
        loss, _ = partial(ppo_loss, config=actor_cfg)(model_output={"log_probs": lp}, data=data)
        loss.backward()
        norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in ref.parameters() if p.grad is not None))
        m = reduce_metrics(tu.get(upd, "metrics"))
        loss_rel = abs(float(m["loss"]) - loss.item()) / max(1.0, abs(loss.item()))
        norm_rel = abs(float(m["grad_norm"]) - norm) / norm
        result = {"logp_err": err, "loss_rel": loss_rel, "norm_rel": norm_rel,
                  "cp_groups": int((plan.group_size > 1).sum()),
                  "ok": bool(err <= LOGP_TOL and loss_rel <= LOSS_RTOL and norm_rel <= NORM_RTOL)}
    box = [result]
    dist.broadcast_object_list(box, src=src, group=dist.group.WORLD)
    return box[0]
