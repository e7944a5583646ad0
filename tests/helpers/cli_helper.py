"""``hdp ARGS`` in the test process: `hdp.trainer.cli.main` (what the ``hdp`` console script calls) with its
standard output and error captured.  The benches it runs start their ranks from this process's fork server,
which has torch, Megatron-core (and verl) imported already, so a command costs its own work, not ~10 s of
imports in a new interpreter and a new fork server.  The console script itself runs in a subprocess elsewhere
(tests/slow/trainer/test_wheel.py from an installed wheel, tests/slow/verl/test_verl_main_ppo.py,
tests/slow/trainer/test_faults.py)."""

from __future__ import annotations

import contextlib
import io
import json
from typing import Any

__all__ = ["hdp_main", "hdp_json", "bench_main", "bench_json"]


def hdp_main(*args: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``hdp ARGS``."""
    from hdp.trainer.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return int(code or 0), out.getvalue(), err.getvalue()


def bench_main(*args: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``python -m benchmarks ARGS`` (this project's CI benches, outside the wheel),
    in this process."""
    from benchmarks.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return int(code or 0), out.getvalue(), err.getvalue()


def bench_json(*args: str) -> dict[str, Any]:
    """The JSON object ``python -m benchmarks ARGS`` printed last; asserts it exited 0."""
    code, out, err = bench_main(*args)
    assert code == 0, f"python -m benchmarks {' '.join(args)} exited {code}:\n{err[-3000:]}\n{out[-2000:]}"
    return json.loads(out.strip().splitlines()[-1])


def hdp_json(*args: str) -> dict[str, Any]:
    """The JSON object ``hdp ARGS`` printed last; asserts it exited 0."""
    code, out, err = hdp_main(*args)
    assert code == 0, f"hdp {' '.join(args)} exited {code}:\n{err[-3000:]}\n{out[-2000:]}"
    return json.loads(out.strip().splitlines()[-1])
