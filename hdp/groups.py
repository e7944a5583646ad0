"""Process groups of one domain: cached power-of-two blocks and point-to-point rings.

A domain of N ranks (docs/design.md, "Words") runs groups of two shapes:

* aligned power-of-two blocks ``[start, start + size)`` with ``size`` in 2, 4, ..., and
  ``start % size == 0`` — each gets a cached torch.distributed sub-group (built once, collectively,
  by :meth:`DomainGroups.build`); the whole domain is the domain group itself.  Collectives such as
  all-gather need these.
* any contiguous range of domain ranks — a :class:`RingSpec` whose point-to-point ops run over the
  domain group with global peer ranks, so no new communicator is ever created (CP3, CP5, ...).

Every collective or P2P op in hdp takes its group explicitly; nothing here is a module global.
"""

from __future__ import annotations

import datetime
import logging
import weakref
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

import torch.distributed as dist

__all__ = ["DomainGroups", "GroupLedger", "LayoutGroups", "RingSpec", "aligned_blocks", "copy_of_group"]

logger = logging.getLogger(__name__)


def _live_groups() -> set[dist.ProcessGroup]:
    """Every process group this process is a member of (torch's registry; the default group included)."""
    from torch.distributed import distributed_c10d

    return set(distributed_c10d._world.pg_map)


def _keys() -> dict[tuple[int, str], dist.ProcessGroup]:
    """The live groups by (id, name): a pair no later group repeats while the first is alive."""
    from torch.distributed import distributed_c10d

    names = distributed_c10d._world.pg_names
    return {(id(pg), str(names.get(pg))): pg for pg in distributed_c10d._world.pg_map}


class GroupLedger:
    """The process groups created while it is open, destroyed by :meth:`release`.

    An engine opens one before it creates any group (its own agreement group, Megatron's
    parallel-state groups, the CP blocks) and releases it when it closes, so that building and
    closing engines in one process leaves no group — nor the transport threads each group holds —
    behind.  Groups that existed before it opened (the default group, a caller's groups) are never
    touched.  :meth:`seal` ends the recording (at the end of a build): groups made later — another
    engine's — are not this ledger's.  Local: every member rank releases its own copy
    (gloo/NCCL/HCCL destroy locally).
    """

    def __init__(self) -> None:
        # the groups alive at opening, by (id, name): no reference, so a ledger opened later (another engine's)
        # never keeps this engine's groups alive (on gloo a group closes its connections with its last reference)
        self._before = set(_keys())
        self._sealed: set[dist.ProcessGroup] | None = None
        self._released = False

    def created(self) -> set[dist.ProcessGroup]:
        """The groups this ledger holds and still alive: created since it opened (until :meth:`seal`)."""
        if self._released:
            return set()
        if self._sealed is not None:
            return self._sealed & _live_groups()
        return {pg for key, pg in _keys().items() if key not in self._before}

    def seal(self, exclude: set[dist.ProcessGroup] | frozenset = frozenset()) -> None:
        """Stop recording: from now on the ledger holds the groups created so far, less ``exclude``
        (groups another owner releases)."""
        self._sealed = self.created() - set(exclude)

    def release(self) -> int:
        """Destroy every group the ledger holds (idempotent); returns how many."""
        if self._released:
            return 0
        groups = self.created()
        self._released = True
        self._sealed = None  # no reference to a freed group outlives it here (gloo closes connections on the last)
        for pg in groups:
            dist.destroy_process_group(pg)
        n = len(groups)
        del groups
        logger.debug("released %d process groups", n)
        return n


def copy_of_group(group: dist.ProcessGroup, job: dist.ProcessGroup, timeout_s: float) -> dist.ProcessGroup:
    """A new group with the ranks of ``group`` and ``timeout_s``, owned by the caller (collective over
    ``job``, which must span the whole world — ``dist.new_group`` is: every rank calls it once, with its
    own ``group``; the rank lists of all such groups are gathered over ``job`` and each is made in the
    same order on every rank).

    For groups another library holds (verl's model keeps Megatron's data-parallel group alive): on
    gloo only a group whose last reference is dropped closes its connections, which is what releases
    a peer blocked in a collective on it, so hdp runs its own traffic on a copy it can free."""
    if dist.get_world_size(job) != dist.get_world_size():
        raise ValueError(f"copy_of_group: job has {dist.get_world_size(job)} ranks, the world "
                         f"{dist.get_world_size()}; pass a group of the whole world (every rank makes every copy)")
    mine = tuple(int(r) for r in dist.get_process_group_ranks(group))
    every: list[tuple[int, ...] | None] = [None] * dist.get_world_size(job)
    dist.all_gather_object(every, mine, group=job)
    out = None
    for ranks in sorted(set(every)):  # type: ignore[type-var]
        pg = dist.new_group(list(ranks), timeout=datetime.timedelta(seconds=float(timeout_s)))
        if ranks == mine:
            out = pg
    assert out is not None
    return out


