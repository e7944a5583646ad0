"""Definitions more than one test module needs (a test module never imports another), moved out of
test_memory_cli.py; used by tests/distributed/trainer/test_memory_cli_dist.py,
tests/unit/trainer/test_memory_cli.py."""

from __future__ import annotations

import pytest

from hdp.packing.memory import GB

QWEN = "qwen3-235b-a22b"
ISSUE = ["plan", "--workload", "rl", "--samples", "256", "-N", "16", "--memory-gb", "64", "--shape", QWEN,
         "--layout", "tp1,pp8,ep16", "--json"]


def _check_plan_within_limit(d: dict, limit_gb: float, pp: int = 8) -> None:
    s, lim = d["stats"], limit_gb * GB
    mem = s["memory"]
    assert s["token_budget"] == d["max_tokens_per_rank"] == mem["token_budget"] > 0
    assert mem["limit_bytes"] == lim and mem["within_limit"] is True
    assert mem["static_bytes"] < mem["peak_bytes"] <= lim
    assert max(mem["round_peak_bytes"]) == pytest.approx(mem["peak_bytes"]) and len(mem["round_peak_bytes"]) == d["num_rounds"]
    assert s["pipeline_stages"] == pp and mem["layout"]["pp"] == pp
