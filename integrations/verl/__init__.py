"""verl integration of hdp: ``actor_rollout_ref.actor.strategy=hdp`` selects hdp's engine in stock verl.

Importing this package does not import verl.  The modules that do:

* :mod:`hdp.integrations.verl.plugin` — the ``verl.plugins`` entry point (registers the engine);
* :mod:`hdp.integrations.verl.config` — hdp's verl config classes;
* :mod:`hdp.integrations.verl.engine` — ``HdpMegatronEngine``;
* :mod:`hdp.integrations.verl.compat` — the one module that reads verl's private names;
* :mod:`hdp.integrations.verl.patches` — the one module that patches verl (every patch, in one table).

Supported verl releases: :data:`SUPPORTED_VERL`; on any other the plugin installs nothing and says so
(:func:`check_verl_version`).  Facts about verl these rely on: ``integrations/verl/VERL_NOTES.md``.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["config_dir", "SUPPORTED_VERL", "verl_version", "unsupported_verl", "refusal", "check_verl_version"]

SUPPORTED_VERL = ("0.9.0", "0.9.1")
"""The verl releases this integration runs on, oldest first (its tests run on each)."""


def config_dir() -> str:
    """Absolute path of hdp's Hydra configs for verl (``--config-path`` for ``hdp_ppo_trainer``)."""
    return str(Path(__file__).resolve().parent / "conf")


def verl_version() -> str:
    """The installed verl's version, as verl reports it (``verl.__version__``; imports verl)."""
    import verl

    return str(verl.__version__)


def unsupported_verl(version: str) -> str | None:
    """Why verl ``version`` is refused (names it, the supported range and the fix), or None for a supported
    release (a dev, post or local build of one counts as it)."""
    from packaging.version import InvalidVersion, Version

    try:
        release = ".".join(str(n) for n in (Version(version).release + (0, 0))[:3])
    except InvalidVersion:
        release = None
    if release in SUPPORTED_VERL:
        return None
    lo, hi = SUPPORTED_VERL[0], SUPPORTED_VERL[-1]
    nxt = ".".join([*hi.split(".")[:2], str(int(hi.split(".")[2]) + 1)])
    return (f"hdp's verl integration supports verl {lo} to {hi} ({', '.join(SUPPORTED_VERL)}); this environment has "
            f"verl {version}, so the hdp plugin installed nothing and actor_rollout_ref.actor.strategy=hdp cannot run. "
            f"Fix: pip install 'verl>={lo},<{nxt}' (hdp's [verl] extra pins a supported release), or run verl without "
            "hdp: VERL_USE_EXTERNAL_PLUGINS=none")


def refusal() -> str | None:
    """:func:`unsupported_verl` for the installed verl (:func:`verl_version`)."""
    return unsupported_verl(verl_version())


def check_verl_version() -> None:
    """Raise ``ImportError`` (:func:`unsupported_verl`'s message) unless the installed verl is supported."""
    why = refusal()
    if why is not None:
        raise ImportError(why)
