"""verl plugin: registers the ``hdp`` engine backend, lazily, when ``import verl`` loads the entry points.

verl loads each entry point of the group ``verl.plugins`` at import (verl/__init__.py:64) and logs
a failure only at DEBUG (verl/__init__.py:76), so this module logs its own failures at WARNING and
never raises.

Nothing heavy happens at ``import verl``: importing verl's engine registry means importing
``verl.workers.engine``, i.e. every verl engine and Megatron (10+ s), which driver, rollout and
reward processes never need.  So this module only

* puts hdp's Hydra configs on Hydra's search path (``model_engine=hdp``, ``--config-name
  hdp_ppo_trainer``; ``Plugins.instance().register``, Hydra's public manual-registration call), and
* arranges that when *something else* imports ``verl.workers.engine.base`` (a training worker
  does, to build its engine), :class:`HdpEngine` — a small ``BaseEngine`` subclass — is registered
  in ``EngineRegistry`` under model types ``language_model`` (actor, ref) and ``value_model`` (critic),
  backend ``hdp``, devices ``cuda``, ``npu`` and ``cpu``.  Constructing it builds the real engine
  (:class:`hdp.integrations.verl.engine.HdpMegatronEngine` / ``HdpMegatronValueEngine``, or their
  MindSpeed variants on NPUs);
  only then are hdp's engine, the hdp runtime and Megatron imported;
* when ``verl.workers.config.actor`` is imported, makes ``actor.strategy=hdp`` on verl's Megatron
  actor config fail with an error that names the override to use (:func:`guard_megatron_actor`),
  and runs hdp's config checks on verl's other actor configs with ``strategy=hdp``
  (:func:`guard_hdp_strategy_actor`: token budgets, Ulysses, ``model.use_remove_padding``);
* when verl's trainers (``verl.trainer.ppo.ray_trainer``, ``verl.trainer.ppo.v1.trainer_base``) are
  imported, makes their ``_balance_batch`` balance for stock verl's data-parallel size when the actor
  runs on hdp (:func:`hdp.integrations.verl.compat.balance_batch_for_stock_dp`);
* makes Hydra's "Key 'hdp' is not in struct" for an ``actor_rollout_ref.actor.hdp.*`` override on a
  config without hdp's options name the missing ``model_engine=hdp`` (:func:`guard_hydra_overrides`).

``VERL_USE_EXTERNAL_PLUGINS=none`` (verl's switch) skips all of it; :func:`register` can also be
called by hand (it registers at once when verl's engine registry is already imported).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
from types import ModuleType
from typing import Any, Sequence

from hdp.device import DEVICE_KINDS
from hdp.integrations.verl import config_dir

__all__ = [
    "BACKEND",
    "DEVICES",
    "MODEL_TYPES",
    "MEGATRON_CONFIG_HINT",
    "register",
    "register_engines",
    "register_search_path",
    "guard_megatron_actor",
    "guard_hdp_strategy_actor",
    "guard_hydra_overrides",
    "HDP_OPTIONS_HINT",
    "engine_class",
]

logger = logging.getLogger(__name__)

BACKEND = "hdp"
"""EngineRegistry backend name (= ``actor_rollout_ref.actor.strategy``)."""
DEVICES = DEVICE_KINDS
"""EngineRegistry device keys hdp registers (verl's ``get_device_name()``: hdp's device kinds)."""
_REGISTRY_MODULE = "verl.workers.engine.base"
_ACTOR_CONFIG_MODULE = "verl.workers.config.actor"
MEGATRON_CONFIG_HINT = (
    "actor_rollout_ref.actor.strategy=hdp on verl's Megatron config (ppo_megatron_trainer or "
    "model_engine=megatron) would silently run verl's stock Megatron engine: verl's McoreActorConfig "
    "keeps its engine's strategy 'megatron' and its ref config hard-codes strategy=megatron. "
    "Add the override model_engine=hdp (keeps every actor_rollout_ref.actor.megatron.* option and adds "
    "actor_rollout_ref.actor.hdp.*), or use --config-name hdp_ppo_trainer"
)
"""The error raised for ``actor.strategy=hdp`` on a Megatron actor config (see :func:`guard_megatron_actor`)."""


MODEL_TYPES = ("language_model", "value_model")
"""verl's model types hdp registers an engine for: the actor and reference model, and the critic."""


