"""Node-aware plans: the topology as a planner input, the two-level cost model, placement, bounds.

A domain over several nodes (`PlannerConfig.node_of`): a group whose ring crosses a node boundary
pays the inter-node link on every ring step (`CostModel.node_step_latency`, `node_comm_per_token`);
the hdp policy prices groups wider than a node across nodes and places the others inside nodes
where that is cheaper.  One node plans exactly as without a topology (the golden checksums of
tests/unit/packing/test_planner_golden.py hold them; here: an all-on-one-node map plans the same plan).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hdp.packing import CostModel, Plan, PlannerConfig, check_plan, cost_model, plan, simulate
from hdp.packing.cost_file import load_cost_model
from hdp.packing.simulate import lower_bound, lower_bound_tight, ring_traffic
from hdp.packing.topology import Nodes, check_node_of, domain_node_map, node_map
from hdp.packing.workloads import get_workload

REL = 1e-9


def _two_level(**over) -> CostModel:
    """deepseek-v3 on h100-nvlink (NVLink inside a node, NDR InfiniBand between): its K/V is wide
    enough that a ring across nodes shows in the step time."""
    return dataclasses.replace(cost_model("deepseek-v3", "h100-nvlink"), **over)


# ------------------------------------------------------------------------------------ the input


def test_node_map_and_its_checks():
    assert node_map(8, 8) is None and node_map(4, 8) is None
    assert node_map(10, 4) == (0, 0, 0, 0, 1, 1, 1, 1, 2, 2)
    assert check_node_of([3, 3, 7, 7], 4, "f") == (0, 0, 1, 1)  # relabelled in rank order
    assert check_node_of([5, 5, 5], 3, "f") is None  # one node is no topology
    for bad, what in (([0, 1, 0, 1], "contiguous run"), ([0, 0, 1], "num_ranks=4"), ([0, -1, 1, 1], "integer >= 0"),
                      ("0011", "node of every domain rank")):
        with pytest.raises(ValueError, match=what):
            check_node_of(bad, 4, "config.node_of")
    with pytest.raises(ValueError, match="config.node_of"):
        PlannerConfig(num_ranks=4, max_tokens_per_rank=64, node_of=(0, 1, 0, 1))


def test_domain_node_map_takes_the_nodes_every_domain_agrees_on():
    # TP 2 x domain 4 x PP 1 on 4 ranks per node, Megatron's tp-cp-ep-dp-pp order: domains of the two
    # TP ranks are (0, 2, 4, 6) and (1, 3, 5, 7): domain ranks 0-1 on node 0, 2-3 on node 1
    assert domain_node_map([[0, 2, 4, 6], [1, 3, 5, 7]], 4) == (0, 0, 1, 1)
    # TP 3 on 4 ranks per node: the TP ranks' nodes disagree; ranks share a node only where all agree
    doms = [[t + 3 * d for d in range(4)] for t in range(3)]  # (0,3,6,9), (1,4,7,10), (2,5,8,11)
    assert domain_node_map(doms, 4) == (0, 1, 2, 3)
    assert domain_node_map([[0, 1, 2, 3]], 8) is None
    with pytest.raises(ValueError, match="local_world_size"):
        domain_node_map([[0, 1]], 0)


def test_one_node_plans_exactly_as_without_a_topology():
    lengths = get_workload("rl")(n=256, seed=3, response_cap=16_384)
    base = PlannerConfig(num_ranks=16, max_tokens_per_rank=4096, cost=_two_level())
    same = dataclasses.replace(base, node_of=(0,) * 16)
    assert same.node_of is None and same == base
    assert plan(lengths, base).checksum() == plan(lengths, same).checksum()


def test_the_topology_is_part_of_the_plan_and_its_checksum():
    lengths = get_workload("lognormal")(n=128, seed=1)
    cfg = PlannerConfig(num_ranks=16, max_tokens_per_rank=4096, cost=_two_level(), node_of=node_map(16, 8))
    p = plan(lengths, cfg)
    assert p.node_of == node_map(16, 8)
    assert p.checksum() != p.on_nodes(None).checksum()  # the same groups, another input
    back = Plan.from_dict(json.loads(p.to_json()))
    assert back == p and back.checksum() == p.checksum()
    assert plan(lengths, cfg).checksum() == p.checksum()  # deterministic


# --------------------------------------------------------------------------- the two-level model


def test_a_ring_across_nodes_pays_the_slower_link():
    cost = _two_level()
    L = np.array([4096, 2048])
    inside = cost.packed_cost(L, 4)
    across = cost.packed_cost(L, 4, cross=True)
    lp = np.ceil(L / 8) * 8
    local = lp.sum() / 4
    slow = max(cost.step_latency + cost.comm_per_token * local, cost.node_step_latency + cost.node_comm_per_token * local)
    expect = cost.work(lp).sum() / 4 + 3 * (cost.step_overhead + max(0.0, slow - (lp * lp).sum() / 16)
                                            + cost.merge_per_token * local) + cost.cp_per_token * local
    assert across == pytest.approx(expect, rel=1e-12) and across > inside
    one_level = dataclasses.replace(cost, node_step_latency=0.0, node_comm_per_token=0.0)
    assert one_level.packed_cost(L, 4, cross=True) == one_level.packed_cost(L, 4)
    # the profiles: the inter-node link of every profile is the slower one
    for prof in ("h100-nvlink", "ascend-910b-hccs", "cpu-gloo"):
        c = cost_model("qwen3-235b-a22b", prof)
        assert c.node_comm_per_token >= c.comm_per_token > 0 and c.node_step_latency >= c.step_latency > 0, prof


def test_old_cost_files_load_with_one_level(tmp_path):
    cost = _two_level()
    path = tmp_path / "cost.json"
    cost.save(path)
    assert load_cost_model(path) == cost
    doc = json.loads(path.read_text())
    for key in ("node_step_latency", "node_comm_per_token"):
        del doc["parameters"][key]
    doc["version"] = 2
    path.write_text(json.dumps(doc))
    old = load_cost_model(path)
    assert old.node_step_latency == old.node_comm_per_token == 0.0 and old.comm_per_token == cost.comm_per_token


def test_simulate_prices_crossing_groups_and_counts_their_traffic():
    cost = _two_level()
    # one round: a CP4 group on ranks 2..5 (nodes of 4: it spans two) and a CP2 group on 0..1
    p = Plan.from_columns(num_ranks=8, max_tokens_per_rank=4096, policy="hand", lengths=np.array([8000, 4000]),
                          round_of=np.array([0, 0]), group_start=np.array([2, 0]), group_size=np.array([4, 2]),
                          node_of=node_map(8, 4))
    s = simulate(p, cost)
    assert s.step_time == pytest.approx(cost.packed_cost([8000], 4, cross=True) + cost.round_cost, rel=1e-12)
    assert s.step_time > simulate(p.on_nodes(None), cost).step_time
    total, crossing, groups = ring_traffic(p)
    assert groups == 1 and total == 3 * 8000 + 1 * 4000 and crossing == pytest.approx(3 * 8000 * 2 / 4)
    assert s.cross_node_fraction == pytest.approx(crossing / total) and s.nodes == 2
    assert simulate(p.on_nodes(None), cost).cross_node_fraction == 0.0


# ------------------------------------------------------------------------------------ placement


@pytest.mark.parametrize("shape", ["any", "pow2"])
@pytest.mark.parametrize("family", ["rl", "wikipedia", "bimodal"])
def test_node_aware_plans_are_valid_and_within_their_bounds(family, shape):
    N, per_node = 32, 8
    nodes = node_map(N, per_node)
    lengths = get_workload(family)(n=16 * N, seed=0, **({"response_cap": 32_768} if family == "rl" else {}))
    cost = _two_level()
    blind_cfg = PlannerConfig(num_ranks=N, max_tokens_per_rank=4096, cost=cost, group_shape=shape)
    aware = plan(lengths, dataclasses.replace(blind_cfg, node_of=nodes))
    blind = simulate(plan(lengths, blind_cfg).on_nodes(nodes), cost)
    check_plan(aware, pow2=shape == "pow2")
    # placed node by node: it crosses less than the node-blind plan of the same batch (aligned
    # power-of-two blocks no wider than a node never cross: there both are 0 but for wide blocks)
    assert aware.stats.cross_node_fraction <= blind.cross_node_fraction + REL
    if shape == "any":
        assert aware.stats.cross_node_fraction < blind.cross_node_fraction
    tight = lower_bound_tight(lengths, N, 4096, cost, node_ranks=per_node)
    assert tight <= aware.stats.step_time * (1 + REL) and tight <= blind.step_time * (1 + REL)
    assert tight >= lower_bound_tight(lengths, N, 4096, cost) * (1 - REL)  # it knows wide groups cross
    assert lower_bound(lengths, N, 4096, cost, node_ranks=per_node) <= aware.stats.step_time * (1 + REL)


@pytest.mark.parametrize("shape", ["any", "pow2"])
@pytest.mark.parametrize("family", ["rl", "wikipedia", "bimodal"])
def test_node_aware_plans_are_never_slower_than_node_blind_ones(family, shape):
    """The node-blind plan is one of the rivals (`rivals.HDP_ONE_NODE`) where the rivals pool holds it (a
    batch this small); larger batches are measured side by side (``hdp simulate --ranks-per-node``)."""
    N, per_node = 16, 4
    nodes = node_map(N, per_node)
    lengths = get_workload(family)(n=48, seed=2, **({"response_cap": 16_384} if family == "rl" else {}))
    cost = _two_level()
    blind_cfg = PlannerConfig(num_ranks=N, max_tokens_per_rank=2048, cost=cost, group_shape=shape)
    aware = plan(lengths, dataclasses.replace(blind_cfg, node_of=nodes))
    blind = simulate(plan(lengths, blind_cfg).on_nodes(nodes), cost)
    check_plan(aware, pow2=shape == "pow2")
    assert aware.stats.step_time <= blind.step_time * (1 + REL), (aware.stats.step_time, blind.step_time)


def test_a_group_crosses_when_the_alternative_costs_more():
    # two nodes of 4 ranks, one sample needing 5 ranks: no plan keeps it inside a node
    cost = _two_level()
    cfg = PlannerConfig(num_ranks=8, max_tokens_per_rank=4096, cost=cost, node_of=node_map(8, 4))
    p = plan([5 * 4096 - 64] + [1000] * 6, cfg)
    check_plan(p)
    assert p.stats.cross_node_groups >= 1 and max(p.stats.cp_degree_hist) >= 5


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(4, 40), per_node=st.sampled_from([2, 3, 4]), nodes=st.integers(2, 4), seed=st.integers(0, 10**6),
       shape=st.sampled_from(["any", "pow2"]), slow=st.floats(1.0, 1e4))
def test_hdp_is_never_worse_than_its_rivals_on_nodes(n, per_node, nodes, seed, shape, slow):
    rng = np.random.default_rng(seed)
    N = per_node * nodes
    if shape == "pow2":
        N = 1 << int(np.floor(np.log2(N)))
    B = 512
    lengths = np.clip(rng.lognormal(np.log(300), 1.0, n).astype(int), 1, B * (N if shape == "any" else N) - 2 * N)
    base = _two_level()
    cost = dataclasses.replace(base, node_comm_per_token=base.comm_per_token * slow,
                               node_step_latency=base.step_latency * slow)
    nm = node_map(N, per_node)
    cfg = PlannerConfig(num_ranks=N, max_tokens_per_rank=B, cost=cost, group_shape=shape, node_of=nm)
    try:
        mine = plan(lengths, cfg)
    except ValueError:
        return  # a sample no power-of-two block of this domain holds
    check_plan(mine, pow2=shape == "pow2")
    for policy in ("static-cp", "verl-kk", "megatron-dcp", "ascend-hdp"):
        try:
            other = plan(lengths, dataclasses.replace(cfg, policy=policy, node_of=None))
        except ValueError:
            continue
        if other.stats.max_tokens_per_rank > B or (shape == "pow2" and np.any(other.group_size & (other.group_size - 1))):
            continue
        t_other = simulate(other.on_nodes(nm), cost).step_time
        assert mine.stats.step_time <= t_other * (1 + 1e-8), (policy, mine.stats.step_time, t_other)


def test_nodes_arrays():
    nd = Nodes.of(node_map(10, 4), 10)
    assert nd.count == 3 and nd.largest == 4 and nd.first.tolist() == [0, 4, 8, 10]
    assert nd.spans(np.array([0, 3, 2, 8]), np.array([4, 2, 7, 2])).tolist() == [1, 2, 3, 1]


# ---------------------------------------------------------------------------------- calibration


def _records(truth: CostModel, rng: np.random.Generator, across: bool) -> list[dict]:
    out = []
    for i in range(160):
        k = int(rng.integers(1, 7))
        m = int(rng.integers(2, min(k, 3) + 1)) if across and k >= 2 and i % 2 else 1
        lengths = rng.integers(64, 2048, int(rng.integers(1, 5))).tolist()
        t = truth.packed_cost(lengths, k, cross=m > 1) * truth.unit_time_s * float(np.exp(rng.normal(0, 0.01)))
        out.append({"kind": "group", "lengths": lengths, "group_size": k, "seconds": t, **({"nodes": m} if m > 1 else {})})
    return out


def test_calibration_fits_both_links_from_records_that_say_their_nodes():
    from hdp.packing.calibrate import calibrate

    base = cost_model("dense-8b", "h100-nvlink")
    truth = dataclasses.replace(base, comm_per_token=base.comm_per_token * 3, node_comm_per_token=base.comm_per_token * 60,
                                node_step_latency=base.step_latency * 4)
    rng = np.random.default_rng(0)
    res = calibrate(_records(truth, rng, across=True), base)
    assert "node_comm_per_token" in res.fitted, res.reasons
    seconds = lambda c, name: getattr(c, name) * c.unit_time_s  # noqa: E731 - the fit may rescale the unit
    assert seconds(res.cost, "node_comm_per_token") == pytest.approx(seconds(truth, "node_comm_per_token"), rel=0.1)
    assert res.r2 > 0.99
    # a domain inside one node: the inter-node terms are the base's, and the fit says why
    inside = calibrate(_records(truth, np.random.default_rng(1), across=False), base)
    assert {"node_step_latency", "node_comm_per_token"} <= set(inside.from_base)
    assert "spans two nodes" in inside.reasons["node_comm_per_token"]
    assert inside.cost.node_comm_per_token == pytest.approx(base.node_comm_per_token * base.unit_time_s
                                                            / inside.cost.unit_time_s)
    with pytest.raises(ValueError, match="nodes"):
        calibrate([{"lengths": [100], "group_size": 2, "seconds": 1.0, "nodes": 3}], base)


def test_the_self_calibration_window_records_each_groups_nodes():
    from hdp.packing.autocal import CostWindow

    p = Plan.from_columns(num_ranks=8, max_tokens_per_rank=4096, policy="hand", lengths=np.array([8000, 4000, 100]),
                          round_of=np.array([0, 0, 0]), group_start=np.array([2, 0, 6]), group_size=np.array([4, 2, 1]),
                          node_of=node_map(8, 4))
    w = CostWindow(64)
    w.add_step(p, np.full((8, 1), 0.5))
    (rnd,) = w.rounds()
    spans = sorted((g["group_size"], g.get("nodes", 1)) for g in rnd.groups)
    assert spans == [(1, 1), (2, 1), (4, 2)]


# ------------------------------------------------------------------------- the doors: job, CLI


def test_the_job_node_map_follows_megatrons_rank_order():
    from hdp.core.planning import job_node_map, launcher_ranks_per_node

    # the Ascend Qwen3-235B recipe's layout: TP 1 x PP 8 x domain 16 on nodes of 8: a stage's 16 domain ranks on two nodes
    assert job_node_map(1, 8, 16, 8) == node_map(16, 8)
    # TP 2 x domain 8 on nodes of 4: two domain ranks per node
    assert job_node_map(2, 1, 8, 4) == node_map(8, 2)
    assert job_node_map(1, 1, 8, 8) is None and job_node_map(2, 2, 4, None) is None
    with pytest.raises(ValueError, match="whole number of nodes"):
        job_node_map(1, 1, 12, 8)
    assert launcher_ranks_per_node({}) is None
    assert launcher_ranks_per_node({"RAY_LOCAL_WORLD_SIZE": "8"}) == 8  # verl's Ray workers
    assert launcher_ranks_per_node({"LOCAL_WORLD_SIZE": "4"}) == 4  # torchrun
    # a Ray worker of verl: verl's Worker writes LOCAL_WORLD_SIZE=1 when no launcher set it; Ray's count wins
    assert launcher_ranks_per_node({"LOCAL_WORLD_SIZE": "1", "RAY_LOCAL_WORLD_SIZE": "8"}) == 8
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        launcher_ranks_per_node({"LOCAL_WORLD_SIZE": "zero"})
    for bad in (str(10**30), "65537", "-2", "9" * 5000):  # absurdly large (an OverflowError once), negative
        with pytest.raises(ValueError, match=r"^LOCAL_WORLD_SIZE='.*': the launcher's ranks per node must be an integer "
                                             r"in \[1, 65536\]"):
            launcher_ranks_per_node({"LOCAL_WORLD_SIZE": bad})
    from hdp.core.planning import launcher_topology

    # what the engines agree on: the variable in effect, and the one after it never read (so it may differ)
    assert launcher_topology({"LOCAL_WORLD_SIZE": "1", "RAY_LOCAL_WORLD_SIZE": "8"}) == {
        "RAY_LOCAL_WORLD_SIZE": "'8'", "LOCAL_WORLD_SIZE": "not read (RAY_LOCAL_WORLD_SIZE is set)"}
    assert launcher_topology({"LOCAL_WORLD_SIZE": "4"}) == {"RAY_LOCAL_WORLD_SIZE": "unset", "LOCAL_WORLD_SIZE": "'4'"}


def test_the_kernels_price_rings_across_nodes_as_the_cost_model_to_the_bit():
    from hdp.packing.cost import PARAMETERS, SizePricedCost, padded_float
    from hdp.packing.policies.hdp.kernels import costs

    rng = np.random.default_rng(5)
    for _ in range(10):
        values = {f: 0.0 if rng.random() < 0.3 else float(10 ** rng.uniform(-3, 6)) for f in PARAMETERS[:-1]}
        cost = CostModel(**values)
        k = rng.integers(1, 40, 400)
        lengths = rng.integers(1, 2**20, 400)
        lp = padded_float(lengths, k)
        sw, sl, sq = cost.work(lp) * 2.5, lp * 2.5, lp * lp * 2.5
        cross = rng.random(400) < 0.5
        p = costs.cost_params(cost)
        got = np.array([costs.group_cost_at(p, sw[i], sl[i], sq[i], k[i], cross[i]) for i in range(k.size)])
        assert np.array_equal(got, cost.group_cost(sw, sl, sq, k, cross))
        sized = SizePricedCost(**values, node_ranks=8)
        p8 = costs.cost_params(sized)
        got8 = np.array([costs.group_cost(p8, sw[i], sl[i], sq[i], k[i]) for i in range(k.size)])
        assert np.array_equal(got8, cost.group_cost(sw, sl, sq, k, k > 8))
        assert np.array_equal(got8, sized.group_cost(sw, sl, sq, k))
