"""``python -m benchmarks nodes``: the engine's CP rings on a domain emulating two nodes with a slow link between them.

Four local gloo ranks are two "nodes" of two (`emulate_nodes`): every ring exchange between ranks of
different nodes completes no earlier than `hdp.packing.profiles.CPU_NODE_LINK_US` after it was posted
(the transfer of a slow inter-node link; compute overlaps it, as on hardware), exchanges inside a node
run at gloo's own speed.  The ``cpu-gloo`` profile's inter-node link is gloo's plus that wait, so the
two-level cost model knows what the emulation does.

Two engines start from the same weights and train the same batches, step by step alternately (and
which goes first alternates), so slow phases of a shared machine hit both alike:

* **node-aware**: built with the launcher saying two ranks per node (``LOCAL_WORLD_SIZE=2``): its
  planner knows the nodes (`hdp.core.planning.job_node_map`), prices rings across them on the slow
  link and keeps groups inside nodes where that is cheaper;
* **node-blind**: built without it: the same planner, one node assumed.

Output (`bench_nodes`): the median measured step time of each, the ratio of their timed steps' total
wall seconds (node-blind over node-aware; the same ratio as the cost model predicts it), every step's
loss of both (equal to round-off: the update does not depend on the plan) and the plans' cross-node
ring traffic.  The first step of each engine is a warm-up and is not timed.  Wall seconds, not CPU
seconds: the emulated link is a wait.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hdp.packing.profiles import CPU_NODE_LINK_US

__all__ = ["NodesBenchSpec", "emulate_nodes", "bench_nodes", "nodes_batch_lengths", "run_nodes"]


@dataclass(frozen=True, kw_only=True)
class NodesBenchSpec:
    """What one run trains (picklable: it travels to the spawned ranks)."""

    ranks: int = 4
    """Local gloo ranks (the domain: TP = PP = 1)."""
    ranks_per_node: int = 2
    """Emulated ranks per node."""
    steps: int = 7
    """Steps per engine, the first untimed."""
    samples: int = 11
    """Samples per batch: about a quarter need two ranks, the rest one."""
    max_tokens_per_rank: int = 256
    """B."""
    hidden_size: int = 64
    num_layers: int = 2
    num_attention_heads: int = 2
    vocab_size: int = 256
    link_us: float = CPU_NODE_LINK_US
    """Microseconds a ring exchange between emulated nodes takes at least."""
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("ranks", "ranks_per_node", "steps", "samples", "max_tokens_per_rank"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"NodesBenchSpec.{name}={v!r}: pass an integer >= 1")
        if self.ranks % self.ranks_per_node or self.ranks == self.ranks_per_node:
            raise ValueError(f"NodesBenchSpec.ranks={self.ranks}, ranks_per_node={self.ranks_per_node}: the domain must "
                             "be two or more whole nodes")
        if self.steps < 2:
            raise ValueError(f"NodesBenchSpec.steps={self.steps}: pass >= 2 (the first step is a warm-up)")


class _Late:
    """A P2P work that completes no earlier than ``deadline`` (`time.perf_counter` seconds)."""

    def __init__(self, work: Any, deadline: float) -> None:
        self.work, self.deadline = work, deadline

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        out = self.work.wait(*args, **kwargs)
        left = self.deadline - time.perf_counter()
        if left > 0:
            time.sleep(left)
        return out


@contextlib.contextmanager
def emulate_nodes(ranks_per_node: int, link_s: float) -> Iterator[None]:
    """While active, every ring exchange (`hdp.cp.ring`) whose peer is on another emulated node -- global
    rank g on node ``g // ranks_per_node`` -- completes no earlier than ``link_s`` after it is posted."""
    import hdp.cp.ring as ring_mod

    real = ring_mod._exchange

    def exchange(send: torch.Tensor, recv: torch.Tensor, ring: Any, tag: int) -> list[Any]:
        t0 = time.perf_counter()
        works = real(send, recv, ring, tag)
        me = ring.ranks[ring.position] // ranks_per_node
        if ring.next_rank // ranks_per_node == me and ring.prev_rank // ranks_per_node == me:
            return works
        return [_Late(w, t0 + link_s) for w in works]

    ring_mod._exchange = exchange
    try:
        yield
    finally:
        ring_mod._exchange = real