def engine_class(model_type: str = "language_model") -> type:
    """The engine class the ``hdp`` backend builds for ``model_type`` on this machine (imports hdp's engine
    and Megatron): ``HdpMegatronEngine``, or ``HdpMegatronValueEngine`` for ``value_model``; on NPUs with
    MindSpeed installed, their MindSpeed variants."""
    from hdp.integrations.verl.engine import HdpMegatronEngine, HdpMegatronValueEngine, npu_engine_class
    from verl.utils.device import get_device_name

    value = model_type == "value_model"
    if get_device_name() == "npu":
        npu_cls = npu_engine_class(value)
        if npu_cls is not None:
            return npu_cls
    return HdpMegatronValueEngine if value else HdpMegatronEngine


def _lazy_engine(base_engine: type, model_type: str = "language_model") -> type:
    """The class registered in verl's EngineRegistry for ``model_type``: a ``BaseEngine`` whose construction
    builds the real one."""

    class HdpEngine(base_engine):  # type: ignore[misc,valid-type]
        """Stand-in registered for backend ``hdp``; ``HdpEngine(...)`` returns a :func:`engine_class` instance.

        verl's ``EngineRegistry.register`` asserts a ``BaseEngine`` subclass and ``EngineRegistry.new``
        calls ``cls(model_config=..., engine_config=..., optimizer_config=..., checkpoint_config=...)``;
        ``__new__`` returns the real engine (not an instance of this class, so Python does not call
        ``__init__`` again).
        """

        _hdp_lazy = True

        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            return engine_class(model_type)(*args, **kwargs)

        @staticmethod
        def resolve() -> type:
            """The real engine class (:func:`engine_class`)."""
            return engine_class(model_type)

    return HdpEngine


def register_engines(registry_module: ModuleType | None = None) -> list[str]:
    """Register the lazy ``hdp`` engine for every model type (`MODEL_TYPES`) and device not registered yet;
    returns the ``model_type/device`` keys added.

    Imports ``verl.workers.engine.base`` unless given (call it from a process that builds engines).
    """
    from hdp.integrations.verl import compat

    if registry_module is None:
        registry_module = importlib.import_module(_REGISTRY_MODULE)
    registry = registry_module.EngineRegistry
    added: list[str] = []
    for model_type in MODEL_TYPES:
        have = compat.registered_keys(registry, model_type, BACKEND)
        missing = [d for d in DEVICES if d not in have]
        if missing:
            registry.register(model_type=model_type, backend=BACKEND, device=missing)(
                _lazy_engine(registry_module.BaseEngine, model_type)
            )
            added += [f"{model_type}/{d}" for d in missing]
    return added


def register_search_path() -> bool:
    """Put hdp's Hydra configs on Hydra's search path (once); True if this call added it."""
    from hydra.core.config_search_path import ConfigSearchPath
    from hydra.core.plugins import Plugins
    from hydra.plugins.search_path_plugin import SearchPathPlugin

    plugins = Plugins.instance()
    if any(getattr(c, "_hdp_search_path", False) for c in plugins.discover(SearchPathPlugin)):
        return False

    class HdpSearchPathPlugin(SearchPathPlugin):
        """Appends hdp's verl configs (actor/hdp_actor, ref/hdp_ref, model_engine/hdp, hdp_ppo_trainer)."""

        _hdp_search_path = True

        def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
            search_path.append(provider="hdp", path=f"file://{config_dir()}")

    plugins.register(HdpSearchPathPlugin)
    return True


