"""Checks of verl settings the hdp engine cannot honour, each naming the verl key, the value and the fix.

Pure functions on plain attribute values: no verl import, so hdp's config classes, the engine and the driver's
job checks (run around verl's ``validate_config``: :func:`check_job_actor`, :func:`check_job_layout`,
:func:`check_job_batching`, on verl's OmegaConf config) share them.  Every check runs before any collective (at
config time, in the driver, or when the engine is constructed), so every rank raises the same ``ValueError``.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ACTOR_KEY",
    "REF_KEY",
    "CRITIC_KEY",
    "role_key",
    "check_parallel_size",
    "check_token_budgets",
    "check_remove_padding",
    "check_ulysses",
    "check_fused_kernels",
    "FUSED_IMPL_BACKENDS",
    "uses_fused_logprobs",
    "check_actor_config",
    "check_per_token_loss",
    "check_model_features",
    "check_value_model_building",
    "check_engine_settings",
    "check_shared_layout",
    "check_job_actor",
    "check_job_critic",
    "check_job_layout",
    "check_job_batching",
    "check_dynamic_bsz",
    "MEGATRON_CONFIG_HINT",
]

ACTOR_KEY = "actor_rollout_ref.actor"
REF_KEY = "actor_rollout_ref.ref"
CRITIC_KEY = "critic"


def role_key(engine_config: Any) -> str:
    """The verl config key of an engine config: ``critic`` for the critic's (hdp's critic config says so in
    ``megatron.role``), ``actor_rollout_ref.ref`` for the reference model's (verl's ref configs set
    ``forward_only: True``), else ``actor_rollout_ref.actor``."""
    if getattr(engine_config, "role", None) == "critic":
        return CRITIC_KEY
    return REF_KEY if bool(getattr(engine_config, "forward_only", False)) else ACTOR_KEY


def check_parallel_size(value: Any, key: str) -> None:
    """A Megatron parallel size must be an integer >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key}={value!r}: pass a positive integer (1: no such parallelism)")


