"""verl integration of hdp: ``actor_rollout_ref.actor.strategy=hdp`` selects hdp's engine in stock verl.

Importing this package does not import verl.  The modules that do:

* :mod:`hdp.integrations.verl.plugin` — the ``verl.plugins`` entry point (registers the engine);
* :mod:`hdp.integrations.verl.config` — hdp's verl config classes;
* :mod:`hdp.integrations.verl.engine` — ``HdpMegatronEngine``;
* :mod:`hdp.integrations.verl.compat` — the one module that touches verl's private state.

Facts about verl these rely on: ``integrations/verl/VERL_NOTES.md``.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["config_dir"]


def config_dir() -> str:
    """Absolute path of hdp's Hydra configs for verl (``--config-path`` for ``hdp_ppo_trainer``)."""
    return str(Path(__file__).resolve().parent / "conf")
