"""verl plugin: registers the ``hdp`` engine when ``import verl`` loads the ``verl.plugins`` entry points.

verl loads each entry point of the group ``verl.plugins`` at import (verl/__init__.py:64) and logs
a failure only at DEBUG (verl/__init__.py:76), so this module logs its own failures at WARNING and
never raises.  Importing it registers (idempotently):

* ``EngineRegistry``: model type ``language_model``, backend ``hdp``, devices ``cuda`` and ``cpu``
  → :class:`~hdp.integrations.verl.engine.HdpMegatronEngine`; ``npu`` → the same engine on verl's
  MindSpeed engine when MindSpeed is installed;
* Hydra: hdp's config directory on the search path, so ``model_engine=hdp`` and
  ``--config-name hdp_ppo_trainer`` resolve (``Plugins.instance().register``, Hydra's public
  manual-registration call).

``VERL_USE_EXTERNAL_PLUGINS=none`` (verl's switch) skips it; :func:`register` can also be called by hand.
"""

from __future__ import annotations

import logging

from hdp.integrations.verl import config_dir

__all__ = ["BACKEND", "register", "register_engines", "register_search_path"]

logger = logging.getLogger(__name__)

BACKEND = "hdp"
"""EngineRegistry backend name (= ``actor_rollout_ref.actor.strategy``)."""


def register_engines() -> list[str]:
    """Register the hdp engine for every device not registered yet; returns the device keys added."""
    from hdp.device import DEVICE_KINDS
    from hdp.integrations.verl import compat
    from hdp.integrations.verl.engine import HdpMegatronEngine, npu_engine_class

    compat.check_version()
    registry = compat.engine_registry()
    have = compat.registered_keys("language_model", BACKEND)
    added: list[str] = []
    gpu_cpu = [d for d in DEVICE_KINDS if d != "npu" and d not in have]  # npu gets its own class below
    if gpu_cpu:
        registry.register(model_type="language_model", backend=BACKEND, device=gpu_cpu)(HdpMegatronEngine)
        added += gpu_cpu
    if "npu" not in have:
        npu_cls = npu_engine_class()
        if npu_cls is not None:
            registry.register(model_type="language_model", backend=BACKEND, device="npu")(npu_cls)
            added.append("npu")
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


def register() -> bool:
    """Register engines and configs; log (WARNING) and return False on failure instead of raising."""
    try:
        added = register_engines()
        register_search_path()
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


register()
