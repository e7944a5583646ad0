"""The house's dependencies point one way: packing ← hdp (the runtime and the step stack, `hdp.core`) ←
trainer (the library door) ← integrations.  Read from the import statements of every module (no import
runs), so a module that reaches the wrong way fails here, whatever its name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
LAYERS = {
    "packing": ("hdp.core", "hdp.trainer", "hdp.integrations", "torch"),
    "hdp": ("hdp.trainer", "hdp.integrations"),
    "trainer": ("hdp.integrations",),
}
"""Source folder -> module prefixes none of its modules may import."""

VERL_DOOR_ALLOWED = ("scaffolding", "bench", "bench_models", "bench_old_log_prob", "faults", "demo")
"""Modules of the verl plugin that run the library door beside verl's (benchmarks, fault scenarios, the demo,
the CPU test models); the door itself — engine, loss, batch, checks, config, ... — imports the shared step
stack (`hdp.core`) and the runtime only."""


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
    return out


def _violations(folder: str, banned: tuple[str, ...], skip: tuple[str, ...] = ()) -> list[str]:
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        rel = path.relative_to(ROOT / folder)
        if rel.parts and rel.parts[0].removesuffix(".py") in skip:
            continue
        for line, name in _imports(path):
            if any(name == b or name.startswith(b + ".") for b in banned):
                bad.append(f"{folder}/{rel}:{line} imports {name}")
    return bad


@pytest.mark.parametrize("folder", sorted(LAYERS))
def test_no_layer_imports_a_layer_above_it(folder: str) -> None:
    bad = _violations(folder, LAYERS[folder])
    assert not bad, "\n".join(bad)


def test_the_verl_door_runs_on_the_shared_stack_not_the_library_door() -> None:
    bad = _violations("integrations/verl", ("hdp.trainer",), skip=VERL_DOOR_ALLOWED)
    assert not bad, "\n".join(bad)
    # the check can fail: the benches it allows do import the library door
    assert _violations("integrations/verl", ("hdp.trainer",))


def test_both_doors_build_the_step_stack_through_one_builder() -> None:
    """`hdp.core.stack.build_steps` is the only place that constructs the round core, the planner and the
    step sequence in the product (the tests and benches build pieces to probe them)."""
    makers = ("RoundCore(", "DomainPlanner(", "Steps(")
    found = {}
    for folder in ("hdp", "trainer", "integrations"):
        for path in (ROOT / folder).rglob("*.py"):
            rel = str(path.relative_to(ROOT))
            if "/bench" in rel or "/scaffolding/" in rel:
                continue
            text = path.read_text()
            hits = [m for m in makers if f" {m}" in text or f"={m}" in text or f"({m}" in text]
            if hits:
                found[rel] = hits
    assert found == {"hdp/core/stack.py": list(makers)}, found
    for door in ("trainer/engine.py", "integrations/verl/engine.py"):
        assert "build_steps(" in (ROOT / door).read_text(), door