def aligned_blocks(n: int) -> list[tuple[int, int]]:
    """All ``(start, size)`` aligned power-of-two blocks of size >= 2 inside a domain of ``n`` ranks."""
    out: list[tuple[int, int]] = []
    size = 2
    while size <= n:
        out.extend((start, size) for start in range(0, n - size + 1, size))
        size *= 2
    return out


@dataclass(frozen=True)
class RingSpec:
    """A contiguous range of domain ranks used as a point-to-point ring over the domain group."""

    group: dist.ProcessGroup
    """The domain process group every P2P op of the ring runs on."""
    start: int
    """Domain rank of the first ring member."""
    ranks: tuple[int, ...]
    """Global ranks of the ring members, in ring order."""
    position: int
    """This rank's index in ``ranks`` (its position j inside the CP group)."""

    @property
    def size(self) -> int:
        """Number of ranks in the ring (the CP group size k)."""
        return len(self.ranks)

    @property
    def prev_rank(self) -> int:
        """Global rank this rank receives from."""
        return self.ranks[(self.position - 1) % self.size]

    @property
    def next_rank(self) -> int:
        """Global rank this rank sends to."""
        return self.ranks[(self.position + 1) % self.size]


@dataclass(frozen=True)
class DomainGroups:
    """The domain group, its global ranks, and the cached aligned power-of-two sub-groups."""

    domain: dist.ProcessGroup
    """The domain process group."""
    global_ranks: tuple[int, ...]
    """Global rank of every domain rank, indexed by domain rank."""
    domain_rank: int
    """This process's rank inside the domain."""
    blocks: Mapping[tuple[int, int], dist.ProcessGroup]
    """(start, size) -> process group, for the blocks this rank belongs to (read-only)."""
    _rings: "weakref.WeakSet[RingSpec]" = field(default_factory=weakref.WeakSet, compare=False, repr=False)

    @property
    def size(self) -> int:
        """Number of ranks in the domain (N)."""
        return len(self.global_ranks)

    def detach(self) -> None:
        """Drop every reference this object and the rings it made hold to the process groups (before the
        groups are destroyed).  A failed step can leave its autograd graph alive for a while (a CP attention
        node keeps its ring); on gloo a group closes its connections — which is what releases a peer blocked
        on it — only with its last reference, so the rings must not keep it.  The object is unusable after."""
        for ring in list(self._rings):
            object.__setattr__(ring, "group", None)
        object.__setattr__(self, "domain", None)
        object.__setattr__(self, "blocks", MappingProxyType({}))

    @classmethod
    def build(cls, domain_group: dist.ProcessGroup, *, timeout_s: float | None = None) -> "DomainGroups":
        """Build the block sub-groups of ``domain_group``; every domain rank must call this once.

        Sub-groups are created with ``use_local_synchronization=True`` so only the members of a
        block take part in its creation (other domains of the job need not call in step).
        Building twice for the same domain is an error of torch.distributed (same group name).
        ``timeout_s`` bounds every op on the block groups (default: torch's).
        """
        if domain_group is None:
            raise ValueError("domain_group=None: pass the domain's process group explicitly")
        global_ranks = tuple(int(r) for r in dist.get_process_group_ranks(domain_group))
        n = len(global_ranks)
        me = dist.get_rank(domain_group)
        blocks: dict[tuple[int, int], dist.ProcessGroup] = {(0, n): domain_group}
        for start, size in aligned_blocks(n):
            if (start, size) == (0, n) or not start <= me < start + size:
                continue
            members = list(global_ranks[start : start + size])
            extra = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
            pg = dist.new_group(ranks=members, use_local_synchronization=True, **extra)
            blocks[(start, size)] = pg
        # one collective on the domain group, so its communicator exists before any rank starts a
        # P2P ring on a subset of it (NCCL requires the first op on a group to involve all ranks)
        dist.barrier(group=domain_group)
        logger.debug("domain rank %d: built %d block groups", me, len(blocks))
        return cls(
            domain=domain_group,
            global_ranks=global_ranks,
            domain_rank=me,
            blocks=MappingProxyType(blocks),
        )

    def _check_range(self, start: int, size: int) -> None:
        if size < 1 or start < 0 or start + size > self.size:
            raise ValueError(
                f"rank range (start={start}, size={size}) is outside the domain of {self.size} ranks; "
                f"ask for 0 <= start and start + size <= {self.size}"
            )

    def block_group(self, start: int, size: int) -> dist.ProcessGroup:
        """The cached group of the aligned power-of-two block ``(start, size)`` this rank belongs to."""
        self._check_range(start, size)
        if size == 1:
            raise ValueError(f"block (start={start}, size=1): a single rank needs no process group")
        pg = self.blocks.get((start, size))
        if pg is None:
            if size & (size - 1) or start % size:
                why = "it is not an aligned power-of-two block (size 2^i, start % size == 0)"
            else:
                why = f"domain rank {self.domain_rank} is not a member of it"
            raise ValueError(f"block (start={start}, size={size}) was not built: {why}; use ring() instead")
        return pg

    def ring(self, start: int, size: int) -> RingSpec:
        """P2P ring over domain ranks ``[start, start + size)``; this rank must be one of them."""
        self._check_range(start, size)
        if not start <= self.domain_rank < start + size:
            raise ValueError(
                f"ring (start={start}, size={size}) does not contain domain rank {self.domain_rank}; "
                "only members build their ring"
            )
        ring = RingSpec(
            group=self.domain,
            start=start,
            ranks=self.global_ranks[start : start + size],
            position=self.domain_rank - start,
        )
        self._rings.add(ring)
        return ring