def guard_megatron_actor(actor_module: ModuleType) -> bool:
    """Make ``McoreActorConfig(strategy="hdp")`` raise :data:`MEGATRON_CONFIG_HINT`; True if this call patched.

    The one patch hdp applies to verl (0.9.x, ``verl/workers/config/actor.py``): wraps
    ``McoreActorConfig.__post_init__``.  Why: on verl's Megatron configs ``actor.strategy=hdp``
    builds a ``McoreActorConfig`` whose engine config keeps ``strategy="megatron"``, so verl's
    TrainingWorker would pick its stock Megatron engine without a word, and the ref config
    hard-codes ``strategy: megatron``.  hdp's own ``HdpActorConfig`` (a subclass) is unaffected.
    Can go when verl copies ``actor.strategy`` into ``McoreActorConfig``'s engine config.
    """
    cls = actor_module.McoreActorConfig
    orig = cls.__post_init__
    if getattr(orig, "_hdp_guard", False):
        return False

    def __post_init__(self: Any) -> None:
        if type(self) is cls and self.strategy == BACKEND:
            raise ValueError(MEGATRON_CONFIG_HINT)
        orig(self)

    __post_init__._hdp_guard = True  # type: ignore[attr-defined]
    __post_init__.__doc__ = orig.__doc__
    cls.__post_init__ = __post_init__
    return True


def guard_hdp_strategy_actor(actor_module: ModuleType) -> bool:
    """Run hdp's config checks on verl's own actor configs with ``strategy="hdp"``; True if this call patched.

    ``actor_rollout_ref.actor.strategy=hdp`` on verl's FSDP-shaped ``ppo_trainer`` builds verl's
    ``FSDPActorConfig`` (hdp's config classes never run), so without this a non-positive
    ``ppo_max_token_len_per_gpu``, ``ulysses_sequence_parallel_size > 1`` or ``use_remove_padding=False``
    pass ``validate_config`` and fail later (or are ignored).  Wraps ``FSDPActorConfig.__post_init__``
    (:func:`hdp.integrations.verl.checks.check_actor_config`) and ``.validate`` (the model's
    ``use_remove_padding``, which verl's ``validate_config`` passes in) for ``strategy == "hdp"`` only.
    """
    from hdp.integrations.verl import checks

    cls = getattr(actor_module, "FSDPActorConfig", None)
    if cls is None or getattr(cls.__post_init__, "_hdp_guard", False):
        return False
    orig_post, orig_validate = cls.__post_init__, cls.validate

    def __post_init__(self: Any) -> None:
        orig_post(self)
        if self.strategy == BACKEND:
            checks.check_actor_config(self)

    def validate(self: Any, n_gpus: int, train_batch_size: int, model_config: Any = None) -> Any:
        if self.strategy == BACKEND and model_config is not None:
            checks.check_remove_padding(model_config.get("use_remove_padding", True))
            checks.check_fused_kernels(model_config.get("use_fused_kernels", False),
                                       model_config.get("fused_kernel_options", None))
        return orig_validate(self, n_gpus, train_batch_size, model_config)

    for new, orig in ((__post_init__, orig_post), (validate, orig_validate)):
        new._hdp_guard = True  # type: ignore[attr-defined]
        new.__doc__ = orig.__doc__
    cls.__post_init__, cls.validate = __post_init__, validate
    return True


HDP_OPTIONS_HINT = (
    "{key}: this config has no hdp options. actor_rollout_ref.actor.strategy=hdp on verl's ppo_trainer "
    "keeps verl's FSDP-shaped actor config, which has no 'hdp' key (the engine then uses hdp's defaults). "
    "Add the override model_engine=hdp, which adds actor_rollout_ref.actor.hdp.* (and every "
    "actor_rollout_ref.actor.megatron.* option), or use --config-name hdp_ppo_trainer"
)
"""The error for an ``actor_rollout_ref.(actor|ref).hdp.*`` override on a config without hdp's options."""