def nodes_batch_lengths(spec: NodesBenchSpec, step: int) -> list[int]:
    """About a quarter of the samples between 1.5 B and 2 B tokens (two ranks at least: a CP2 group inside a
    node, or a wider one across both), the rest between B / 2 and B: batches on which the node-blind
    planner chooses CP3 and CP4 groups -- across the emulated nodes -- to level its rounds."""
    rng = np.random.default_rng(1000 * spec.seed + step)
    b = spec.max_tokens_per_rank
    n_long = max(1, round(spec.samples * 3 / 11))
    lengths = np.r_[rng.integers(int(1.5 * b), 2 * b - 8, n_long), rng.integers(b // 2, b, spec.samples - n_long)]
    return rng.permutation(lengths).tolist()


def _init_param(name: str, p: torch.Tensor) -> None:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    val = torch.randn(p.shape, generator=g, dtype=torch.float32)
    p.copy_(1.0 + 0.02 * val if p.dim() == 1 else 0.02 * val)


def _batch(spec: NodesBenchSpec, step: int) -> Any:
    from hdp.trainer.engine import Batch

    g = torch.Generator().manual_seed(1000 * spec.seed + step)
    return Batch(tokens=[torch.randint(0, spec.vocab_size, (n,), generator=g) for n in nodes_batch_lengths(spec, step)])


def _engine(spec: NodesBenchSpec, aware: bool) -> Any:
    """An engine whose planner knows the emulated nodes (the launcher's ``LOCAL_WORLD_SIZE``) or not."""
    from hdp.trainer.config import EngineConfig, PlanningConfig
    from hdp.trainer.engine import HdpEngine
    from hdp.trainer.model import ModelConfig, OptimConfig

    cfg = EngineConfig(
        model=ModelConfig(num_layers=spec.num_layers, hidden_size=spec.hidden_size,
                          num_attention_heads=spec.num_attention_heads, vocab_size=spec.vocab_size,
                          max_sequence_length=spec.ranks * spec.max_tokens_per_rank),
        optim=OptimConfig(lr=1e-3),
        planning=PlanningConfig(max_tokens_per_rank=spec.max_tokens_per_rank, auto_calibrate=False),
    )
    saved = os.environ.pop("LOCAL_WORLD_SIZE", None)
    if aware:
        os.environ["LOCAL_WORLD_SIZE"] = str(spec.ranks_per_node)
    try:
        return HdpEngine.build(cfg, dist.group.WORLD, init_fn=_init_param)
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
        if saved is not None:
            os.environ["LOCAL_WORLD_SIZE"] = saved


def _worker(rank: int, world: int, spec: NodesBenchSpec) -> dict[str, Any]:
    from hdp.packing import simulate
    from hdp.packing.topology import node_map
    from hdp.trainer.engine import nll_loss

    torch.set_num_threads(1)
    nodes = node_map(spec.ranks, spec.ranks_per_node)
    engines = {"node-aware": _engine(spec, True), "node-blind": _engine(spec, False)}
    assert engines["node-aware"].planner.config.node_of == nodes and engines["node-blind"].planner.config.node_of is None
    out: dict[str, Any] = {name: {"seconds": [], "loss": [], "cross_node_fraction": [], "predicted_s": []}
                           for name in engines}
    with emulate_nodes(spec.ranks_per_node, spec.link_us * 1e-6):
        for step in range(spec.steps):
            batch = _batch(spec, step)
            for name in (("node-aware", "node-blind") if step % 2 == 0 else ("node-blind", "node-aware")):
                engine = engines[name]
                plan = engine.planner.plan(batch.lengths)
                dist.barrier(group=dist.group.WORLD)
                t0 = time.perf_counter()
                m = engine.train_step(batch, nll_loss, plan=plan)
                seconds = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=dist.group.WORLD)
                on_nodes = simulate(plan.on_nodes(nodes), engine.planner.cost)
                rec = out[name]
                rec["seconds"].append(float(seconds))
                rec["loss"].append(float(m["loss"]))
                rec["cross_node_fraction"].append(on_nodes.cross_node_fraction)
                rec["predicted_s"].append(on_nodes.step_time_s)
    for engine in engines.values():
        engine.close()
    return out if rank == 0 else {}


def run_nodes(spec: NodesBenchSpec) -> dict[str, Any]:
    """Every step's figures of both engines (rank 0's; spawns ``spec.ranks`` gloo ranks)."""
    from hdp.trainer.launch import spawn

    return spawn(_worker, spec.ranks, spec, timeout=1800.0)[0]


def bench_nodes(spec: NodesBenchSpec | None = None) -> dict[str, Any]:
    """Run the comparison (module docstring) and summarise it."""
    spec = spec or NodesBenchSpec()
    out = run_nodes(spec)
    aware, blind = out["node-aware"], out["node-blind"]
    t_aware, t_blind = statistics.median(aware["seconds"][1:]), statistics.median(blind["seconds"][1:])
    total_aware, total_blind = sum(aware["seconds"][1:]), sum(blind["seconds"][1:])
    diff = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(aware["loss"], blind["loss"]))
    return {
        "nodes": {
            "spec": asdict(spec),
            "median_step_s": {"node-aware": t_aware, "node-blind": t_blind},
            "timed_s": {"node-aware": total_aware, "node-blind": total_blind},
            "blind_over_aware": total_blind / total_aware,
            "predicted_blind_over_aware": sum(blind["predicted_s"][1:]) / sum(aware["predicted_s"][1:]),
            "cross_node_fraction": {"node-aware": statistics.mean(aware["cross_node_fraction"]),
                                    "node-blind": statistics.mean(blind["cross_node_fraction"])},
            "losses": {"node-aware": aware["loss"], "node-blind": blind["loss"]},
            "max_loss_rel_diff": diff,
            "steps": out,
            "cost_model": "the engine's auto model on cpu-gloo (inter-node link: gloo + the emulated wait)",
        },
        "passed": total_aware < total_blind and diff <= 1e-5,
    }
