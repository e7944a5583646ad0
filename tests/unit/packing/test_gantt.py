"""Gantt charts of plans."""

from __future__ import annotations

import numpy as np

from hdp.packing import Plan, cost_model
from hdp.packing.simulate import simulate
from hdp.trainer.cli.gantt import plot_gantt


def _plan(num_ranks: int, rng: np.random.Generator) -> Plan:
    # a hand-built valid plan (independent of the policies): round 0 has one 4-rank group and
    # single-rank samples, round 1 only single-rank samples
    lengths = [16_000] + [int(x) for x in rng.integers(200, 3000, 3 * num_ranks)]
    round_of, start, size = [0], [0], [4]
    for i in range(1, len(lengths)):
        r = i % 2
        rank = (4 + i % (num_ranks - 4)) if r == 0 else i % num_ranks
        round_of.append(r), start.append(rank), size.append(1)
    p = Plan.from_columns(num_ranks=num_ranks, max_tokens_per_rank=1 << 20, policy="handmade",
                          lengths=np.array(lengths), round_of=np.array(round_of),
                          group_start=np.array(start), group_size=np.array(size))
    return p


def test_png_written_small(tmp_path):
    cost = cost_model("deepseek-v3", "ascend-910b-hccs")
    p = _plan(8, np.random.default_rng(0))
    p = p.with_stats(simulate(p, cost))
    out = plot_gantt(p, cost, tmp_path / "g.png")
    data = (tmp_path / "g.png").read_bytes()
    assert out.endswith("g.png") and data[:4] == b"\x89PNG" and len(data) > 5_000


def test_png_written_many_ranks(tmp_path):
    cost = cost_model()
    p = _plan(128, np.random.default_rng(1))  # no stats: title falls back to the simulated T
    plot_gantt(p, cost, tmp_path / "big.png", title="big")
    assert (tmp_path / "big.png").stat().st_size > 5_000
