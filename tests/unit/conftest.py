"""The unit tier starts no process: a test under tests/unit/ that starts one fails, naming what it started.

Guarded for every unit test: ``subprocess`` (``Popen`` and all that calls it), ``multiprocessing`` processes
(``hdp.trainer.launch.spawn``'s gloo ranks, fork servers included) and ``os``'s own ways (``fork``,
``posix_spawn``, ``system``, ...).  The failure is raised where the process would start, and again when the
test returns (a test that caught it still fails), so a test's path cannot lie about its tier: a test that needs
another process belongs in tests/distributed/<area>/ (or tests/slow/<area>/ past ~20 s).

The standard library's one-off probe, ``platform``'s ``uname -p`` (run once per process, on the first
``platform.platform()`` or ``platform.processor()``), runs here, before any guard.
"""

from __future__ import annotations

import multiprocessing.process
import os
import platform
import subprocess

import pytest

platform.uname().processor  # noqa: B018 - the one-off ``uname -p`` of the standard library, before any guard

_OS_STARTS = ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "spawnv", "spawnve", "spawnvp", "spawnvpe")
"""``os`` functions that start a process without ``subprocess`` (``os.popen`` goes through ``subprocess``)."""
_STARTED = pytest.StashKey[list]()
"""What a test tried to start (on the test's item)."""


def _message(nodeid: str, what: str) -> str:
    return (f"{nodeid} is a unit test (tests/unit/) and started a process ({what}); "
            "move it to tests/distributed/<area>/ (or tests/slow/<area>/ past ~20 s)")


@pytest.fixture(autouse=True)
def _starts_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """Refuse every way of starting a process while the test (and its fixtures) run."""
    started = request.node.stash.setdefault(_STARTED, [])

    def refusing(what: str):
        def refuse(*args, **kwargs):
            started.append(what)
            pytest.fail(_message(request.node.nodeid, what), pytrace=False)

        return refuse

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refusing("subprocess.Popen"))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refusing("a multiprocessing process"))
    for name in _OS_STARTS:
        if hasattr(os, name):
            monkeypatch.setattr(os, name, refusing(f"os.{name}"))
    yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """A unit test that caught the refusal still fails."""
    result = yield
    started = item.stash.get(_STARTED, [])
    if started:
        pytest.fail(_message(item.nodeid, started[0]) + "; the test caught the failure", pytrace=False)
    return result
