"""The distributed tier (other processes) of the tests tests/unit/packing/test_planner_topology.py describes: its docstring says what they check and how."""

from __future__ import annotations

import json

from hdp.packing.topology import node_map


def _hdp(*args: str) -> dict:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "hdp.trainer", *args], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_cli_plans_and_simulates_on_nodes():
    common = ["--workload", "rl-32k", "--samples", "256", "-N", "16", "-B", "4096", "--model", "deepseek-v3"]
    on_nodes = _hdp("plan", *common, "--ranks-per-node", "8", "--json")
    flat = _hdp("plan", *common, "--json")
    assert on_nodes["node_of"] == list(node_map(16, 8)) and "node_of" not in flat
    assert on_nodes["checksum"] != flat["checksum"]
    assert on_nodes["stats"]["nodes"] == 2 and flat["stats"]["nodes"] == 1
    sim = _hdp("simulate", *common, "--ranks-per-node", "8", "--json", "--no-peers")
    rows = {c["policy"]: c for c in sim["cases"] if "error" not in c}
    assert {"hdp", "hdp-node-blind", "static-cp", "megatron-dcp"} <= set(rows)
    assert all("cross_node_fraction" in r and r["nodes"] == 2 for r in rows.values())
    assert rows["hdp"]["step_time"] <= rows["hdp-node-blind"]["step_time"] * (1 + 1e-9)
    assert rows["hdp"]["cross_node_fraction"] < rows["hdp-node-blind"]["cross_node_fraction"]
    assert sim["cost_model"] == "deepseek-v3@h100-nvlink"