def guard_hydra_overrides() -> bool:
    """Make a failed ``actor_rollout_ref.actor.hdp.*`` override say to add ``model_engine=hdp``; True if patched.

    Hydra applies command-line overrides in ``ConfigLoaderImpl._apply_overrides_to_config`` (private,
    hydra-core 1.3) and reports a key missing from the config as "Could not override ... Key 'hdp' is not
    in struct", which does not say what is missing.  This wraps that static method: when an override
    under ``actor_rollout_ref.actor.hdp`` / ``actor_rollout_ref.ref.hdp`` fails on a config whose actor has
    no ``hdp`` node, it raises Hydra's own ``ConfigCompositionException`` with :data:`HDP_OPTIONS_HINT`
    (the original chained).  Anything else is untouched.  Can go when verl's stock actor configs accept
    ``hdp`` or Hydra's message names the config group that would add the key.
    """
    import re

    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.errors import ConfigCompositionException
    from omegaconf import OmegaConf

    orig = ConfigLoaderImpl.__dict__["_apply_overrides_to_config"].__func__
    if getattr(orig, "_hdp_guard", False):
        return False
    pattern = re.compile(r"^actor_rollout_ref\.(actor|ref)\.hdp(\.|$)")

    def _apply_overrides_to_config(overrides: Any, cfg: Any) -> None:
        try:
            orig(overrides, cfg)
        except ConfigCompositionException as exc:
            bad = [o.input_line for o in overrides if pattern.match(str(o.key_or_group or ""))]
            has_hdp = OmegaConf.select(cfg, "actor_rollout_ref.actor.hdp", throw_on_missing=False) is not None
            if bad and not has_hdp:
                raise ConfigCompositionException(HDP_OPTIONS_HINT.format(key=bad[0])) from exc
            raise

    _apply_overrides_to_config._hdp_guard = True  # type: ignore[attr-defined]
    ConfigLoaderImpl._apply_overrides_to_config = staticmethod(_apply_overrides_to_config)
    return True