@dataclass(frozen=True)
class LayoutGroups:
    """Every process group one rank of a TP × PP × domain job uses, each named explicitly.

    World = TP × PP × N: the domain (N ranks) holds the DP × CP ranks of one (TP rank, PP stage)
    position and runs hdp's plans; ``tp`` connects the ranks of one TP group (same domain rank and
    stage), ``pp`` the stages of one pipeline (same domain rank and TP rank), ``ep`` the ranks
    that exchange tokens in MoE layers (a subset of one stage).  No field is ever ``None``: a size-1
    dimension has a size-1 group.
    """

    world: dist.ProcessGroup
    """The whole job (all TP × PP × N ranks)."""
    domain: DomainGroups
    """This rank's domain and its cached CP blocks."""
    tp: dist.ProcessGroup
    """Tensor-parallel group."""
    pp: dist.ProcessGroup
    """Pipeline-parallel group (stages in order)."""
    ep: dist.ProcessGroup
    """Expert-parallel group."""

    def __post_init__(self) -> None:
        for name in ("world", "tp", "pp", "ep"):
            if getattr(self, name) is None:
                raise ValueError(f"LayoutGroups.{name}=None: pass the process group explicitly (None means the world)")
        world = dist.get_world_size(self.world)
        tp, pp, n = dist.get_world_size(self.tp), dist.get_world_size(self.pp), self.domain.size
        if tp * pp * n != world:
            raise ValueError(
                f"LayoutGroups: TP {tp} x PP {pp} x domain {n} = {tp * pp * n} ranks but the world has {world}"
            )

    @property
    def tp_rank(self) -> int:
        """This rank's position in its TP group."""
        return dist.get_rank(self.tp)

    @property
    def tp_size(self) -> int:
        """TP."""
        return dist.get_world_size(self.tp)

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage."""
        return dist.get_rank(self.pp)

    @property
    def pp_size(self) -> int:
        """PP."""
        return dist.get_world_size(self.pp)

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank holds the last pipeline stage (the loss)."""
        return self.pp_rank == self.pp_size - 1

    @property
    def last_stage_global_rank(self) -> int:
        """Global rank of this pipeline's last stage."""
        return int(dist.get_process_group_ranks(self.pp)[-1])

    @property
    def world_rank(self) -> int:
        """This rank in the world group."""
        return dist.get_rank(self.world)

    @property
    def world_size(self) -> int:
        """TP × PP × N."""
        return dist.get_world_size(self.world)
