"""Definitions more than one test module needs (a test module never imports another), moved out of
test_verl_main_ppo.py; used by tests/slow/verl/test_verl_main_ppo.py, tests/unit/verl/test_verl_recipe.py."""

from __future__ import annotations


def _step_metrics(line: str) -> dict[str, float]:
    """Every ``name:value`` of one verl console step line (NaN kept as NaN)."""
    out = {}
    for part in line.split(" - "):
        name, _, value = part.strip().rpartition(":")
        try:
            out[name] = float(value)
        except ValueError:
            continue
    return out