_TRAINERS = {"verl.trainer.ppo.ray_trainer": "RayPPOTrainer", "verl.trainer.ppo.v1.trainer_base": "PPOTrainer"}
"""verl's trainer base classes whose ``_balance_batch`` balances for stock's DP size under hdp (the
separate-, fully-async and one-step-off trainers inherit the legacy one)."""
_V1_TRAINER = "verl.trainer.ppo.v1.trainer_base"
"""verl's v1 trainer, whose old-log-prob pass hdp skips when it is redundant."""
_CONFIG_MODULE = "verl.utils.config"
"""verl's ``validate_config`` (the driver's config check, before Ray starts)."""
_DETACHED_MODULE = "verl.experimental.separation.engine_workers"
"""verl's detached actor worker (separate- and fully-async trainers)."""
_HOOKS = {_REGISTRY_MODULE: "_register_or_warn", _ACTOR_CONFIG_MODULE: "_guard_or_warn",
          **{m: "_balance_or_warn" for m in _TRAINERS}, _CONFIG_MODULE: "_validate_or_warn",
          _DETACHED_MODULE: "_detached_or_warn"}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a hook right after ``verl.workers.engine.base`` / ``verl.workers.config.actor`` have executed.

    A meta-path finder that only wraps the loader the other finders return for those modules
    (the standard post-import-hook pattern); it removes itself once both have fired.
    """

    _hdp_after_import = True

    def __init__(self) -> None:
        self.pending = {m for m in _HOOKS if m not in sys.modules}

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: Any = None) -> Any:
        if fullname not in self.pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _RegisteringLoader(spec.loader, self)
                return spec
        return None


class _RegisteringLoader(importlib.abc.Loader):
    def __init__(self, inner: Any, finder: _AfterImport) -> None:
        self._inner = inner
        self._finder = finder

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        self._finder.pending.discard(module.__name__)
        if not self._finder.pending and self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
        globals()[_HOOKS[module.__name__]](module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _register_or_warn(module: ModuleType | None) -> bool:
    try:
        added = register_engines(module)
    except Exception as exc:  # plugin boundary: verl would hide this at DEBUG level
        logger.warning(
            "hdp verl plugin: could not register the 'hdp' engine (%s: %s); "
            "actor_rollout_ref.actor.strategy=hdp will fail with 'Unknown backend: hdp'",
            type(exc).__name__,
            exc,
            exc_info=True,
        )
        return False
    if added:
        logger.info("hdp verl plugin: registered engine backend %r for devices %s", BACKEND, added)
    return True


def _guard_or_warn(module: ModuleType) -> bool:
    try:
        guard_megatron_actor(module)
        guard_hdp_strategy_actor(module)
        return True
    except Exception as exc:  # plugin boundary
        logger.warning("hdp verl plugin: could not guard McoreActorConfig (%s: %s)", type(exc).__name__, exc)
        return False


def _balance_or_warn(module: ModuleType) -> bool:
    try:
        from hdp.integrations.verl import compat

        compat.balance_batch_for_stock_dp(getattr(module, _TRAINERS[module.__name__]))
        if module.__name__ == _V1_TRAINER:
            compat.skip_redundant_old_log_prob(getattr(module, _TRAINERS[module.__name__]))
        return True
    except Exception as exc:  # plugin boundary
        logger.warning("hdp verl plugin: could not make %s balance for stock verl's data-parallel size (%s: %s); "
                       "under hdp its mini-batches then differ from stock verl's", module.__name__,
                       type(exc).__name__, exc)
        return False


def guard_validate_config(config_module: ModuleType) -> bool:
    """Make verl's ``validate_config`` (the driver's check, before Ray starts) run hdp's job-level checks
    (:func:`hdp.integrations.verl.checks.check_job_layout` before verl's own: settings spread over the actor's,
    the ref's and the critic's configs; `check_job_batching` after it: every role's ``use_dynamic_bsz`` and the
    old-log-prob option; :func:`hdp.integrations.verl.loss_kinds.check_job_config`: losses that are not additive
    over samples, or run a collective); True if this call patched.  Wraps the
    module attribute right after the module executed, so every ``from verl.utils.config import validate_config``
    binds the wrapper.  Can go when verl's validation calls the engines' own job checks."""
    orig = config_module.validate_config
    if getattr(orig, "_hdp_guard", False):
        return False
    import functools

    @functools.wraps(orig)
    def validate_config(config: Any, use_reference_policy: bool, use_critic: bool, *args: Any, **kwargs: Any) -> Any:
        from hdp.integrations.verl.checks import check_job_batching, check_job_layout
        from hdp.integrations.verl.loss_kinds import check_job_config

        # pure and quick: before verl's own, which builds the roles' configs
        check_job_layout(config, ref=bool(use_reference_policy), critic=bool(use_critic))
        out = orig(config, use_reference_policy, use_critic, *args, **kwargs)
        check_job_batching(config, ref=bool(use_reference_policy), critic=bool(use_critic))
        check_job_config(config, critic=bool(use_critic))  # losses whose value would depend on hdp's plan
        return out

    validate_config._hdp_guard = True  # type: ignore[attr-defined]
    config_module.validate_config = validate_config
    return True


def _detached_or_warn(module: ModuleType) -> bool:
    try:
        from hdp.integrations.verl import compat

        compat.detached_worker_handlers(module.DetachActorWorker)
        return True
    except Exception as exc:  # plugin boundary
        logger.warning("hdp verl plugin: could not give verl's DetachActorWorker hdp's save/restore handlers (%s: %s); "
                       "separate- and fully-async training then refuse actor.strategy=hdp", type(exc).__name__, exc)
        return False


def _validate_or_warn(module: ModuleType) -> bool:
    try:
        guard_validate_config(module)
        return True
    except Exception as exc:  # plugin boundary
        logger.warning("hdp verl plugin: could not add hdp's checks to verl's validate_config (%s: %s); they run "
                       "when the engines are built instead", type(exc).__name__, exc)
        return False


def register() -> bool:
    """Register hdp with verl (see the module docstring); log (WARNING) and return False on failure."""
    try:
        register_search_path()
    except Exception as exc:  # plugin boundary
        logger.warning("hdp verl plugin: could not add hdp's Hydra configs (%s: %s)", type(exc).__name__, exc)
        return False
    try:
        guard_hydra_overrides()
    except Exception as exc:  # plugin boundary: Hydra's private loader changed; its own message stays
        logger.warning("hdp verl plugin: could not guard Hydra's overrides (%s: %s)", type(exc).__name__, exc)
    ok = True
    for name, hook in _HOOKS.items():
        loaded = sys.modules.get(name)
        if loaded is not None:
            ok = globals()[hook](loaded) is not False and ok
    if not all(m in sys.modules for m in _HOOKS) and not any(
        getattr(f, "_hdp_after_import", False) for f in sys.meta_path
    ):
        sys.meta_path.insert(0, _AfterImport())
    return ok


register()
