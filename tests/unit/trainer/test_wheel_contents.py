"""The wheel holds what users run, not this project's CI harness: its modules are listed the way setup.py finds
them (every ``.py`` under the four source roots; tests/slow/trainer/test_wheel.py builds the wheel and checks the same
list),
and none is a CI-only benchmark or fault scenario (those live in ``benchmarks/``, ``python -m benchmarks``)."""

from __future__ import annotations

import re
from pathlib import Path

from helpers.wheel_contents import WHEEL_BENCH

ROOT = Path(__file__).resolve().parents[3]
SOURCES = {"hdp": "hdp", "packing": "hdp.packing", "trainer": "hdp.trainer", "integrations": "hdp.integrations"}

"""`hdp.trainer.bench`'s modules: the commands users run on their own job and machine (``hdp bench
train|regress|device|planner|memory``, ``memory --only logprobs``: the fused log-prob path), what they read (the job, its lengths, paired statistics) and megatron-core's
scheduler as the planner's peer.  A new module here is a decision: a user's command, or CI harness for benchmarks/."""

USER_BENCHES = {"planner", "train", "memory", "device", "regress"}
"""``hdp bench``'s sub-commands."""


def wheel_modules() -> dict[str, Path]:
    """Every module the wheel ships, by dotted name."""
    out = {}
    for src, pkg in SOURCES.items():
        for py in (ROOT / src).rglob("*.py"):
            rel = py.relative_to(ROOT / src).with_suffix("")
            out[".".join([pkg, *rel.parts])] = py
    return out


def ci_only(name: str, path: Path) -> str | None:
    """Why module ``name`` is CI harness, or None: it imports ``benchmarks`` or the tests, or it is a benchmark module
    of the trainer no user command runs, or a verl-side benchmark or fault runner."""
    text = path.read_text()
    if re.search(r"^\s*(from|import)\s+(benchmarks|tests)\b", text, re.M):
        return "imports this project's benchmarks/ or tests/"
    parts = name.split(".")
    if name.startswith("hdp.trainer.bench.") and parts[-1] not in WHEEL_BENCH:
        return f"a benchmark module outside the user commands ({', '.join(sorted(WHEEL_BENCH))})"
    if name.startswith("hdp.integrations.") and re.match(r"(bench|faults?)(_|$)", parts[-1]):
        return "a verl-side benchmark or fault runner"
    return None


def test_the_wheel_holds_no_ci_only_module(tmp_path: Path) -> None:
    modules = wheel_modules()
    assert "hdp.trainer.bench.train" in modules and "hdp.integrations.verl.plugin" in modules  # the listing works
    bad = {name: why for name, path in modules.items() if (why := ci_only(name, path))}
    assert not bad, bad
    assert {n.rsplit(".", 1)[1] for n in modules if n.startswith("hdp.trainer.bench.")} == WHEEL_BENCH
    # the rule catches a CI module put back into the package, and a wheel module importing the harness
    plain = tmp_path / "plain.py"
    plain.write_text("import torch\n")
    assert ci_only("hdp.trainer.bench.faults", plain) is not None
    assert ci_only("hdp.integrations.verl.bench_models", plain) is not None
    assert ci_only("hdp.trainer.bench.train", plain) is None
    harness = tmp_path / "harness.py"
    harness.write_text("def f():\n    from benchmarks.faults import run_faults\n")
    assert ci_only("hdp.trainer.bench.train", harness) is not None


def test_hdp_bench_offers_only_the_user_commands() -> None:
    from hdp.trainer.cli import build_parser

    parser = build_parser()
    bench = next(a for a in parser._subparsers._group_actions[0].choices["bench"]._actions  # noqa: SLF001
                 if a.dest == "bench")
    assert set(bench.choices) == USER_BENCHES
    text = (ROOT / "pyproject.toml").read_text()
    assert "hdp.benchmarks" not in text and "hdp.faults" not in text  # no entry point into the CI harness
