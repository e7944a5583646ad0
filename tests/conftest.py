"""Test tiers, applied to every test at collection (no test needs to remember a marker).

- ``dist``: the test starts other processes (gloo ranks through ``run_distributed``, the CLI or
  ``main_ppo`` in a subprocess, a wheel build). Found from the test's own source, or marked by hand.
- ``slow``: marked by hand on tests that take more than ~20 s in one process.
- ``fast``: everything else. ``make test-fast`` runs only these (``-m fast``): no second process, a few
  minutes on 2 cores, the tier to run while working. ``make test`` (CI) runs every tier.
"""

from __future__ import annotations

import importlib.util
import inspect

import pytest

from hdp.trainer import launch

if importlib.util.find_spec("verl") is not None:  # verl's imports once, in the fork server the ranks start from
    launch.PRELOAD = (*launch.PRELOAD, "hdp.integrations.verl.scaffolding.preload")

_SPAWNS = ("run_distributed(", "subprocess", "spawn(", "main_ppo", "sys.executable", "hdp_main(", "hdp_json(",
           "bench_main(", "bench_json(")
"""Source text of a test (or a helper it calls) that starts processes: ``hdp_main`` / ``hdp_json`` run a command
in this process, whose benches start ranks."""


def _calls_spawn(fn, module, depth: int) -> bool:
    """Whether ``fn``'s source, or that of a module-level function it names (``depth`` levels down), starts processes."""
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError):
        return False
    if any(s in src for s in _SPAWNS):
        return True
    if depth == 0:
        return False
    code = getattr(fn, "__code__", None)
    names = set(code.co_names) if code is not None else set()
    for name in names:
        callee = getattr(module, name, None)
        if inspect.isfunction(callee) and callee.__module__ == module.__name__ and callee is not fn:
            if _calls_spawn(callee, module, depth - 1):
                return True
    return False


def _starts_processes(item: pytest.Item) -> bool:
    """Whether the test's function (or a helper of its module it calls, two levels down) starts processes."""
    fn = getattr(item, "function", None)
    return fn is not None and _calls_spawn(fn, item.module, depth=2)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test ``dist`` when it starts processes and ``fast`` when it is neither ``dist`` nor ``slow``."""
    for item in items:
        if item.get_closest_marker("dist") is None and _starts_processes(item):
            item.add_marker(pytest.mark.dist)
        if item.get_closest_marker("dist") is None and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.fast)
