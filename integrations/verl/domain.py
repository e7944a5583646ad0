"""The verl door's groups: hdp's domain under verl's data-parallel view.

verl's Megatron engine initialises Megatron with TP x PP x DP and CP = 1; hdp's domain is Megatron's DP
group (the N ranks of one TP rank and PP stage).  Like verl's dynamic-CP mode, every domain rank receives
the whole mini-batch: verl sees a data-parallel group of one rank (`VerlDomain.verl_dp_group`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from hdp.checksum import collective_device
from hdp.device import abort_ends_collectives
from hdp.groups import DomainGroups, LayoutGroups, copy_of_group
from hdp.core.agreement import agree_fields
from hdp.core.planning import RANKS_PER_NODE_KEYS, TOPOLOGY_FIX, launcher_ranks_per_node, launcher_topology
from hdp.core.rounds import RoundCore

__all__ = ["VerlDomain"]


@dataclass(frozen=True, eq=False)
class VerlDomain:
    """The job's groups (world = TP x PP x domain; the domain is Megatron's DP group with CP = 1),
    Megatron's ``ProcessGroupCollection``, and the one-rank group verl sees as "DP"."""

    layout: LayoutGroups
    megatron: Any
    verl_dp_group: dist.ProcessGroup

    @property
    def rank(self) -> int:
        return self.layout.domain.domain_rank

    @property
    def size(self) -> int:
        return self.layout.domain.size

    @classmethod
    def build(cls, dp_group: dist.ProcessGroup, megatron_groups: Any, timeout_s: float) -> "VerlDomain":
        """Collective over the world: hdp's agreement group with its timeout, the launcher's topology variables
        agreed on it (`hdp.core.agreement.agree_fields`: one that differs between ranks is named with each
        rank's value on every rank, one bad on every rank is refused alike), a copy of the domain
        (Megatron's data-parallel group, which verl's model holds; not where an abort suffices) with the CP
        blocks, and this rank's one-rank group (local synchronisation: no O(world) groups).  hdp's rings, CP
        collectives and output exchange run on the copy, so a rank that fails can free it and release the
        peers blocked there (the engine's ``_release``; on gloo an abort does not);
        Megatron's groups carry only the model's own collectives."""
        me = dist.get_rank()
        job = RoundCore.job_group(dist.get_world_size(), timeout_s)
        try:  # the launcher's ranks per node, alike on every rank, before anything reads it (the planner)
            agree_fields(launcher_topology(), job, collective_device(job), where="hdp engine (verl door)",
                         topics={key: ("the launcher's topology", TOPOLOGY_FIX) for key in RANKS_PER_NODE_KEYS})
            launcher_ranks_per_node()  # agreed: a bad value raises on every rank alike
        except BaseException:
            dist.destroy_process_group(job)
            raise
        # where the alarm's abort ends a blocked collective on Megatron's group itself, a copy would hold a
        # second communicator's buffers for nothing
        own = dp_group if abort_ends_collectives(dp_group) else copy_of_group(dp_group, job, timeout_s)
        layout = LayoutGroups(
            world=job,
            domain=DomainGroups.build(own, timeout_s=timeout_s),
            tp=megatron_groups.tp, pp=megatron_groups.pp, ep=megatron_groups.ep,
        )
        mine = dist.new_group([me], use_local_synchronization=True)
        return cls(layout=layout, megatron=megatron_groups, verl_dp_group=mine)

    def groups_to_abort(self) -> list[dist.ProcessGroup]:
        """Every group a step communicates on: hdp's, and Megatron's (not verl's WORLD)."""
        groups = [self.layout.world, self.verl_dp_group, *self.layout.domain.blocks.values()]
        groups += [g for g in vars(self.megatron).values() if isinstance(g, dist.ProcessGroup)]
        return list({id(g): g for g in groups if g is not dist.group.WORLD}.values())

    def groups_to_free(self) -> list[dist.ProcessGroup]:
        """The groups hdp made for the engine (its agreement group, its copy of the domain, the CP blocks),
        which a failed phase frees; Megatron's stay (verl's worker holds the model that uses them)."""
        megatron = {id(g) for g in vars(self.megatron).values() if isinstance(g, dist.ProcessGroup)}
        return [g for g in self.groups_to_abort() if id(g) not in megatron and g is not self.verl_dp_group]
