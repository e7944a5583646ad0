"""Test tiers, from the test's path alone: no test carries a tier marker, none is guessed from its source.

Tests are laid out like the package, the tier first: ``tests/<tier>/<area>/test_*.py`` with area ``packing``
(hdp.packing, the planner), ``hdp`` (the runtime, hdp.core included), ``trainer`` (hdp.trainer: the library
door, the CLI, the benches) or ``verl`` (hdp.integrations.verl, the plugin).  What tests share lives in the
package ``tests/helpers/`` (``from helpers.dist_helper import run_distributed``): this folder is on
``sys.path`` because this conftest.py is here (pytest's default ``prepend`` import mode), and gloo ranks
started by ``hdp.trainer.launch.spawn`` take the parent's ``sys.path``, so they unpickle test functions too.

- ``tests/unit/`` → ``fast``: no second process (tests/unit/conftest.py fails a unit test that starts one), a
  few minutes on 2 cores; ``make test-fast`` runs these, the tier to run while working.
- ``tests/distributed/`` → ``dist``: starts other processes (gloo ranks through ``run_distributed``, the CLI
  or ``main_ppo`` in a subprocess, a wheel build), each test under ~20 s.
- ``tests/slow/`` → ``slow``: more than ~20 s; most start processes, a few run long in one process.  The
  three markers split the suite as the folders do (``-m "dist or slow"``: every test that may start a
  process).  ``make test`` (CI) runs every tier.

A test file outside these folders, or a test marked ``fast``/``dist``/``slow`` by hand, stops the run.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from hdp.trainer import launch

if importlib.util.find_spec("verl") is not None:  # verl's imports once, in the fork server the ranks start from
    launch.PRELOAD = (*launch.PRELOAD, "hdp.integrations.verl.scaffolding.preload")


_TIERS = {"unit": "fast", "distributed": "dist", "slow": "slow"}
"""The tier folders under tests/ and the marker their tests get."""
_TESTS = Path(__file__).resolve().parent


def _tier(item: pytest.Item) -> str:
    """The tier folder of the test's file (a file elsewhere stops the run, naming the folders)."""
    try:
        parts = Path(str(item.path)).resolve().relative_to(_TESTS).parts
    except ValueError:
        parts = ()
    if len(parts) < 3 or parts[0] not in _TIERS:
        raise pytest.UsageError(
            f"{item.nodeid}: a test file lives in tests/<tier>/<area>/, tier one of {', '.join(_TIERS)} and area one "
            "of packing, hdp, trainer, verl (tests/conftest.py); move the file there"
        )
    return parts[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test with its folder's tier: ``fast`` (tests/unit), ``dist`` (tests/distributed), ``slow``."""
    for item in items:
        tier = _tier(item)
        hand = sorted({m.name for m in item.iter_markers()} & set(_TIERS.values()))
        if hand:
            raise pytest.UsageError(
                f"{item.nodeid}: marked {hand[0]!r} by hand, but the tier is the folder (tests/{tier}/ is "
                f"{_TIERS[tier]!r}); drop the marker and move the file to the folder of its tier"
            )
        item.add_marker(getattr(pytest.mark, _TIERS[tier]))
