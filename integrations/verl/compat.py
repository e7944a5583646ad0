"""The one module that touches verl's private parts (0.9.x): private names, scoped patches, and the engine-side
imports of verl's heavy modules.

Other modules of :mod:`hdp.integrations.verl` import verl's public API directly (``verl.utils.tensordict_utils``,
``verl.workers.config``, the loss functions, the trainer's config helpers); what is not public, or is changed
for the duration of a call, lives here, so a verl upgrade is checked in one place.  Private upstream state used
here, and why:

* ``EngineRegistry._engines`` — read only, to make registration idempotent: verl's
  ``EngineRegistry.register`` asserts on a duplicate key (verl/workers/engine/base.py:389), and the
  entry point may be loaded twice (``import verl`` in the driver and again in a Ray worker that
  imports this module directly).  Can go when verl offers ``is_registered``.
* :func:`without_megatron_strategy_assert` — ``McoreEngineConfig.__post_init__`` asserts
  ``strategy == "megatron"`` (verl/workers/config/engine.py:217); hdp's engine config subclasses it
  and keeps the rest of its validation by running it with the strategy set to ``"megatron"`` for the
  duration of the call.  Can go when verl drops the assert or accepts registered strategies.
* :func:`own_mini_batch_loop` — wraps ``TrainingWorker.train_mini_batch`` and
  ``tensordict_utils.make_iterator`` so an hdp engine's worker trains stock verl's mini-batches (and
  plans each next one ahead).
* :func:`dispatch_dp_size` / :func:`balance_batch_for_stock_dp` — a worker group's cached dispatch info
  (``_dispatch_info``), reported with stock's DP size while verl's trainer balances the batch.
* :func:`checkpoint_content_metadata` / :func:`model_sharded_state_dict` — ``MegatronCheckpointManager``'s
  ``_load_content_metadata`` and ``_build_model_sharded_state_dict``, read only: what verl's own load composes
  its sharded state dicts with, so that hdp checks a checkpoint against exactly what verl would load
  (:mod:`hdp.integrations.verl.checkpoint`).  Can go when verl checks a checkpoint before loading it.
* :func:`expose_rope_theta` — ``hf_config.rope_theta`` set from transformers 5's ``rope_parameters`` (verl's
  ``get_hf_rope_theta``) before mbridge's bridge is built, as verl's ``make_megatron_module`` sets it a step later:
  mbridge 0.15's DeepSeek-V3 bridge reads it already in ``_build_config`` (verl's ``_build_tf_config``).  Can go
  when mbridge reads ``rope_parameters``, or verl sets the attribute before building the bridge.
* :class:`MLAConfigNames` / :func:`mbridge_deepseek_v3` — mbridge 0.15's DeepSeek-V3 bridge passes MLA's YaRN
  pretraining length as ``max_position_embeddings``, which megatron-core 0.16's ``MLATransformerConfig`` calls
  ``original_max_position_embeddings`` (``TypeError`` when the bridge builds its config).  The mixin renames the
  keyword; :func:`mbridge_deepseek_v3` registers mbridge's bridge with it under "deepseek_v3" (mbridge's public
  ``register_model``) when mbridge's own class is the one registered.  Can go when mbridge passes the new name.
* :func:`megatron_sees_overrides` — ``McoreEngineConfig.override_transformer_config`` replaced for the duration
  of verl's ``_build_tf_config`` (verl's ``BaseConfig`` freezes set fields): the overrides hdp's fusion flags leave
  for Megatron (:mod:`hdp.integrations.verl.fusions`).  Can go when verl lets an engine filter them.
* :func:`hf_weights` — mbridge's ``_weight_name_mapping_mcore_local_to_global`` and ``_weight_to_hf_format``
  (name and shape mapping, on meta tensors): the Hugging Face names, shapes and dtypes mbridge writes and reads
  for this rank's weights.  Can go with the same verl change, or when mbridge exposes its mapping.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
import weakref
from typing import Any, Iterator

import verl
from verl.trainer.config import CheckpointConfig
from verl.workers.config import (
    EngineConfig,
    McoreActorConfig,
    McoreCheckpointConfig,
    McoreCriticConfig,
    McoreEngineConfig,
    McoreOptimizerConfig,
    OptimizerConfig,
)

__all__ = [
    "VERL_VERSION",
    "SUPPORTED",
    "CheckpointConfig",
    "EngineConfig",
    "McoreActorConfig",
    "McoreCheckpointConfig",
    "McoreCriticConfig",
    "McoreEngineConfig",
    "McoreOptimizerConfig",
    "OptimizerConfig",
    "check_version",
    "registered_keys",
    "without_megatron_strategy_assert",
    "megatron_sees_overrides",
    "FP32_NAMES",
    "megatron_lm_engine",
    "mindspeed_lm_engine",
    "engine_registry",
    "tensordict_utils",
    "maybe_fix_3d_position_ids",
    "mkdir_locks_removed",
    "checkpoint_manager",
    "checkpoint_content_metadata",
    "model_sharded_state_dict",
    "hf_weights",
    "expose_rope_theta",
    "MLAConfigNames",
    "mbridge_deepseek_v3",
    "mpu",
    "unwrap_model",
    "causal_mask_type",
    "as_nested",
    "policy_losses_wrapped",
]

logger = logging.getLogger(__name__)

VERL_VERSION: str = verl.__version__
SUPPORTED = ("0.9.",)
"""verl version prefixes this integration was written against."""


def check_version() -> None:
    """Log a WARNING (never raise) when verl is not a 0.9.x release."""
    if not VERL_VERSION.startswith(SUPPORTED):
        logger.warning(
            "hdp.integrations.verl was written against verl %s; found verl %s. "
            "Check integrations/verl/VERL_NOTES.md against this version.",
            "/".join(s + "x" for s in SUPPORTED),
            VERL_VERSION,
        )


def registered_keys(registry: Any, model_type: str, backend: str) -> set[Any]:
    """Device keys (``"cuda"`` or ``("cuda", vendor)``) already registered for (model_type, backend).

    ``registry``: verl's ``EngineRegistry`` (passed in so that this never imports verl's engines).
    """
    return set(registry._engines.get(model_type, {}).get(backend, {}))


@contextlib.contextmanager
def without_megatron_strategy_assert(config: McoreEngineConfig) -> Iterator[None]:
    """Run ``McoreEngineConfig.__post_init__`` on a config whose strategy is not "megatron".

    Sets ``strategy`` to "megatron" for the duration and restores it after (``object.__setattr__``
    because verl's ``BaseConfig`` freezes set fields).  The same for ``dtype="float32"``, which
    the hdp engine accepts and verl's assert (bf16/fp16 only, verl/workers/config/engine.py:218)
    would reject: it reads as "bfloat16" during the call.
    """
    strategy, dtype = config.strategy, config.dtype
    object.__setattr__(config, "strategy", "megatron")
    if dtype in FP32_NAMES:
        object.__setattr__(config, "dtype", "bfloat16")
    try:
        yield
    finally:
        object.__setattr__(config, "strategy", strategy)
        object.__setattr__(config, "dtype", dtype)


@contextlib.contextmanager
def megatron_sees_overrides(config: McoreEngineConfig, overrides: dict[str, Any]) -> Iterator[None]:
    """``config.override_transformer_config`` reads ``overrides`` for the duration (``object.__setattr__``: verl's
    ``BaseConfig`` freezes set fields); the user's dict comes back after."""
    orig = config.override_transformer_config
    object.__setattr__(config, "override_transformer_config", overrides)
    try:
        yield
    finally:
        object.__setattr__(config, "override_transformer_config", orig)


FP32_NAMES = ("float32", "fp32")
"""``engine.dtype`` spellings of float32 (verl's ``PrecisionType.to_dtype`` reads both)."""


# ---- engine-side imports (heavy: Megatron; only the engine module calls these) --------------------


def megatron_lm_engine() -> type:
    """verl's ``MegatronEngineWithLMHead`` (verl/workers/engine/megatron/transformer_impl.py:1172).

    Imported through the ``verl.workers.engine`` package so that MindSpeed's patches (imported
    there before Megatron's engine, verl/workers/engine/__init__.py:54) keep their order on NPUs.
    """
    import verl.workers.engine as engines

    if engines.MegatronEngineWithLMHead is None:
        raise ImportError("verl's Megatron engine is unavailable (see verl's 'megatron engine is not available' warning)")
    return engines.MegatronEngineWithLMHead


def mindspeed_lm_engine() -> type | None:
    """verl's ``MindspeedEngineWithLMHead`` (NPU), or None when MindSpeed is not installed."""
    import verl.workers.engine as engines

    return engines.MindspeedEngineWithLMHead


def engine_registry() -> Any:
    """``verl.workers.engine.EngineRegistry``."""
    from verl.workers.engine import EngineRegistry

    return EngineRegistry


def tensordict_utils() -> Any:
    """``verl.utils.tensordict_utils`` (non-tensor fields of verl's TensorDict batches)."""
    from verl.utils import tensordict_utils

    return tensordict_utils


def maybe_fix_3d_position_ids(data: Any) -> None:
    """verl's fix of 3-D (multimodal) position ids on a batch, as its engines' ``train_batch`` calls it."""
    from verl.utils.tensordict_utils import maybe_fix_3d_position_ids as fix

    fix(data)


def mpu() -> Any:
    """``megatron.core.parallel_state`` (verl's Megatron engine initialises it)."""
    from megatron.core import parallel_state

    return parallel_state


@contextlib.contextmanager
def megatron_group_timeout(seconds: float) -> Iterator[None]:
    """While active, Megatron's ``initialize_model_parallel`` (which verl calls without a timeout, so its
    groups wait torch's default 30 minutes) builds every group with ``seconds``: then Megatron's and hdp's
    collectives of the verl engine — the gradient reduce, the domain's exchanges and CP rings — give up
    after ``hdp.collective_timeout_s`` like the library engine's.  Scoped: the original comes back on exit."""
    ps = mpu()
    orig = ps.initialize_model_parallel

    def with_timeout(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("distributed_timeout_minutes", float(seconds) / 60.0)
        return orig(*args, **kwargs)

    ps.initialize_model_parallel = with_timeout
    try:
        yield
    finally:
        ps.initialize_model_parallel = orig


_AHEAD: "weakref.WeakSet[Any]" = weakref.WeakSet()
"""hdp training engines of this process whose mini-batch loop hdp runs (`own_mini_batch_loop`)."""
_LOOP: "contextvars.ContextVar[Any]" = contextvars.ContextVar("hdp_mini_batch_loop", default=None)
"""The hdp engine whose ``TrainingWorker.train_mini_batch`` is running (None: verl's own loop)."""


def own_mini_batch_loop(engine: Any) -> None:
    """Make verl's mini-batch loop (``TrainingWorker.train_mini_batch``, the only caller of
    ``tensordict_utils.make_iterator``) of a worker whose engine is ``engine``:

    * iterate **stock verl's mini-batches** for ``engine``'s domain of D ranks
      (:mod:`hdp.integrations.verl.minibatches`: the loop sees a DP size of 1 and would otherwise cut
      contiguous slices of the whole batch), and
    * announce each next mini-batch to ``engine`` before handing out the current one, so hdp plans it on
      a background thread while the current one trains (`hdp.core.plan_ahead`; the iterator holds one
      mini-batch ahead).

    Why a patch: verl 0.9.1 forms the mini-batches in the worker from the engine's DP rank and size
    alone (``workers/engine_workers.py``, ``train_mini_batch``).  Wraps ``TrainingWorker.train_mini_batch``
    (marks the running engine in a context variable; verl's ``register`` attributes are kept) and
    ``make_iterator`` (answers for the marked engine only; any other caller gets verl's).  Installed
    once per process; engines are held weakly.  Can go when verl asks the engine for its mini-batches."""
    _AHEAD.add(engine)
    tu = tensordict_utils()
    if not getattr(tu.make_iterator, "_hdp_loop", False):
        orig = tu.make_iterator

        def make_iterator(tensordict: Any, mini_batch_size: int, epochs: int, seed: Any = None,
                          dataloader_kwargs: Any = None) -> Any:
            owner = _LOOP.get()
            if owner is None:
                return orig(tensordict, mini_batch_size, epochs, seed=seed, dataloader_kwargs=dataloader_kwargs)
            return _one_ahead(_stock_iterator(owner, orig, tensordict, mini_batch_size, epochs, seed,
                                              dataloader_kwargs), owner)

        make_iterator._hdp_loop = True  # type: ignore[attr-defined]
        make_iterator.__doc__ = orig.__doc__
        tu.make_iterator = make_iterator
    from verl.workers.engine_workers import TrainingWorker

    loop = TrainingWorker.train_mini_batch
    if not getattr(loop, "_hdp_loop", False):

        @functools.wraps(loop)
        def train_mini_batch(self: Any, *args: Any, **kwargs: Any) -> Any:
            engine = getattr(self, "engine", None)
            token = _LOOP.set(engine if engine is not None and engine in _AHEAD else None)
            try:
                return loop(self, *args, **kwargs)
            finally:
                _LOOP.reset(token)

        train_mini_batch._hdp_loop = True  # type: ignore[attr-defined]
        TrainingWorker.train_mini_batch = train_mini_batch


_WARNED: set[tuple[int, int, int]] = set()


def _stock_iterator(engine: Any, make_iterator: Any, data: Any, mini_batch_size: int, epochs: int, seed: Any,
                    dataloader_kwargs: Any) -> Iterator[Any]:
    from hdp.integrations.verl import minibatches, old_log_prob

    old_log_prob.check_update(data, mini_batch_size, epochs)  # a skipped pass: one update, nothing read its stand-in
    dp = int(engine.domain.size)
    n = int(data.batch_size[0])
    idx = minibatches.stock_minibatch_indices(n, dp, int(mini_batch_size), int(epochs), seed, dataloader_kwargs,
                                              make_iterator)
    if idx is None:
        if dp > 1 and (n, int(mini_batch_size), dp) not in _WARNED:
            _WARNED.add((n, int(mini_batch_size), dp))
            logger.warning(
                "hdp engine: a batch of %d samples in mini-batches of %d does not split over the %d data-parallel "
                "ranks stock verl would use (its worker asserts); training contiguous mini-batches of the batch",
                n, mini_batch_size, dp)
        return iter(make_iterator(data, mini_batch_size, epochs, seed=seed, dataloader_kwargs=dataloader_kwargs))
    return minibatches.stock_minibatches(data, idx, tensordict_utils().index_select_tensor_dict)


def _one_ahead(it: Any, engine: Any) -> Iterator[Any]:
    it = iter(it)
    cur = next(it, None)
    if cur is None:
        return
    engine.announce([cur])
    for nxt in it:
        engine.announce([nxt], extend=True)
        yield cur
        cur = nxt
    yield cur


@contextlib.contextmanager
def dispatch_dp_size(worker_group: Any, mesh: str, dp_size: int) -> Iterator[None]:
    """While active, ``worker_group`` reports ``dp_size`` data-parallel ranks for ``mesh`` to code that
    reads verl's cached dispatch info (``_dispatch_info[mesh]``: the DP rank of every worker; verl's DP
    size is its maximum + 1).  The real mapping is queried first if verl has not cached it yet and is
    restored on exit, so verl's dispatch is unchanged."""
    info = worker_group._dispatch_info
    if mesh not in info:
        info[mesh] = worker_group._query_dispatch_info(mesh)
    real = info[mesh]
    info[mesh] = list(range(dp_size))
    try:
        yield
    finally:
        info[mesh] = real


def balance_batch_for_stock_dp(trainer_cls: type) -> bool:
    """Make ``trainer_cls._balance_batch`` balance for stock verl's DP size when the actor runs on hdp;
    True if this call patched.

    Why: verl 0.9.1's trainers read the DP size to balance for from the actor's dispatch info
    (``trainer/ppo/v1/trainer_base.py`` ``_balance_batch``, ``trainer/ppo/ray_trainer.py``
    ``_get_dp_size``), and an hdp engine reports 1 (every domain rank receives the whole batch), so the
    batch would be balanced for one part: other samples would train together than under stock verl at
    the same world size.  For the call only, the actor's dispatch info reports
    :func:`hdp.integrations.verl.minibatches.trainer_dp_size` ranks (`dispatch_dp_size`); the batch is
    then ordered as stock's, part after part, and the hdp worker's loop (`own_mini_batch_loop`) cuts the
    same mini-batches from it.  Can go when verl asks the engine for the DP size to balance for."""
    orig = trainer_cls.__dict__.get("_balance_batch")
    if orig is None or getattr(orig, "_hdp_guard", False):
        return False

    @functools.wraps(orig)
    def _balance_batch(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        from hdp.integrations.verl.minibatches import trainer_dp_size

        wg = self.actor_rollout_wg
        dp = trainer_dp_size(self.config, int(wg.world_size))
        if dp is None:
            return orig(self, batch, *args, **kwargs)
        with dispatch_dp_size(wg, "actor", dp):
            return orig(self, batch, *args, **kwargs)

    _balance_batch._hdp_guard = True  # type: ignore[attr-defined]
    trainer_cls._balance_batch = _balance_batch
    return True


def skip_redundant_old_log_prob(trainer_cls: type) -> bool:
    """Make verl's v1 trainer (``trainer_cls``: ``PPOTrainer``) skip the actor's old-log-prob pass when the job
    says so (:func:`hdp.integrations.verl.old_log_prob.resolve`, decided once per trainer) and the step does not
    need it after all (`old_log_prob.needed_at_step`: the rollout's log-probs in the batch, a critic-warmup step);
    True if this call patched.

    Why: verl 0.9.1 always runs the pass outside bypass mode (``_compute_old_log_prob``; its own shortcut,
    bypass mode, uses the rollout's log-probs and so changes the objective).  Wraps ``_compute_old_log_prob``
    (skipped: `old_log_prob.skip_step` writes the NaN stand-in; either way ``actor/hdp/old_log_prob_skipped``
    says which ran) and ``_update_actor`` (after a skipped pass the update's batch carries
    `old_log_prob.SKIP_FLAG`, for that call only).  Subclasses that call them through ``super()`` get the same.
    Can go when verl skips the pass."""
    from hdp.integrations.verl import old_log_prob

    orig_old = trainer_cls.__dict__.get("_compute_old_log_prob")
    orig_update = trainer_cls.__dict__.get("_update_actor")
    if orig_old is None or orig_update is None or getattr(orig_old, "_hdp_guard", False):
        return False

    def skips(self: Any) -> bool:
        if getattr(self, "_hdp_skip_old", None) is None:
            self._hdp_skip_old = old_log_prob.resolve(self.config)
        return self._hdp_skip_old

    @functools.wraps(orig_old)
    def _compute_old_log_prob(self: Any, batch: Any, metrics: dict, *args: Any, **kwargs: Any) -> Any:
        on_hdp = str(self.config.actor_rollout_ref.actor.get("strategy", "")) == "hdp"
        self._hdp_skipped_pass = False
        if skips(self):
            kept = old_log_prob.skip_step(batch, self.config, int(getattr(self, "global_steps", 0)))
            if not kept:
                metrics["actor/hdp/old_log_prob_skipped"] = 1.0
                self._hdp_skipped_pass = True
                return batch
            seen = self.__dict__.setdefault("_hdp_kept_for", set())
            for why in kept:
                if why.split(" (", 1)[0] not in seen:  # once per kind of reason
                    seen.add(why.split(" (", 1)[0])
                    logger.info("hdp: the old-log-prob pass runs on this step: %s", why)
        if on_hdp:
            metrics["actor/hdp/old_log_prob_skipped"] = 0.0
        return orig_old(self, batch, metrics, *args, **kwargs)

    @functools.wraps(orig_update)
    def _update_actor(self: Any, batch: Any, metrics: dict, *args: Any, **kwargs: Any) -> Any:
        if not getattr(self, "_hdp_skipped_pass", False):
            return orig_update(self, batch, metrics, *args, **kwargs)
        self._hdp_skipped_pass = False  # this step's update only
        batch.extra_info[old_log_prob.SKIP_FLAG] = True
        try:
            return orig_update(self, batch, metrics, *args, **kwargs)
        finally:
            batch.extra_info.pop(old_log_prob.SKIP_FLAG, None)

    for new in (_compute_old_log_prob, _update_actor):
        new._hdp_guard = True  # type: ignore[attr-defined]
    trainer_cls._compute_old_log_prob = _compute_old_log_prob
    trainer_cls._update_actor = _update_actor
    return True


def detached_worker_handlers(worker_cls: type) -> bool:
    """Give verl's detached actor worker (``worker_cls``: ``DetachActorWorker`` of its separate- and
    fully-async trainers) Megatron's save/restore handlers when the actor runs on hdp; True if this call patched.

    Why: verl 0.9.1 picks the handlers that keep the start-of-cycle policy on the host for the old-log-prob
    pass by ``actor.strategy`` (``experimental/separation/engine_workers.py`` ``_get_strategy_handlers``) and
    raises ``NotImplementedError`` for anything but fsdp, fsdp2, veomni and megatron.  An hdp engine's
    ``module`` is Megatron's list of DDP chunks, so Megatron's own handlers
    (``verl.utils.megatron_utils.copy_megatron_model_to_cpu`` / ``restore_megatron_model_from_cpu``) are the
    right ones: they are mapped, not copied.  Can go when verl asks the engine for its handlers."""
    orig = worker_cls.__dict__.get("_get_strategy_handlers")
    if orig is None or getattr(orig, "_hdp_guard", False):
        return False

    @functools.wraps(orig)
    def _get_strategy_handlers(self: Any) -> Any:
        if getattr(self, "_strategy_handlers", None) is None and self.config.actor.strategy == "hdp":
            from verl.utils import megatron_utils

            self._strategy_handlers = (megatron_utils.copy_megatron_model_to_cpu,
                                       megatron_utils.restore_megatron_model_from_cpu)
        return orig(self)

    _get_strategy_handlers._hdp_guard = True  # type: ignore[attr-defined]
    worker_cls._get_strategy_handlers = _get_strategy_handlers
    return True


class _WrappedRegistry(dict):
    """verl's ``POLICY_LOSS_REGISTRY`` whose lookups hand back ``wrap(name, fn)`` (`policy_losses_wrapped`)."""

    def __init__(self, original: dict[str, Any], wrap: Any) -> None:
        super().__init__(original)
        self._wrap = wrap
        self._made: dict[str, Any] = {}

    def __getitem__(self, name: str) -> Any:
        made = self._made.get(name)
        if made is None:
            made = self._made[name] = self._wrap(name, super().__getitem__(name))
        return made


_WRAPPED: dict[tuple[int, int], "_WrappedRegistry"] = {}
"""One wrapped registry per (registry, wrap) pair, made once (its wrapped functions keep their caches)."""


@contextlib.contextmanager
def policy_losses_wrapped(wrap: Any) -> Iterator[None]:
    """While active, verl's ``get_policy_loss_fn(name)`` (verl/trainer/ppo/core_algos.py:74, the one lookup of
    its policy-loss registry that ``ppo_loss`` and the distillation losses make) returns ``wrap(name, fn)``:
    hdp's plan-invariant normalisation of the policy losses that are a mean of their call
    (:mod:`hdp.integrations.verl.loss_kinds`).  The module global ``POLICY_LOSS_REGISTRY`` is swapped for a
    wrapped copy for the duration of hdp's loss call and restored after; losses registered meanwhile land in
    the copy.  Can go when verl's loss functions take the group's share of the mini-batch (or its normaliser)
    for every policy loss, not only through ``global_batch_info``."""
    from verl.trainer.ppo import core_algos

    original = core_algos.POLICY_LOSS_REGISTRY
    if isinstance(original, _WrappedRegistry):  # nested: already wrapped
        yield
        return
    slot = (id(original), id(wrap))
    wrapped = _WRAPPED.get(slot)
    if wrapped is None or dict.keys(wrapped) != original.keys():
        wrapped = _WRAPPED[slot] = _WrappedRegistry(original, wrap)
    core_algos.POLICY_LOSS_REGISTRY = wrapped
    try:
        yield
    finally:
        core_algos.POLICY_LOSS_REGISTRY = original


def unwrap_model(chunk: Any) -> Any:
    """The bare GPTModel inside verl's DDP/Float16 wrappers (``verl.utils.megatron_utils.unwrap_model``)."""
    from verl.utils.megatron_utils import unwrap_model as _unwrap

    return _unwrap(chunk)


def causal_mask_type() -> Any:
    """Megatron's ``AttnMaskType.causal``."""
    from megatron.core.transformer.enums import AttnMaskType

    return AttnMaskType.causal


def as_nested(tensors: list[Any]) -> Any:
    """A jagged nested tensor of per-sample tensors (verl's no-padding layout); keeps autograd."""
    import torch

    return torch.nested.as_nested_tensor(tensors, layout=torch.jagged)


def nested_from_flat(values: Any, lengths: Any) -> Any:
    """The jagged nested tensor of samples stored one after another in ``values`` [Σ L_i, ...] with
    ``lengths`` [S] (what `as_nested` makes of ``values.split(lengths)``, without the split and the
    copy); keeps autograd through ``values`` (and its ``values()`` then hands back ``values`` itself:
    `_FlatValues`).  Values that need no gradient (a batch's token ids, outputs
    handed back to verl) are wrapped by torch's jagged tensor class directly (`_jagged_class`): a third of
    the public constructor's time, which goes through the nested-tensor dispatch to record a view."""
    import torch

    lens = torch.as_tensor(lengths, dtype=torch.int64)  # [S]
    offsets = torch.zeros(len(lens) + 1, dtype=torch.int64)
    torch.cumsum(lens, 0, out=offsets[1:])
    # the shortest and longest sample cached, as as_nested_tensor does: TensorDict's to_padded_tensor pads
    # to the cached longest, and to the whole values' length without one
    short, long = (int(lens.min()), int(lens.max())) if len(lens) else (0, 0)
    values, offsets = values.contiguous(), offsets.to(values.device)
    direct = _jagged_class()
    if direct is not None and not values.requires_grad:
        cls, store = direct
        return cls(values, offsets, _metadata_cache={"min_seqlen": store(short), "max_seqlen": store(long)})
    nested = torch.nested.nested_tensor_from_jagged(values, offsets, min_seqlen=short, max_seqlen=long)
    if values.requires_grad:  # values() hands back the flat values themselves (`_FlatValues`)
        nested.values = _FlatValues(values)
    return nested


class _FlatValues:
    """``values()`` of a differentiable jagged tensor made by `nested_from_flat`: the flat values [Σ L_i, ...]
    it views, themselves.  verl's losses read a model output through ``values()`` (``no_padding_2_padding``);
    torch's ``values()`` is a view op of the nested tensor, whose backward runs through the nested-tensor
    dispatch (a quarter of verl's ``ppo_loss`` forward and backward on a few samples).  The same tensor
    without that view: the same data and storage, gradients flow to the same values, and any other op on
    the nested tensor still differentiates through it (both paths add up)."""

    __slots__ = ("flat",)

    def __init__(self, flat: Any) -> None:
        self.flat = flat

    def __call__(self) -> Any:
        return self.flat


@functools.lru_cache(maxsize=None)
def _jagged_class() -> tuple[Any, Any] | None:
    """(torch's jagged ``NestedTensor`` class, its helper storing a cached min/max length) — torch 2.13's
    ``torch.nested._internal.nested_tensor``, what ``nested_tensor_from_jagged`` builds in the end — or
    ``None`` where a torch version lacks them (then the public constructor is used)."""
    try:
        from torch.nested._internal.nested_tensor import NestedTensor, _store_val_in_tensor
    except ImportError:
        return None
    return NestedTensor, _store_val_in_tensor


def tensordict_of(source: dict[str, Any], n: int, device: Any) -> Any:
    """The TensorDict of batch size [n] on ``device`` holding ``source``, whose values are already of
    batch size [n] on that device (built from a batch's own fields): tensordict's ``_new_unsafe``, which
    skips the per-value checks of the constructor (a tenth of its time); the checked constructor where a
    tensordict version lacks it."""
    import torch
    from tensordict import TensorDict

    build = getattr(TensorDict, "_new_unsafe", None) or TensorDict
    return build(source, batch_size=torch.Size([n]), device=device)


@contextlib.contextmanager
def mkdir_locks_removed() -> Iterator[None]:
    """While active, the lock files verl's ``local_mkdir_safe`` leaves in the temporary directory are
    removed after each checkpoint save (verl 0.9.1 ``verl/utils/fs.py``: ``ckpt_<hash>.lock`` per
    directory, never deleted).  Wraps the name ``megatron_checkpoint_manager`` imported.  Can go when
    verl removes its lock files."""
    import tempfile

    import verl.utils.checkpoint.megatron_checkpoint_manager as manager

    orig = manager.local_mkdir_safe
    made: list[str] = []

    def local_mkdir_safe(path: Any) -> Any:
        out = orig(path)
        made.append(str(path if os.path.isabs(str(path)) else os.path.join(os.getcwd(), str(path))))
        return out

    manager.local_mkdir_safe = local_mkdir_safe
    try:
        yield
    finally:
        manager.local_mkdir_safe = orig
        for path in made:  # the name verl computes (hash of the path: this process's hash seed)
            lock = os.path.join(tempfile.gettempdir(), f"ckpt_{hash(path) & 0xFFFFFFFF:08x}.lock")
            with contextlib.suppress(OSError):
                os.remove(lock)


def checkpoint_manager(engine: Any) -> Any | None:
    """verl's ``MegatronCheckpointManager`` of a Megatron engine (verl 0.9.1 spells the attribute
    ``checkpoint_mananager``); ``None`` for a forward-only engine, for which verl builds none."""
    return getattr(engine, "checkpoint_mananager", None)


def checkpoint_content_metadata(manager: Any, directory: str) -> dict[str, Any]:
    """The content metadata verl's load composes its sharded state dicts with (``_load_content_metadata``: the
    dist checkpoint's own in ``directory``, else verl's default for this engine)."""
    return manager._load_content_metadata(directory)


def model_sharded_state_dict(manager: Any, metadata: dict[str, Any]) -> dict[str, Any]:
    """verl's sharded state dict of the model, every virtual stage keyed as verl saves it
    (``_build_model_sharded_state_dict``; a new dict each call)."""
    return manager._build_model_sharded_state_dict(metadata)


def expose_rope_theta(hf_config: Any) -> None:
    """``hf_config.rope_theta`` from its ``rope_parameters`` (verl's ``get_hf_rope_theta``; module docstring); a
    config with no RoPE base is left as it is (verl's own rule)."""
    from verl.utils.megatron_utils import get_hf_rope_theta

    if hf_config is None or getattr(hf_config, "rope_theta", None) is not None:
        return
    try:
        hf_config.rope_theta = get_hf_rope_theta(hf_config)
    except AttributeError:  # NoPE / hybrid-SSM configs carry no RoPE: verl skips them too
        pass


class MLAConfigNames:
    """Mixin for an mbridge bridge: ``max_position_embeddings`` passed to a config class without that field
    (megatron-core 0.16's ``MLATransformerConfig``) goes under its new name (module docstring)."""

    def _build_base_config(self, text_config_key: Any = None, **kwargs: Any) -> Any:
        import dataclasses

        names = {f.name for f in dataclasses.fields(self.TransformerConfigClass)}  # type: ignore[attr-defined]
        if "max_position_embeddings" in kwargs and "max_position_embeddings" not in names:
            kwargs["original_max_position_embeddings"] = kwargs.pop("max_position_embeddings")
        return super()._build_base_config(text_config_key, **kwargs)  # type: ignore[misc]


def mbridge_deepseek_v3() -> None:
    """Register mbridge's DeepSeek-V3 bridge with :class:`MLAConfigNames` when mbridge's own class is registered
    (not a subclass someone registered, such as the CPU scaffolding's); idempotent."""
    from mbridge.core.bridge import _MODEL_REGISTRY, register_model
    from mbridge.models.deepseek_v3 import DeepseekV3Bridge

    if _MODEL_REGISTRY.get("deepseek_v3") is DeepseekV3Bridge:
        register_model("deepseek_v3")(type("DeepseekV3Bridge", (MLAConfigNames, DeepseekV3Bridge), {}))


def hf_weights(bridge: Any, chunks: Any, tp_size: int, etp_size: int) -> dict[str, tuple[tuple[int, ...], Any]] | None:
    """Hugging Face name -> (shape, dtype) of the weights of this rank's model ``chunks``, as vanilla mbridge writes
    them (``save_weights``: TP shards joined, EP experts by their global index, the vocabulary unpadded, fused QKV
    and gate/up split) and reads them (``load_weights``: the names of every state-dict entry).  Computed on meta
    tensors: no data moves, no collective.  ``None`` when ``bridge`` is not vanilla mbridge (Megatron-Bridge)."""
    import torch

    if not (hasattr(bridge, "_weight_name_mapping_mcore_local_to_global") and hasattr(bridge, "_weight_to_hf_format")):
        return None
    out: dict[str, tuple[tuple[int, ...], Any]] = {}
    for chunk in chunks:
        model = unwrap_model(chunk)
        params = dict(model.named_parameters())
        state = model.state_dict()
        for local, name in bridge._weight_name_mapping_mcore_local_to_global(model).items():
            param = params.get(local)
            tensor = param if param is not None else state[local]
            shape = list(tensor.shape)
            if param is not None and getattr(param, "tensor_model_parallel", False):
                shape[param.partition_dim] *= etp_size if ".mlp.experts." in local else tp_size
            whole = torch.empty(shape, dtype=tensor.dtype, device="meta")
            try:
                names, tensors = bridge._weight_to_hf_format(name, whole)
            except AssertionError:  # a value head under a padded vocabulary: mbridge writes it as it is
                names, tensors = bridge._weight_name_mapping_mcore_to_hf(name)[:1], [whole]
            for hf_name, t in zip(names, tensors):
                out[hf_name] = (tuple(int(n) for n in t.shape), t.dtype)
    return out
