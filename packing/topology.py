"""Which ranks of the domain share a node: the topology the planner prices CP rings with.

A domain's ranks sit on nodes; inside a node a ring step runs over the intra-node link (NVLink,
HCCS), between nodes over the inter-node one (InfiniBand, RoCE), at a fraction of its bandwidth.
The planner takes the topology as the *node of every domain rank* (`PlannerConfig.node_of`), derived
from the job's layout, never guessed:

* a launcher puts consecutive global ranks on one node (torchrun: ``LOCAL_WORLD_SIZE`` ranks per
  node; verl's Ray workers: ``RAY_LOCAL_WORLD_SIZE``, its ``trainer.n_gpus_per_node``), so global
  rank g is on node ``g // local_world_size``;
* the engine's rank order (Megatron's ``tp-cp-ep-dp-pp``) gives the global ranks of every domain
  -- one per (TP rank, PP stage) position -- in domain order (`domain_node_map` takes them).

Two domain ranks share a node for the planner only when they share one in *every* position (so
every rank of the job plans with the same map, and a ring the planner calls node-local is
node-local for every TP rank and stage).  Nodes are contiguous runs of domain ranks: in any rank
order the global rank grows with the domain rank, so the node does too.  A contiguous group of
ranks spanning m >= 2 nodes then crosses each boundary once on its way and once back on the ring's
closing edge -- m crossing edges, the fewest any ring visiting m nodes has (it must enter and leave
every node).  One node is ``None``: the planner plans exactly as it does without a topology.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Nodes", "node_map", "domain_node_map", "check_node_of", "node_of_text"]


def node_map(num_ranks: int, ranks_per_node: int) -> tuple[int, ...] | None:
    """The node of every rank of a domain of ``num_ranks`` whose consecutive ranks fill nodes of
    ``ranks_per_node`` (the last one may hold fewer); None when they all fit on one."""
    for name, v in (("num_ranks", num_ranks), ("ranks_per_node", ranks_per_node)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name}={v!r}: pass an integer >= 1")
    if ranks_per_node >= num_ranks:
        return None
    return tuple(int(d // ranks_per_node) for d in range(int(num_ranks)))


def domain_node_map(domains: Sequence[Sequence[int]], local_world_size: int) -> tuple[int, ...] | None:
    """The node of every domain rank from the global ranks of every domain (one per TP rank and PP
    stage, each in domain order) and the launcher's ranks per node (global rank g on node
    ``g // local_world_size``): two domain ranks share a node only when they do in every domain
    (module docstring); None when every domain lies on one node."""
    lws = local_world_size
    if isinstance(lws, bool) or not isinstance(lws, (int, np.integer)) or lws < 1:
        raise ValueError(f"local_world_size={lws!r}: pass the launcher's ranks per node, an integer >= 1 "
                         "(LOCAL_WORLD_SIZE, verl's trainer.n_gpus_per_node)")
    rows = np.asarray([list(d) for d in domains], dtype=np.int64)
    if rows.ndim != 2 or rows.shape[1] == 0:
        raise ValueError(f"domains: pass the global ranks of every domain, all of one size (got shape {rows.shape})")
    nodes = rows // int(lws)  # [D, N]
    # a new node starts where any domain's rank moves to another node
    change = np.r_[False, np.any(nodes[:, 1:] != nodes[:, :-1], axis=0)]
    if not np.all(np.diff(nodes, axis=1) >= 0):
        raise ValueError("domains: a domain's global ranks must grow with the domain rank (the engine's rank order)")
    out = tuple(int(x) for x in np.cumsum(change))
    return None if out[-1] == 0 else out


def check_node_of(value: object, num_ranks: int, field: str) -> tuple[int, ...] | None:
    """``value`` as the canonical node map of a domain of ``num_ranks`` (labels 0, 1, ... in rank
    order), None for one node; ValueError naming ``field``, the value and the fix."""
    if value is None:
        return None
    fix = ("pass the node of every domain rank, non-decreasing (hdp.packing.topology.node_map(N, ranks_per_node), "
           "or domain_node_map from the job's layout), or None for one node")
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
        raise ValueError(f"{field}={value!r}: {fix}")
    items = list(value)
    if len(items) != num_ranks:
        raise ValueError(f"{field} has {len(items)} entries but the domain has num_ranks={num_ranks}: {fix}")
    for x in items:
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 0:
            raise ValueError(f"{field}: node {x!r} is not an integer >= 0; {fix}")
    arr = np.asarray(items, dtype=np.int64)
    if np.any(np.diff(arr) < 0):
        i = int(np.flatnonzero(np.diff(arr) < 0)[0])
        raise ValueError(f"{field}: rank {i + 1} is on node {int(arr[i + 1])} after rank {i} on node {int(arr[i])}; "
                         f"a node's ranks are a contiguous run of the domain (every engine rank order gives that): {fix}")
    labels = np.r_[0, np.cumsum(np.diff(arr) != 0)]
    return None if labels[-1] == 0 else tuple(int(x) for x in labels)


def node_of_text(node_of: tuple[int, ...] | None) -> str:
    """A short description: ``one node``, ``8 nodes of 8 ranks`` or the node sizes."""
    if node_of is None:
        return "one node"
    sizes = np.bincount(np.asarray(node_of))
    if np.all(sizes == sizes[0]):
        return f"{sizes.size} nodes of {int(sizes[0])} ranks"
    return f"{sizes.size} nodes of {'/'.join(str(int(s)) for s in sizes)} ranks"


@dataclass(frozen=True, eq=False)
class Nodes:
    """A canonical node map as arrays: every rank's node, every node's first rank, the largest node."""

    node_of: np.ndarray
    """[N] node of every domain rank (0, 1, ... in rank order)."""
    first: np.ndarray
    """[M + 1] first rank of every node, then N."""
    largest: int
    """Ranks of the largest node: a group wider than this spans two nodes wherever it sits."""

    @classmethod
    def of(cls, node_of: tuple[int, ...] | None, num_ranks: int) -> Nodes | None:
        """The arrays of a canonical map (`check_node_of`); None for one node."""
        if node_of is None:
            return None
        arr = np.asarray(node_of, dtype=np.int64)
        assert arr.size == num_ranks
        first = np.r_[0, np.flatnonzero(np.diff(arr)) + 1, num_ranks].astype(np.int64)
        return cls(node_of=arr, first=first, largest=int(np.diff(first).max()))

    @property
    def count(self) -> int:
        """Nodes M."""
        return int(self.first.size - 1)

    def spans(self, start: np.ndarray, size: np.ndarray) -> np.ndarray:
        """[G] nodes each group of ``size`` ranks from ``start`` spans (1: inside one node)."""
        start, size = np.asarray(start, dtype=np.int64), np.asarray(size, dtype=np.int64)
        return self.node_of[start + size - 1] - self.node_of[start] + 1

    def crosses(self, start: np.ndarray, size: np.ndarray) -> np.ndarray:
        """[G] whether each group's ring crosses a node boundary (its slowest link is the inter-node one)."""
        return self.spans(start, size) > 1