def _check_budget(value: Any, key: str, what: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(
            f"{key}={value!r}: the hdp engine takes it as {what} (tokens one rank holds per round); "
            f"pass a positive integer, or set {ACTOR_KEY}.hdp.max_tokens_per_rank"
        )


def check_token_budgets(*, hdp_budget: Any, budgets: dict[str, Any]) -> None:
    """verl's per-GPU token budgets (``key -> value``) are hdp's token budget when
    ``actor.hdp.max_tokens_per_rank`` is null: each must then be a positive integer (or unset)."""
    if hdp_budget is not None:
        return
    for key, value in budgets.items():
        _check_budget(value, key, "its token budget")


def check_remove_padding(value: Any, key: str = "actor_rollout_ref.model.use_remove_padding") -> None:
    """hdp runs verl's no-padding (THD) batches only."""
    if value is not None and not bool(value):
        raise ValueError(
            f"{key}={value!r}: the hdp engine packs samples without padding (THD) and would ignore it; "
            "set it to True"
        )


FUSED_IMPL_BACKENDS = ("torch",)
"""``fused_kernel_options.impl_backend`` values hdp honours: its fused log-prob path is torch (chunked matrix
products over tokens × vocabulary, `hdp.fused_logprobs`)."""


def check_fused_kernels(value: Any, options: Any = None, key: str = "actor_rollout_ref.model") -> None:
    """verl's ``<key>.use_fused_kernels=True`` means hdp's fused log-prob path (`hdp.fused_logprobs`: log-probs
    and entropies from the last hidden states and the output weight, never the [T, V/TP] logits), per-sample
    temperatures and ``calculate_sum_pi_squared`` included.  Each of verl's ``<key>.fused_kernel_options`` is
    honoured or refused by name: ``impl_backend`` ``torch`` (verl's default) is what hdp runs; ``triton`` and
    ``liger`` (verl's kernels) are refused, as is any key verl does not define.  Options are read only when
    fused kernels are on (verl ignores them otherwise)."""
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{key}.use_fused_kernels={value!r}: pass True (hdp's fused log-prob path) or False")
    if not value or options is None:
        return
    if not hasattr(options, "items"):
        raise ValueError(f"{key}.fused_kernel_options={options!r}: pass a mapping (e.g. {{impl_backend: torch}})")
    for name, opt in options.items():
        if name == "impl_backend":
            if opt is not None and opt not in FUSED_IMPL_BACKENDS:
                raise ValueError(
                    f"{key}.fused_kernel_options.impl_backend={opt!r} with {key}.use_fused_kernels=True: the hdp engine "
                    "runs its own fused log-prob path, in torch (chunked matrix products over tokens x vocabulary, "
                    "exact, vocabulary-parallel under TP), not verl's triton / liger kernels; set impl_backend=torch")
        else:
            raise ValueError(f"{key}.fused_kernel_options.{name}={opt!r}: not an option of verl's fused kernels hdp "
                             "knows (verl defines impl_backend); remove it")


def uses_fused_logprobs(engine_config: Any) -> bool:
    """Whether an engine runs hdp's fused log-prob path: its ``use_fused_kernels`` (which verl's worker copies
    from ``<role>.model.use_fused_kernels``), except the critic's — a value head has no log-probs (verl's
    Megatron engine turns fused kernels off for value models too)."""
    return bool(getattr(engine_config, "use_fused_kernels", False)) and role_key(engine_config) != CRITIC_KEY


def check_per_token_loss(value: Any, key: str) -> None:
    """hdp's rounds return verl's globally normalised loss per group (Megatron's per-micro-batch regime)."""
    if value is not None and bool(value):
        raise ValueError(
            f"{key}={value!r}: hdp's round loop returns verl's globally normalised loss per group (Megatron's "
            "per-micro-batch regime), not the per-token 3-tuple; remove the override (MoE aux/z losses then follow "
            "Megatron's per-micro-batch scaling)"
        )


def check_ulysses(value: Any, key: str) -> None:
    """Ulysses sequence parallelism is FSDP's; hdp gives long samples context parallelism itself."""
    if value is not None and value != 1:
        raise ValueError(
            f"{key}={value!r}: Ulysses sequence parallelism is not used by the hdp engine (hdp gives each "
            "long sample a context-parallel group sized to its length); set it to 1"
        )


def check_actor_config(actor: Any) -> None:
    """The hdp checks of a verl actor/ref config (verl's ``ActorConfig`` or hdp's ``HdpActorConfig``)
    at config time: token budgets and Ulysses."""
    engine = getattr(actor, "megatron", None) or getattr(actor, "fsdp_config", None) or getattr(actor, "engine", None)
    key = role_key(engine)
    hdp = getattr(actor, "hdp", None)
    hdp_budget = getattr(hdp, "max_tokens_per_rank", None) if hdp is not None else None
    budget_key = "log_prob_max_token_len_per_gpu" if key == REF_KEY else "ppo_max_token_len_per_gpu"
    budgets = {f"{key}.{budget_key}": getattr(actor, "ppo_max_token_len_per_gpu", None)}
    check_token_budgets(hdp_budget=hdp_budget, budgets=budgets)
    check_ulysses(getattr(actor, "ulysses_sequence_parallel_size", 1), f"{key}.ulysses_sequence_parallel_size")
    if engine is not None:
        check_ulysses(getattr(engine, "ulysses_sequence_parallel_size", 1), f"{key}.fsdp_config.ulysses_sequence_parallel_size")


def check_model_features(model_config: Any, engine_config: Any) -> None:
    """verl features the hdp engine's round loop does not carry, each refused naming its key: fused-kernel
    options other than hdp's (`check_fused_kernels`), the per-token-loss regime, multi-token prediction,
    multimodal models.  Checked when the engine is constructed (the worker has filled in
    ``use_fused_kernels`` by then)."""
    key = role_key(engine_config)
    critic = key == CRITIC_KEY  # a value head: fused kernels do not apply (`uses_fused_logprobs`), nor their options
    check_fused_kernels(getattr(engine_config, "use_fused_kernels", False),
                        None if critic else getattr(model_config, "fused_kernel_options", None),
                        "critic.model" if critic else "actor_rollout_ref.model")
    overrides = getattr(engine_config, "override_transformer_config", None) or {}
    check_per_token_loss(overrides.get("calculate_per_token_loss", False),
                         f"{key}.megatron.override_transformer_config.calculate_per_token_loss")
    mtp = getattr(model_config, "mtp", None)
    if mtp is not None and getattr(mtp, "enable", False):
        raise ValueError("actor_rollout_ref.model.mtp.enable=True: multi-token prediction is not supported by the "
                         "hdp engine; set it to False")
    if getattr(getattr(model_config, "hf_config", None), "vision_config", None) is not None:
        raise ValueError("actor_rollout_ref.model.path is a multimodal model (hf_config.vision_config is set): "
                         "multimodal inputs / 3-D position ids are not supported by the hdp engine")


def check_value_model_building(verl_version: str, vanilla_mbridge: Any, key: str = CRITIC_KEY) -> None:
    """A value model (the critic) built through vanilla mbridge needs verl 0.9.1: verl 0.9.0's
    ``MegatronEngine._build_tf_config`` hands ``share_embeddings_and_output_weights=False`` to mbridge as an extra
    argument of Megatron's ``TransformerConfig``, which megatron-core (0.16.1) refuses with a ``TypeError`` in the
    worker (stock verl 0.9.0's Megatron critic fails alike); verl 0.9.1 sets it on the built config.  ``key``: the
    role's verl key."""
    release = str(verl_version).split("+")[0]
    if bool(vanilla_mbridge) and (release == "0.9.0" or release.startswith("0.9.0.")):
        raise ValueError(
            f"{key}.megatron.vanilla_mbridge=True with verl {verl_version}: verl 0.9.0 builds a value model's "
            "Megatron config with share_embeddings_and_output_weights, which megatron-core's TransformerConfig "
            "refuses (stock verl 0.9.0's Megatron critic fails alike; verl 0.9.1 fixed it). Upgrade verl to train a "
            "critic on hdp: pip install 'verl==0.9.1'")


def check_engine_settings(model_config: Any, engine_config: Any) -> None:
    """Settings the worker filled in that hdp cannot take, each naming the verl key:
    ``model.use_remove_padding=False``, ``use_dynamic_bsz=False`` (`check_dynamic_bsz`: verl's worker copies the
    actor's and the ref's into their engine configs, hdp's critic config the critic's) and non-positive token
    budgets (verl's per-GPU budgets are hdp's when ``hdp.max_tokens_per_rank`` is null)."""
    key = role_key(engine_config)
    check_dynamic_bsz(getattr(engine_config, "use_dynamic_bsz", True), key)
    check_remove_padding(getattr(model_config, "use_remove_padding", True),
                         "critic.model.use_remove_padding" if key == CRITIC_KEY else "actor_rollout_ref.model.use_remove_padding")
    if key == REF_KEY:
        budgets = {f"{REF_KEY}.log_prob_max_token_len_per_gpu": engine_config.infer_max_token_len_per_gpu}
    elif key == CRITIC_KEY:  # verl's v1 trainer sets both of the critic's budgets from its infer budget
        budgets = {f"{CRITIC_KEY}.ppo_infer_max_token_len_per_gpu": engine_config.infer_max_token_len_per_gpu,
                   f"{CRITIC_KEY}.ppo_max_token_len_per_gpu": engine_config.max_token_len_per_gpu}
    else:
        budgets = {
            f"{ACTOR_KEY}.ppo_max_token_len_per_gpu": engine_config.max_token_len_per_gpu,
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": engine_config.infer_max_token_len_per_gpu,
        }
    check_token_budgets(hdp_budget=engine_config.hdp.max_tokens_per_rank, budgets=budgets)


def check_shared_layout(engine_config: Any, built: dict[str, int]) -> None:
    """Engines of one process share Megatron's parallel state, built by the first engine constructed there
    (verl builds the critic's, then the ref's and the actor's in one worker process): ``built`` (its
    ``tensor_model_parallel_size``, ``pipeline_model_parallel_size``, ``expert_model_parallel_size``) must be
    this engine's own layout, else its model would be cut for another one."""
    key = role_key(engine_config)
    for name, got in built.items():
        want = getattr(engine_config, name)
        if want != got:
            raise ValueError(
                f"{key}.megatron.{name}={want!r}: this process's Megatron parallel state was already built with "
                f"{name}={got} by the engine constructed before this one (verl builds the critic's, the ref's and the "
                "actor's engines in one process); give actor, ref and critic the same layout")


def _select(config: Any, key: str, default: Any = None) -> Any:
    from omegaconf import OmegaConf

    value = OmegaConf.select(config, key, default=default)
    return default if value is None else value


def _hdp_roles(config: Any, ref: bool = True, critic: bool = True) -> list[str]:
    """The verl config keys of the roles that run on hdp (the ref's and the critic's when the job has them)."""
    keys = [ACTOR_KEY] + ([REF_KEY] if ref else []) + ([CRITIC_KEY] if critic else [])
    roles = {key: _select(config, f"{key}.megatron.strategy", _select(config, f"{key}.strategy", "")) for key in keys}
    return [key for key, strategy in roles.items() if strategy == "hdp"]


MEGATRON_CONFIG_HINT = (
    "actor_rollout_ref.actor.strategy=hdp on verl's Megatron config (ppo_megatron_trainer or "
    "model_engine=megatron) would silently run verl's stock Megatron engine: verl's McoreActorConfig "
    "keeps its engine's strategy 'megatron' and its ref config hard-codes strategy=megatron. "
    "Add the override model_engine=hdp (keeps every actor_rollout_ref.actor.megatron.* option and adds "
    "actor_rollout_ref.actor.hdp.*), or use --config-name hdp_ppo_trainer"
)
"""The error for ``actor.strategy=hdp`` on verl's Megatron actor config (:func:`check_job_actor`)."""


def check_job_actor(config: Any) -> None:
    """hdp's checks of an actor that asks for hdp through one of verl's own actor configs (verl's OmegaConf job
    config; the driver runs them before verl's ``validate_config``), where hdp's config classes never run:

    * ``actor.strategy=hdp`` on verl's Megatron actor config (a ``megatron`` node, no ``hdp`` node): verl would
      run its stock Megatron engine, so it is refused naming ``model_engine=hdp`` (:data:`MEGATRON_CONFIG_HINT`);
    * ``actor.strategy=hdp`` on verl's FSDP-shaped ``ppo_trainer`` (neither node): what `check_actor_config` and
      hdp's actor config check — the token budget, Ulysses, ``model.use_remove_padding``,
      ``model.use_fused_kernels``.  The engine checks them again when it is constructed (the ref's too, which
      verl builds only in the workers)."""
    if _select(config, f"{ACTOR_KEY}.strategy", "") != "hdp" or _select(config, f"{ACTOR_KEY}.hdp") is not None:
        return
    if _select(config, f"{ACTOR_KEY}.megatron") is not None:
        raise ValueError(MEGATRON_CONFIG_HINT)
    check_token_budgets(hdp_budget=None, budgets={f"{ACTOR_KEY}.ppo_max_token_len_per_gpu":
                                                  _select(config, f"{ACTOR_KEY}.ppo_max_token_len_per_gpu")})
    check_ulysses(_select(config, f"{ACTOR_KEY}.ulysses_sequence_parallel_size", 1),
                  f"{ACTOR_KEY}.ulysses_sequence_parallel_size")
    check_ulysses(_select(config, f"{ACTOR_KEY}.fsdp_config.ulysses_sequence_parallel_size", 1),
                  f"{ACTOR_KEY}.fsdp_config.ulysses_sequence_parallel_size")
    check_remove_padding(_select(config, "actor_rollout_ref.model.use_remove_padding", True))
    check_fused_kernels(_select(config, "actor_rollout_ref.model.use_fused_kernels", False))


def check_job_layout(config: Any, *, ref: bool = True, critic: bool = True) -> None:
    """hdp's checks of a whole verl job's layout (verl's OmegaConf config; the driver runs them before verl's
    own ``validate_config``, which builds the roles' configs): each hdp role's Megatron CP settings (the ref's
    and the critic's too, which verl otherwise meets only in the workers, after Ray started) and the critic's
    layout against the actor's (one process, one Megatron parallel state).  ``ref`` / ``critic``: the job has
    them (verl's ``need_reference_policy`` / ``need_critic``).  No-op when no role runs on hdp."""
    on_hdp = _hdp_roles(config, ref, critic)
    for key in on_hdp:
        cp = _select(config, f"{key}.megatron.context_parallel_size", 1)
        if cp != 1:
            raise ValueError(f"{key}.megatron.context_parallel_size={cp}: hdp gives each long sample a CP group sized to "
                             "its length over the whole DP x CP domain; set 1 (bound a rank's tokens with "
                             f"{ACTOR_KEY}.ppo_max_token_len_per_gpu or hdp.max_tokens_per_rank)")
        if bool(_select(config, f"{key}.megatron.dynamic_context_parallel", False)):
            raise ValueError(f"{key}.megatron.dynamic_context_parallel=True: hdp replaces Megatron's dynamic CP; set False")
    if CRITIC_KEY in on_hdp and _select(config, f"{ACTOR_KEY}.megatron") is not None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size"):
            mine, actor = _select(config, f"{CRITIC_KEY}.megatron.{name}", 1), _select(config, f"{ACTOR_KEY}.megatron.{name}", 1)
            if mine != actor:
                raise ValueError(f"{CRITIC_KEY}.megatron.{name}={mine} but {ACTOR_KEY}.megatron.{name}={actor}: verl "
                                 "builds the critic's and the actor's engines in one process, on one Megatron parallel "
                                 "state; give them the same layout")


def check_job_critic(config: Any, *, critic: bool, verl_version: str) -> None:
    """The critic's model building on this verl (:func:`check_value_model_building`), in the driver: no-op without
    a critic on hdp."""
    if critic and CRITIC_KEY in _hdp_roles(config, ref=False, critic=True):
        check_value_model_building(verl_version, _select(config, f"{CRITIC_KEY}.megatron.vanilla_mbridge", False))


# Each role's dynamic-batch-size switch, its micro-batch size and its token budget (verl's keys under the role):
# the actor's update (its log-prob pass must match it: verl asserts rollout.log_prob_use_dynamic_bsz equal), the
# ref's log-prob pass (verl's worker renames these to the ref's use_dynamic_bsz, ...) and the critic's passes.
_BATCHING_KEYS = {
    ACTOR_KEY: ("use_dynamic_bsz", "ppo_micro_batch_size_per_gpu", "ppo_max_token_len_per_gpu"),
    REF_KEY: ("log_prob_use_dynamic_bsz", "log_prob_micro_batch_size_per_gpu", "log_prob_max_token_len_per_gpu"),
    CRITIC_KEY: ("use_dynamic_bsz", "ppo_micro_batch_size_per_gpu", "ppo_max_token_len_per_gpu"),
}


def check_dynamic_bsz(value: Any, role: str, *, micro_batch: Any = None, longest: int = 0) -> None:
    """hdp packs every round by tokens: a role's ``use_dynamic_bsz=False`` (micro-batches of a number of
    samples) would be ignored, so it is refused, for every role alike (``role``: its verl key, e.g.
    ``critic``).  ``micro_batch``: the role's micro-batch size per GPU and ``longest``: the longest sample's
    tokens (prompt + response), when known, for the budget that bounds memory as the micro-batches did."""
    if value is None or bool(value):
        return
    switch, micro_key, budget_key = _BATCHING_KEYS[role]
    hint = (f" (the tokens of {micro_batch} samples of the longest length, {micro_batch} x {longest} = "
            f"{int(micro_batch) * longest}, bound a rank's memory as stock's micro-batches did)"
            ) if micro_batch and longest else ""
    raise ValueError(f"{role}.{switch}=False: hdp packs every round by tokens, not by a number of samples per "
                     f"micro-batch ({role}.{micro_key} would be ignored); set {switch}=True and {role}.{budget_key} "
                     f"to the tokens one rank may hold per round{hint}")


def check_job_batching(config: Any, *, ref: bool = True, critic: bool = True) -> None:
    """hdp's checks of how a verl job batches its roles (the driver, after verl's own ``validate_config``): every hdp
    role's ``use_dynamic_bsz`` (`check_dynamic_bsz`; ``ref`` / ``critic``: the job has them) and the
    old-log-prob option (`hdp.integrations.verl.old_log_prob.resolve`: ``true`` on a step that needs the pass)."""
    from hdp.integrations.verl import old_log_prob

    on_hdp = _hdp_roles(config, ref, critic)
    if ACTOR_KEY not in on_hdp:
        return
    longest = int(_select(config, "data.max_prompt_length", 0)) + int(_select(config, "data.max_response_length", 0))
    for key in on_hdp:
        switch, micro_key, _ = _BATCHING_KEYS[key]
        check_dynamic_bsz(_select(config, f"{key}.{switch}", True), key,
                          micro_batch=_select(config, f"{key}.{micro_key}"), longest=longest)
    old_log_prob.resolve(config)
