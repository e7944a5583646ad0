"""verl plugin: registers the ``hdp`` engine backend, lazily, when ``import verl`` loads the entry points.

verl loads each entry point of the group ``verl.plugins`` at import (verl/__init__.py:64) and logs
a failure only at DEBUG (verl/__init__.py:76), so this module logs its own failures at WARNING and
never raises.

First the installed verl is checked (:func:`hdp.integrations.verl.check_verl_version`): on a release outside
:data:`hdp.integrations.verl.SUPPORTED_VERL` the plugin logs an ERROR naming the installed version, the supported
range and the fix, and installs no patch; the engine is still registered, and constructing it raises the same
message (so ``strategy=hdp`` fails with it instead of deep inside a patch).

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
* installs the patches of :mod:`hdp.integrations.verl.patches` whose scope is ``IMPORT``, each right after verl
  imports its module (one post-import hook, :class:`_AfterImport`, on the modules of :data:`_HOOKS`): Hydra's
  override loader at once, verl's ``validate_config`` (the driver's job checks), the trainers' ``_balance_batch``
  and the v1 trainer's old-log-prob pass, the detached worker's save/restore handlers.

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
from hdp.integrations.verl import check_verl_version, config_dir, patches, refusal

__all__ = [
    "BACKEND",
    "DEVICES",
    "MODEL_TYPES",
    "register",
    "register_engines",
    "register_search_path",
    "engine_class",
]

logger = logging.getLogger(__name__)

BACKEND = "hdp"
"""EngineRegistry backend name (= ``actor_rollout_ref.actor.strategy``)."""
DEVICES = DEVICE_KINDS
"""EngineRegistry device keys hdp registers (verl's ``get_device_name()``: hdp's device kinds)."""
_REGISTRY_MODULE = "verl.workers.engine.base"


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
            check_verl_version()  # an unsupported verl: ImportError naming the fix, before anything is built
            return engine_class(model_type)(*args, **kwargs)

        @staticmethod
        def resolve() -> type:
            """The real engine class (:func:`engine_class`)."""
            check_verl_version()
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


_TRAINERS = {"verl.trainer.ppo.ray_trainer": "RayPPOTrainer", "verl.trainer.ppo.v1.trainer_base": "PPOTrainer"}
"""verl's trainer base classes whose ``_balance_batch`` balances for stock's DP size under hdp (the
separate-, fully-async and one-step-off trainers inherit the legacy one)."""
_V1_TRAINER = "verl.trainer.ppo.v1.trainer_base"
"""verl's v1 trainer, whose old-log-prob pass hdp skips when it is redundant."""
_CONFIG_MODULE = "verl.utils.config"
"""verl's ``validate_config`` (the driver's config check, before Ray starts)."""
_DETACHED_MODULE = "verl.experimental.separation.engine_workers"
"""verl's detached actor worker (separate- and fully-async trainers)."""
_HOOKS = {_REGISTRY_MODULE: "_register_or_warn", **{m: "_balance_or_warn" for m in _TRAINERS},
          _CONFIG_MODULE: "_validate_or_warn", _DETACHED_MODULE: "_detached_or_warn"}
"""The verl modules the plugin acts on right after they are imported, and what it does: registers the engine
(public ``EngineRegistry.register``) or installs patches (:mod:`hdp.integrations.verl.patches`)."""


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a hook of :data:`_HOOKS` right after its verl module has executed.

    A meta-path finder that only wraps the loader the other finders return for those modules
    (the standard post-import-hook pattern); it removes itself once every hook has fired.
    """

    _hdp_after_import = True

    def __init__(self, modules: Sequence[str]) -> None:
        self.pending = {m for m in modules if m not in sys.modules}

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


def _balance_or_warn(module: ModuleType) -> bool:
    try:
        trainer = getattr(module, _TRAINERS[module.__name__])
        patches.balance_batch_for_stock_dp(trainer)
        if module.__name__ == _V1_TRAINER:
            patches.skip_redundant_old_log_prob(trainer)
        return True
    except Exception as exc:  # plugin boundary
        logger.warning("hdp verl plugin: could not make %s balance for stock verl's data-parallel size (%s: %s); "
                       "under hdp its mini-batches then differ from stock verl's", module.__name__,
                       type(exc).__name__, exc)
        return False


def _detached_or_warn(module: ModuleType) -> bool:
    try:
        patches.detached_worker_handlers(module.DetachActorWorker)
        return True
    except Exception as exc:  # plugin boundary
        logger.warning("hdp verl plugin: could not give verl's DetachActorWorker hdp's save/restore handlers (%s: %s); "
                       "separate- and fully-async training then refuse actor.strategy=hdp", type(exc).__name__, exc)
        return False


def _validate_or_warn(module: ModuleType) -> bool:
    try:
        patches.validate_config(module)
        return True
    except Exception as exc:  # plugin boundary
        logger.warning("hdp verl plugin: could not add hdp's checks to verl's validate_config (%s: %s); they run "
                       "when the engines are built instead", type(exc).__name__, exc)
        return False


def register() -> bool:
    """Register hdp with verl (see the module docstring); log and return False on failure, or on an unsupported
    verl (an ERROR naming the installed version, the supported range and the fix; then only the engine is
    registered, whose construction raises the same message, and no patch is installed)."""
    refused = refusal()
    if refused is not None:
        logger.error("hdp verl plugin: %s", refused)
    try:
        register_search_path()
    except Exception as exc:  # plugin boundary
        logger.warning("hdp verl plugin: could not add hdp's Hydra configs (%s: %s)", type(exc).__name__, exc)
        return False
    if refused is None:
        try:
            patches.hydra_overrides()
        except Exception as exc:  # plugin boundary: Hydra's private loader changed; its own message stays
            logger.warning("hdp verl plugin: could not guard Hydra's overrides (%s: %s)", type(exc).__name__, exc)
    hooks = [_REGISTRY_MODULE] if refused is not None else list(_HOOKS)
    ok = refused is None
    for name in hooks:
        loaded = sys.modules.get(name)
        if loaded is not None:
            ok = globals()[_HOOKS[name]](loaded) is not False and ok
    waiting = [m for m in hooks if m not in sys.modules]
    finder = next((f for f in sys.meta_path if getattr(f, "_hdp_after_import", False)), None)
    if finder is not None:
        finder.pending.update(waiting)
    elif waiting:
        sys.meta_path.insert(0, _AfterImport(waiting))
    return ok


register()
