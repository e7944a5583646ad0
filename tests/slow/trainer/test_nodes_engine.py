"""The engine's CP rings on a domain emulating two nodes (4 gloo ranks, nodes of 2, a slow link between
them: `benchmarks.nodes.emulate_nodes`): node-aware plans -- the launcher's ``LOCAL_WORLD_SIZE``
gives the planner the nodes -- and node-blind plans train the same batches from the same weights to the
same losses (fp32 round-off: the update does not depend on the plan), and the two plans differ where it
matters: the node-blind ones run rings across the emulated nodes, the node-aware ones do not.  The time
this saves is the benchmark's (``python -m benchmarks nodes``), not a unit test's."""

from __future__ import annotations

import numpy as np


def test_node_aware_and_node_blind_plans_train_to_the_same_losses():
    from benchmarks.nodes import NodesBenchSpec, run_nodes

    out = run_nodes(NodesBenchSpec(steps=3))
    aware, blind = out["node-aware"], out["node-blind"]
    np.testing.assert_allclose(aware["loss"], blind["loss"], rtol=1e-5, atol=0.0)
    assert np.isfinite(aware["loss"]).all() and len(aware["loss"]) == 3
    assert max(aware["cross_node_fraction"]) == 0.0, aware
    assert max(blind["cross_node_fraction"]) > 0.0, blind  # the comparison compares different plans
    # the cost model the planners share says what the emulated link costs
    assert sum(blind["predicted_s"]) > sum(aware["predicted_s"])


def test_bench_nodes_through_the_command_line():
    from helpers.cli_helper import bench_json

    n = bench_json("nodes", "--steps", "2", "--json")["nodes"]
    assert {"median_step_s", "timed_s", "blind_over_aware", "predicted_blind_over_aware", "cross_node_fraction",
            "losses", "max_loss_rel_diff", "cost_model"} <= set(n)
    assert n["max_loss_rel_diff"] <= 1e-5 and len(n["losses"]["node-aware"]) == 2
