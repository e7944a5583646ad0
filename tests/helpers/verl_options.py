"""Every option of verl that shapes the actor, reference or critic passes, and what hdp does with it: the table
the conformance suite is held to (tests/unit/verl/test_verl_conformance_table.py reads verl's own config classes and
registries and fails on anything missing here; tests/distributed/verl/test_verl_conformance.py runs the cases named
here).

Keys are ``Class.field`` for every field of verl's config dataclasses reached from ``McoreActorConfig`` (actor and
reference), ``McoreCriticConfig`` and ``AlgoConfig`` (recursively; fields that are themselves config dataclasses
are walked, not listed), and every value of the registries and choice lists verl validates (`VALUES`; refusals of
combinations: `CONDITIONAL_REFUSALS`).  Each has one entry:

* `Covered` — cases of the differential suite (tests/helpers/verl_conformance.py) run it on hdp and on verl's stock
  Megatron engine and compare;
* `Reference` — a layout or precision option checked by another test of hdp against a whole-batch reference
  (HF ``transformers``, every sample in one process), which stock's update equals in this suite;
* `Refused` — hdp refuses it with a config-time ``ValueError`` naming the key and the reason (the driver's
  ``validate_config`` with ``overrides``, or at engine construction where ``test`` checks it);
* `NoEffect` — it cannot make hdp's update differ from stock's, for a stated reason of one kind: ``not-read``
  (verl's Megatron worker path does not read it — checked against verl's source, `WORKER_SOURCES`), ``driver``
  (verl's driver reads it and builds the same batches for either engine), ``shared`` (hdp's engine runs verl's
  own code for it, inherited unchanged from the stock engine), ``logging``, ``inapplicable`` (read by verl only on
  a path hdp refuses, named), ``not-runnable`` (needs what this machine lacks, named: not compared).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass
from importlib.metadata import version as _version
from typing import Any, Callable, Union

VERL_090 = _version("verl").startswith("0.9.0")
"""verl 0.9.0 is installed (the plugin supports 0.9.0 and 0.9.1; a few verdicts differ)."""


@dataclass(frozen=True)
class Covered:
    """Run by these cases of the suite on hdp and stock."""

    cases: tuple[str, ...]
    note: str = ""


@dataclass(frozen=True)
class Reference:
    """Checked by ``test`` (``tests/file.py::function``) against a whole-batch reference."""

    test: str
    note: str


@dataclass(frozen=True)
class Refused:
    """A config-time ``ValueError`` matching ``match``: raised by the driver for ``overrides`` (verl keys on top of
    the suite's hdp job), or, for refusals at engine construction, checked by ``test``."""

    match: str
    overrides: tuple[str, ...] = ()
    test: str = ""


@dataclass(frozen=True)
class NoEffect:
    """Cannot change hdp's update against stock's: ``kind`` (see the module docstring) and why."""

    kind: str
    why: str


Entry = Union[Covered, Reference, Refused, NoEffect]
KINDS = ("not-read", "driver", "shared", "logging", "inapplicable", "not-runnable")

WORKER_SOURCES = (
    "workers/engine_workers.py", "workers/engine/base.py", "workers/engine/utils.py", "workers/engine/megatron",
    "workers/utils", "trainer/ppo/core_algos.py", "utils/megatron_utils.py", "utils/megatron", "models/mcore",
    "utils/checkpoint/megatron_checkpoint_manager.py", "workers/config/megatron_peft.py",
)
"""verl's files (under its package) that run in the Megatron worker path of the actor, reference and critic:
a ``not-read`` field's name appears in none of them."""

A = "actor_rollout_ref.actor"
_WP = "tests/slow/verl/test_verl_worker_path_slow.py::test_actor_rollout_ref_worker_drives_hdp"
_RR = "tests/slow/verl/test_verl_router_replay.py::test_router_replay_follows_tokens_through_hdp_packing"
_CF = "tests/unit/verl/test_verl_config.py::test_dropped_parent_features_are_rejected_at_construction"
_CK = "tests/slow/verl/test_verl_checkpoint_fit.py"

# ---- refusals ------------------------------------------------------------------------------------------------

_NO_DYNAMIC = Refused(r"actor_rollout_ref\.actor\.use_dynamic_bsz=False: hdp packs every round by tokens",
                      (f"{A}.use_dynamic_bsz=false", f"{A}.ppo_micro_batch_size_per_gpu=2",
                       "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=false",
                       "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2"))
_NO_DYNAMIC_CRITIC = Refused(r"critic\.use_dynamic_bsz=False: hdp packs every round by tokens",
                             ("algorithm.adv_estimator=gae", "critic.use_dynamic_bsz=false",
                              "critic.ppo_micro_batch_size_per_gpu=2"))
_PADDED = Refused(r"use_remove_padding=False: the hdp engine packs samples without padding",
                  ("actor_rollout_ref.model.use_remove_padding=false",))
_FUSED = Reference("tests/slow/verl/test_verl_fused_logprobs_slow.py::test_use_fused_kernels_runs_hdps_fused_path_equal_to_hf",
                   "honoured: hdp's fused log-prob path (log-probs, entropy, Σp² without [T, V/TP] logits), equal to "
                   "HF on the whole batch; stock's fused forward needs verl's kernels (not compared)")
_CP = Refused(r"context_parallel_size=2: hdp gives each long sample a CP group", (f"{A}.megatron.context_parallel_size=2",))
_DCP = Refused(r"dynamic_context_parallel=True: hdp replaces Megatron's dynamic CP",
               (f"{A}.megatron.dynamic_context_parallel=true", f"{A}.megatron.max_seqlen_per_dp_cp_rank=64"))
_KL_COV = Refused(r"policy_loss\.loss_mode=kl_cov .*neither a sum over samples", (f"{A}.policy_loss.loss_mode=kl_cov",))
_CLIP_COV = Refused(r"policy_loss\.loss_mode=clip_cov .*neither a sum over samples", (f"{A}.policy_loss.loss_mode=clip_cov",))
_MTP = Refused(r"mtp\.enable=True: multi-token prediction is not supported", test=_CF)
_PER_TOKEN = Refused(r"calculate_per_token_loss=True", test=_CF)

_HYDRA = NoEffect("shared", "Hydra's instantiation target of the config class")
_SELECT = NoEffect("shared", "selects the engine (hdp's or stock's): the differential suite's switch itself")
_LOG = NoEffect("logging", "verl's profiler (traces, not the update)")
_MODEL = NoEffect("shared", "names or loads the model: verl's model building, which hdp's engine runs unchanged "
                            "(MegatronEngine._build_megatron_module), from the same checkpoint for both")
_TOKENIZER = NoEffect("shared", "the tokenizer / processor: the rollout's and the driver's, and the pad id both engines read")
_NOT_READ = NoEffect("not-read", "verl's Megatron worker path does not read it (FSDP / HF engines only)")

# ---- fields: Class.field -> entry ------------------------------------------------------------------------------

FIELDS: dict[str, Entry] = {
    "BaseConfig._target_": _HYDRA,
    # the actor (and the reference: the same classes)
    "ActorConfig.calculate_entropy": Covered(("calculate-entropy", "no-entropy")),
    "ActorConfig.calculate_sum_pi_squared": Covered(("logprob-sum-pi-squared",)),
    "ActorConfig.clip_ratio": Covered(("clip-ratio",)),
    "ActorConfig.clip_ratio_c": Covered(("dual-clip",)),
    "ActorConfig.clip_ratio_high": Covered(("clip-low-high",)),
    "ActorConfig.clip_ratio_low": Covered(("clip-low-high",)),
    "ActorConfig.data_loader_seed": Covered(("shuffle",)),
    "ActorConfig.entropy_coeff": Covered(("base", "temperature")),
    "ActorConfig.freeze_vision_tower": _NOT_READ,
    "ActorConfig.global_batch_info": Covered(("base",), "verl's loss writes the mini-batch's normalisers into it on "
                                                       "every call (hdp's: the mini-batch's tokens, dp_size 1)"),
    "ActorConfig.kl_loss_coef": Covered(("base", "kl-k3")),
    "ActorConfig.kl_loss_type": Covered(("kl-k3",), "every value: VALUES['kl_loss_type']"),
    "ActorConfig.loss_agg_mode": Covered(("agg-token-mean",), "every value: VALUES['loss_agg_mode']"),
    "ActorConfig.loss_scale_factor": Covered(("loss-scale-factor",)),
    "ActorConfig.ppo_epochs": Covered(("epochs-minibatches", "shuffle")),
    "ActorConfig.ppo_infer_max_token_len_per_gpu": Covered(("logprob", "dynamic-budget"), "a token budget: hdp "
                                                           "packs its own rounds under it, stock its micro-batches"),
    "ActorConfig.ppo_infer_micro_batch_size_per_gpu": Covered(("logprob-fixed-micro-batches",), "stock's side; hdp "
                                                              "refuses use_dynamic_bsz=False"),
    "ActorConfig.ppo_max_token_len_per_gpu": Covered(("dynamic-budget",)),
    "ActorConfig.ppo_micro_batch_size": Covered(("fixed-micro-batches",), "stock's side (deprecated alias)"),
    "ActorConfig.ppo_micro_batch_size_per_gpu": Covered(("fixed-micro-batches",), "stock's side; hdp refuses "
                                                        "use_dynamic_bsz=False"),
    "ActorConfig.ppo_mini_batch_size": Covered(("epochs-minibatches",)),
    "ActorConfig.rollout_n": NoEffect("driver", "the driver's multiplier of ppo_mini_batch_size (the batch's "
                                                "mini_batch_size, the same for either engine)"),
    "ActorConfig.shuffle": Covered(("shuffle",)),
    "ActorConfig.tau_neg": Covered(("loss-sapo", "sapo-tau")),
    "ActorConfig.tau_pos": Covered(("loss-sapo", "sapo-tau")),
    "ActorConfig.use_dynamic_bsz": _NO_DYNAMIC,
    "ActorConfig.use_fused_kernels": _FUSED,
    "ActorConfig.use_kl_loss": Covered(("base",)),
    "ActorConfig.use_prefix_grouper": NoEffect("driver", "the legacy trainer's batch balancing (hdp balances for "
                                                         "stock's DP size through that same function)"),
    "ActorConfig.use_torch_compile": _NOT_READ,
    "McoreActorConfig.entropy_from_logits_chunk_size": Covered(("entropy-chunking",)),
    "McoreActorConfig.entropy_from_logits_with_chunking": Covered(("entropy-chunking",)),
    "McoreActorConfig.profile": _LOG,
    "McoreActorConfig.strategy": _SELECT,
    "McoreActorConfig.use_rollout_log_probs": _NOT_READ,
    # the policy loss
    "PolicyLossConfig.loss_mode": Covered(("loss-vanilla",), "every value: VALUES['policy_loss.loss_mode']"),
    "PolicyLossConfig.dro_beta": Covered(("loss-dro",)),
    "PolicyLossConfig.clip_cov_lb": _CLIP_COV,
    "PolicyLossConfig.clip_cov_ratio": _CLIP_COV,
    "PolicyLossConfig.clip_cov_ub": _CLIP_COV,
    "PolicyLossConfig.kl_cov_ratio": _KL_COV,
    "PolicyLossConfig.ppo_kl_coef": _KL_COV,
    # rollout correction (algorithm.rollout_correction, and the actor's policy_loss.rollout_correction in bypass mode)
    "RolloutCorrectionConfig.bypass_mode": Covered(("bypass-v1", "bypass-ppo_clip-token")),
    "RolloutCorrectionConfig.loss_type": Covered(("bypass-ppo_clip-token", "bypass-reinforce-token")),
    "RolloutCorrectionConfig.rollout_is": Covered(("rollout-is-token", "rollout-is-sequence")),
    "RolloutCorrectionConfig.rollout_is_batch_normalize": Covered(
        ("rollout-is-batch-normalize",), "decoupled mode; in bypass mode refused: CONDITIONAL_REFUSALS"),
    "RolloutCorrectionConfig.rollout_is_threshold": Covered(("rollout-is-token", "rollout-is-sequence")),
    "RolloutCorrectionConfig.rollout_rs": Covered(("rollout-rs-token_k1",), "every value: VALUES['rollout_correction.rollout_rs']"),
    "RolloutCorrectionConfig.rollout_rs_threshold": Covered(("rollout-rs-token_k1", "rollout-rs-seq_max_k2")),
    # optimizer
    "OptimizerConfig.betas": Covered(("optim",)),
    "OptimizerConfig.clip_grad": Covered(("optim",)),
    "OptimizerConfig.lr": Covered(("optim",)),
    "OptimizerConfig.weight_decay": Covered(("optim",)),
    "OptimizerConfig.grad_clip": _NOT_READ,
    "OptimizerConfig.lr_warmup_steps": NoEffect("shared", "verl's LR scheduler (get_megatron_optimizer_param_scheduler), "
                                                          "built and stepped by verl's code in either engine"),
    "OptimizerConfig.lr_warmup_steps_ratio": NoEffect("shared", "verl's LR scheduler, as lr_warmup_steps"),
    "OptimizerConfig.total_training_steps": NoEffect("shared", "verl's LR scheduler, as lr_warmup_steps"),
    # checkpoints
    "CheckpointConfig.save_contents": Covered(("checkpoint",)),
    "CheckpointConfig.load_contents": Covered(("checkpoint",)),
    "CheckpointConfig.async_save": NoEffect("shared", "verl's MegatronCheckpointManager, which hdp's engine runs "
                                                      "unchanged (its save/load wrap it with hdp's timeouts)"),
    "CheckpointConfig.strict": NoEffect("shared", "verl's MegatronCheckpointManager, as async_save"),
    "CheckpointConfig.save_lora_only": NoEffect("not-runnable", "LoRA (see HFModelConfig.lora)"),
    "McoreCheckpointConfig.mbridge_config": NoEffect("shared", "verl's MegatronCheckpointManager, as async_save"),
    # the engine (actor, reference, critic)
    "EngineConfig.dtype": Reference(_WP, "bfloat16 (the MoE case's reference model) against HF; the suite runs "
                                         "float32 on both engines"),
    "EngineConfig.forward_only": NoEffect("shared", "set by verl's worker for the reference (no optimizer); both "
                                                    "engines read it alike"),
    "EngineConfig.full_determinism": _NOT_READ,
    "EngineConfig.infer_max_token_len_per_gpu": Covered(("logprob",)),
    "EngineConfig.infer_micro_batch_size_per_gpu": Covered(("logprob-fixed-micro-batches",)),
    "EngineConfig.max_token_len_per_gpu": Covered(("dynamic-budget",)),
    "EngineConfig.micro_batch_size_per_gpu": Covered(("fixed-micro-batches",)),
    "EngineConfig.optimizer_offload": Reference(_WP, "on (MoE case) against HF; on CPU offloading moves nothing"),
    "EngineConfig.param_offload": Reference(_WP, "on (MoE case) against HF; on CPU offloading moves nothing"),
    "EngineConfig.seed": NoEffect("shared", "Megatron's RNG seed (verl's set_random_seed in the stock engine's "
                                            "constructor, which hdp's runs); weights come from the checkpoint"),
    "EngineConfig.use_dynamic_bsz": _NO_DYNAMIC,
    "EngineConfig.use_fused_kernels": _FUSED,
    "EngineConfig.use_remove_padding": _PADDED,
    "EngineRouterReplayConfig.mode": Covered(("router-replay-r2", "router-replay-r3")),
    "EngineRouterReplayConfig.record_file": _NOT_READ,
    "EngineRouterReplayConfig.replay_file": _NOT_READ,
    "McoreEngineConfig.context_parallel_size": _CP,
    "McoreEngineConfig.dynamic_context_parallel": _DCP,
    "McoreEngineConfig.max_seqlen_per_dp_cp_rank": _DCP,
    "McoreEngineConfig.dist_checkpointing_path": Reference(_CK, "verl's dist checkpoint format through verl's workers"),
    "McoreEngineConfig.dist_checkpointing_prefix": Reference(_CK, "as dist_checkpointing_path"),
    "McoreEngineConfig.use_dist_checkpointing": Reference(_CK, "as dist_checkpointing_path"),
    "McoreEngineConfig.dist_ckpt_optim_fully_reshardable": NoEffect("shared", "the optimizer checkpoint's layout in "
                                                                              "verl's MegatronCheckpointManager"),
    "McoreEngineConfig.distrib_optim_fully_reshardable_mem_efficient": NoEffect("shared", "as dist_ckpt_optim_fully_reshardable"),
    "McoreEngineConfig.entropy_from_logits_chunk_size": Covered(("entropy-chunking",)),
    "McoreEngineConfig.entropy_from_logits_with_chunking": Covered(("entropy-chunking",)),
    "McoreEngineConfig.expert_model_parallel_size": Reference(_RR, "EP 2 with a CP group in the plan, against HF"),
    "McoreEngineConfig.expert_tensor_parallel_size": Reference(_WP, "null (= TP), with EP 2; hdp's zero-memory "
                                                                    "refuses expert TP > 1"),
    "McoreEngineConfig.pipeline_model_parallel_size": Reference(_WP, "PP 2 x domain 2 against HF"),
    "McoreEngineConfig.virtual_pipeline_model_parallel_size": Reference(_WP, "PP 2 x 2 virtual stages against HF"),
    "McoreEngineConfig.tensor_model_parallel_size": Reference(_WP, "TP 2 (sequence parallel) x domain 2 against HF"),
    "McoreEngineConfig.sequence_parallel": Reference(_WP, "under TP 2 against HF"),
    "McoreEngineConfig.override_ddp_config": NoEffect("shared", "Megatron's DDP, built by verl's make_megatron_module "
                                                                "in either engine"),
    "McoreEngineConfig.override_mcore_model_config": NoEffect("shared", "the model verl builds, as override_ddp_config"),
    "McoreEngineConfig.override_transformer_config": Reference(_WP, "moe_grouped_gemm=True through it against HF; "
                                                                    "calculate_per_token_loss=True refused"),
    "McoreEngineConfig.pad_bshd_to_minibatch_max": NoEffect("inapplicable", "the padded (BSHD) path only: hdp refuses "
                                                                            "use_remove_padding=False"),
    "McoreEngineConfig.pad_to_length": Covered(("stock-pad-to-length",), "stock's packing only"),
    "McoreEngineConfig.pad_to_length_bucket": Covered(("stock-pad-to-length",), "stock's packing only"),
    "McoreEngineConfig.strategy": _SELECT,
    "McoreEngineConfig.use_distributed_optimizer": NoEffect("shared", "Megatron's optimizer, built by verl's "
                                                                      "_build_optimizer in either engine"),
    "McoreEngineConfig.use_mbridge": _MODEL,
    "McoreEngineConfig.vanilla_mbridge": NoEffect("not-runnable", "False selects Megatron-Bridge, not installed "
                                                                  "here (the suite builds through mbridge)"),
    "McoreEngineConfig.use_megatron_fsdp": NoEffect("not-runnable", "Megatron-FSDP: not run on CPU with either "
                                                                    "engine"),
    "QATEngineConfig.enable": NoEffect("not-runnable", "QAT needs Megatron-Bridge (verl's engine raises with "
                                                       "vanilla_mbridge)"),
    **{f"QATEngineConfig.{f}": NoEffect("not-runnable", "QAT (see QATEngineConfig.enable)") for f in (
        "activation_observer", "group_size", "ignore_patterns", "mode", "quantization_config_path")},
    **{f"QATConfig.{f}": NoEffect("not-runnable", "QAT (see QATEngineConfig.enable)") for f in (
        "activation_observer", "enable", "group_size", "ignore_patterns", "mode", "quantization_config_path")},
    # the model (actor_rollout_ref.model, critic.model)
    "HFModelConfig.use_remove_padding": _PADDED,
    "HFModelConfig.use_fused_kernels": _FUSED,
    "HFModelConfig.fused_kernel_options": Reference(
        "tests/unit/verl/test_verl_fused_logprobs.py::test_fused_kernel_options_are_honoured_or_refused_by_name",
        "impl_backend torch honoured; triton / liger and unknown keys refused by name"),
    **{f"HFModelConfig.{f}": _MODEL for f in (
        "architectures", "hf_config", "hf_config_path", "local_hf_config_path", "local_path", "path", "model_type",
        "override_config", "trust_remote_code", "external_lib", "use_shm")},
    **{f"HFModelConfig.{f}": _TOKENIZER for f in (
        "custom_chat_template", "generation_config", "load_tokenizer", "local_tokenizer_path", "processor",
        "tokenizer", "tokenizer_path")},
    **{f"HFModelConfig.{f}": _NOT_READ for f in (
        "enable_activation_offload", "enable_gradient_checkpointing", "exclude_modules", "lora_adapter_path",
        "lora_rank", "target_parameters", "tiled_mlp", "use_liger")},
    "HFModelConfig.lora": NoEffect("not-runnable", "LoRA: verl's Megatron engine takes it through Megatron-Bridge "
                                                   "only (megatron_peft asserts otherwise), not installed here"),
    "HFModelConfig.lora_alpha": NoEffect("not-runnable", "LoRA (see HFModelConfig.lora)"),
    "HFModelConfig.target_modules": NoEffect("not-runnable", "LoRA (see HFModelConfig.lora)"),
    **{f"MtpConfig.{f}": _MTP for f in (
        "detach_encoder", "enable", "enable_rollout", "enable_train", "method", "mtp_loss_scaling_factor",
        "num_speculative_tokens", "speculative_algorithm", "speculative_eagle_topk", "speculative_num_draft_tokens",
        "speculative_num_steps")},
    # the critic
    "CriticConfig.cliprange_value": Covered(("critic-value-clip",)),
    "CriticConfig.data_loader_seed": Covered(("critic-epochs-shuffle",)),
    "CriticConfig.enable": NoEffect("driver", "whether the driver builds a critic"),
    "CriticConfig.forward_max_token_len_per_gpu": Covered(("critic",)),
    "CriticConfig.loss_agg_mode": Covered(("critic-agg-token-mean",), "every value: VALUES['loss_agg_mode']"),
    "CriticConfig.loss_scale_factor": Covered(("critic-loss-scale-factor",)),
    "CriticConfig.ppo_epochs": Covered(("critic-epochs-shuffle",)),
    "CriticConfig.ppo_infer_max_token_len_per_gpu": Covered(("critic",)),
    "CriticConfig.ppo_infer_micro_batch_size_per_gpu": Covered(("critic-fixed-micro-batches",), "stock's side"),
    "CriticConfig.ppo_max_token_len_per_gpu": Covered(("critic",)),
    "CriticConfig.ppo_micro_batch_size": Covered(("critic-fixed-micro-batches",), "stock's side"),
    "CriticConfig.ppo_micro_batch_size_per_gpu": Covered(("critic-fixed-micro-batches",), "stock's side"),
    "CriticConfig.ppo_mini_batch_size": Covered(("critic-epochs-shuffle",)),
    "CriticConfig.rollout_n": NoEffect("driver", "the driver's multiplier of ppo_mini_batch_size"),
    "CriticConfig.shuffle": Covered(("critic-epochs-shuffle",)),
    "CriticConfig.use_dynamic_bsz": _NO_DYNAMIC_CRITIC,
    "McoreCriticConfig.nccl_timeout": _NOT_READ,
    "McoreCriticConfig.strategy": _SELECT,
    # the profiler (every role)
    **{f"ProfilerConfig.{f}": _LOG for f in (
        "all_ranks", "enable", "finish_hook_all_ranks", "finish_hook_cmd", "finish_hook_ranks", "global_tool_config",
        "ranks", "relocate_results", "save_path", "tool", "tool_config")},
    # the algorithm: the driver's (advantages, in-reward KL, filtering) except rollout correction (above)
    **{f"AlgoConfig.{f}": NoEffect("driver", "the driver's advantages / rewards / sampling: the same batches for "
                                             "either engine") for f in (
        "adv_estimator", "gamma", "lam", "norm_adv_by_std_in_grpo", "use_kl_in_reward", "kl_penalty", "use_pf_ppo",
        "pf_ppo", "gdpo_reward_keys", "gdpo_reward_weights")},
    **{f"KLControlConfig.{f}": NoEffect("driver", "the in-reward KL controller (the driver's)") for f in (
        "horizon", "kl_coef", "target_kl", "type")},
    **{f"FilterGroupsConfig.{f}": NoEffect("driver", "DAPO's dynamic sampling (the driver's)") for f in (
        "enable", "max_inflight_gen_batches", "max_num_gen_batches", "metric")},
}


# ---- registries and choice lists ---------------------------------------------------------------------------------


def _strings_in(fn: Callable[..., Any], variable: str) -> set[str]:
    """String constants of ``fn``'s source that ``variable`` is assigned (a list/set/tuple literal) or compared to."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    out: set[str] = set()

    def consts(node: ast.AST) -> set[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value}
        if isinstance(node, (ast.List, ast.Set, ast.Tuple)):
            return {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
        return set()

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == variable for t in node.targets):
            out |= consts(node.value)
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Name) and node.left.id == variable:
            for comp in node.comparators:
                out |= consts(comp)
    return out


def policy_loss_modes() -> list[str]:
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    return sorted(POLICY_LOSS_REGISTRY)


def agg_modes() -> list[str]:
    """The values ``ActorConfig.__post_init__`` accepts (``valid_loss_agg_modes``)."""
    from verl.workers.config import ActorConfig

    return sorted(_strings_in(ActorConfig.__post_init__, "valid_loss_agg_modes"))


def kl_types() -> list[str]:
    """The values verl's ``kl_penalty_forward`` dispatches on, each also with the straight-through ``+``."""
    from verl.trainer.ppo.core_algos import kl_penalty_forward

    base = sorted(_strings_in(kl_penalty_forward, "kl_penalty"))
    return base + [f"{k}+" for k in base]


def rollout_is_levels() -> list[str]:
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights

    return sorted(_strings_in(compute_rollout_correction_weights, "valid_is_levels"))


def rollout_rs_options() -> list[str]:
    from verl.trainer.ppo.rollout_corr_helper import SUPPORTED_ROLLOUT_RS_OPTIONS

    return sorted(SUPPORTED_ROLLOUT_RS_OPTIONS)


def bypass_loss_types() -> list[str]:
    from verl.trainer.ppo.core_algos import compute_policy_loss_bypass_mode

    return sorted(_strings_in(compute_policy_loss_bypass_mode, "loss_type"))


def router_replay_modes() -> list[str]:
    from verl.workers.config.engine import EngineRouterReplayConfig

    return sorted(_strings_in(EngineRouterReplayConfig.__post_init__, "valid_modes"))


def adv_estimators() -> list[str]:
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY

    return sorted(ADV_ESTIMATOR_REGISTRY)


REFUSED_LOSSES = {"kl_cov": _KL_COV, "clip_cov": _CLIP_COV}
"""Policy losses hdp refuses (not additive over samples: `VERDICTS`)."""
REFUSED_KL = {"full": Refused(r"kl_loss_type=full: verl's kl_penalty cannot compute it",
                              (f"{A}.use_kl_loss=true", f"{A}.kl_loss_type=full")),
              "full+": Refused(r"kl_loss_type=full\+: verl's kl_penalty cannot compute it",
                               (f"{A}.use_kl_loss=true", f"{A}.kl_loss_type=full+"))}
"""kl_loss_type values hdp refuses at config time (verl's kl_penalty raises on them, in stock's engine too)."""

VERL_090_FIELDS: dict[str, Entry] = {
    "EngineConfig.grad_offload": NoEffect("shared", "verl 0.9.0 only: the gradient offload of verl's Megatron engine "
                                                    "between calls, which hdp's engine inherits unchanged (memory "
                                                    "placement; on CPU it moves nothing)"),
    "RouterReplayConfig.mode": FIELDS["EngineRouterReplayConfig.mode"],  # 0.9.0's actor-side name of the same field
    "RouterReplayConfig.record_file": _NOT_READ,
    "RouterReplayConfig.replay_file": _NOT_READ,
}
"""Fields verl 0.9.0 has and 0.9.1 does not (both are supported), classified as their 0.9.1 counterparts."""
NOT_IN_VERL_090 = ("ProfilerConfig.finish_hook_all_ranks", "ProfilerConfig.finish_hook_cmd",
                   "ProfilerConfig.finish_hook_ranks", "ProfilerConfig.relocate_results")
"""Fields of `FIELDS` that verl 0.9.1 added."""


def fields_for(version: str) -> dict[str, Entry]:
    """The field table for the installed verl ``version`` (`FIELDS` is 0.9.1's; 0.9.0 differs by the two above)."""
    if version.split("+")[0] == "0.9.0":
        return {**{k: v for k, v in FIELDS.items() if k not in NOT_IN_VERL_090}, **VERL_090_FIELDS}
    return dict(FIELDS)


VERDICTS: dict[str, object] = {
    "vanilla": "additive",
    "dppo_tv": "additive",
    "dppo_kl": "additive",
    # 0.9.0's GSPO aggregates with seq-mean-token-mean whatever loss_agg_mode says (as SAPO); 0.9.1's follows it
    "gspo": "additive-any-width" if VERL_090 else "additive",
    "sapo": "additive-any-width",  # aggregates with seq-mean-token-mean whatever loss_agg_mode says
    "gpg": "additive",
    "clip_cov": "refused",  # centring and a random top-k over the call's tokens
    "kl_cov": "refused",  # a top-k over the call's tokens
    "geo_mean": "sample-mean",  # GMPO: torch.mean over the call's rows, global information ignored
    "dro": "additive",
    "cispo": "additive",
    "bypass_mode": "additive",
}
"""What hdp does with each policy loss verl 0.9.1 registers ("additive": as stock; "sample-mean": normalised by
hdp; "refused": a config error) — the loss-kind probe's expected verdicts (tests/unit/verl/test_verl_loss_kinds.py
tests/distributed/verl/test_verl_loss_kinds_dist.py)."""

_LEVELS = ("token", "sequence")
_BYPASS = tuple(f"bypass-{t}-{lvl}" for t in ("ppo_clip", "reinforce") for lvl in _LEVELS)

VALUES: dict[str, tuple[Callable[[], list[str]], dict[str, Entry]]] = {
    "policy_loss.loss_mode": (policy_loss_modes, {
        **{m: Covered((f"loss-{m}",)) for m in ("vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "dro", "cispo")},
        "geo_mean": Covered(("loss-geo_mean",), "a mean over each call's rows: against stock with one micro-batch per DP "
                                               "rank of an equal share, where stock's objective is hdp's"),
        "bypass_mode": Covered(_BYPASS, "as verl's legacy trainer sets it (apply_bypass_mode)"),
        **REFUSED_LOSSES}),
    "loss_agg_mode": (agg_modes, {
        **{m: Covered((f"agg-{m}", f"critic-agg-{m}")) for m in ("token-mean", "token-sum", "seq-mean-token-sum",
                                                                 "seq-mean-token-mean")},
        "seq-mean-token-sum-norm": Covered(("loss-scale-factor", "critic-loss-scale-factor"), "with loss_scale_factor "
                                           "set; without it refused (CONDITIONAL_REFUSALS)")}),
    "kl_loss_type": (kl_types, {
        **{k: Covered((f"kl-{k}",)) for b in ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3") for k in (b, f"{b}+")},
        **REFUSED_KL}),
    "rollout_correction.rollout_is": (rollout_is_levels, {v: Covered((f"rollout-is-{v}", f"bypass-ppo_clip-{v}"))
                                                          for v in _LEVELS}),
    "rollout_correction.rollout_rs": (rollout_rs_options, {v: Covered((f"rollout-rs-{v}",)) for v in (
        "token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1", "seq_mean_k2",
        "seq_mean_k3", "seq_max_k2", "seq_max_k3")}),
    "rollout_correction.loss_type": (bypass_loss_types, {t: Covered(tuple(f"bypass-{t}-{lvl}" for lvl in _LEVELS))
                                                         for t in ("ppo_clip", "reinforce")}),
    "router_replay.mode": (router_replay_modes, {"disabled": Covered(("base",)), "R2": Covered(("router-replay-r2",)),
                                                 "R3": Covered(("router-replay-r3",))}),
    "algorithm.adv_estimator": (adv_estimators, {v: NoEffect("driver", "advantages are the driver's: both engines train "
                                                                       "on the same advantages") for v in (
        "gae", "gdpo", "gpg", "grpo", "grpo_passk", "grpo_vectorized", "opo", "optimal_token_baseline",
        "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "rloo", "rloo_vectorized",
        "tir_optimal_token_baseline")}),
}
"""Every value of the registries and choice lists verl validates: (the function that reads them from verl, an
entry per value).  A value verl adds fails tests/unit/verl/test_verl_conformance_table.py until it is listed here."""

CONDITIONAL_REFUSALS: dict[str, Refused] = {
    "actor loss_agg_mode=seq-mean-token-sum-norm without loss_scale_factor": Refused(
        r"loss_agg_mode=seq-mean-token-sum-norm with actor_rollout_ref\.actor\.loss_scale_factor=None",
        (f"{A}.loss_agg_mode=seq-mean-token-sum-norm",)),
    "critic loss_agg_mode=seq-mean-token-sum-norm without loss_scale_factor": Refused(
        r"critic\.loss_agg_mode=seq-mean-token-sum-norm with critic\.loss_scale_factor=None",
        ("algorithm.adv_estimator=gae", "critic.loss_agg_mode=seq-mean-token-sum-norm")),
    "bypass mode with rollout_is_batch_normalize=True": Refused(
        r"rollout_is_batch_normalize=True.*refused",
        ("trainer.use_v1=false", "actor_rollout_ref.rollout.calculate_log_probs=true",
         "algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.rollout_is=token",
         "algorithm.rollout_correction.rollout_is_batch_normalize=true")),
}
"""Refusals of a value in combination with others (each value alone is covered)."""
