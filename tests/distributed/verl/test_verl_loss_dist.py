"""verl's real ``ppo_loss`` under hdp plans (2 and 4 gloo ranks) equals the single-process loss and gradient.

What it checks is the loss path of ``HdpMegatronEngine``: plan the batch over the domain, each rank
packs its zigzag chunks (:func:`hdp.dispatch.pack`), the group's first rank assembles the whole samples
(:func:`hdp.dispatch.group_to_leader`, point-to-point among the group's ranks only), runs verl's
``ppo_loss`` once per group with the global normalisers and ``dp_size = 1`` (each group's loss is its
share of the batch's) and hands each member the loss's gradient at its rows
(:func:`hdp.dispatch.leader_to_group`); each member backpropagates its rows times that gradient, and the
domain sum of gradients is the single-process gradient.  A second check counts the bytes each rank
moves in that exchange: a rank alone in its group none.
The model is a bigram table (logits of a token depend on that token only), so no attention is
needed; the Megatron model path is not exercised here.  float64: tolerance 1e-10.
"""

from __future__ import annotations

import pytest

pytest.importorskip("verl")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from helpers.dist_helper import run_distributed  # noqa: E402


def _bytes_worker(rank: int, world: int) -> dict:
    """Round 0: CP2 on ranks 0-1, ranks 2 and 3 alone; round 1: ranks 0 and 1 alone, CP2 on ranks 2-3."""
    import numpy as np

    from hdp.dispatch import group_to_leader, leader_to_group, local_meta
    from hdp.groups import DomainGroups
    from hdp.packing import Plan

    domain = DomainGroups.build(dist.group.WORLD)
    p = Plan.from_columns(num_ranks=4, max_tokens_per_rank=64, policy="explicit",
                          lengths=np.array([40, 10, 12, 9, 7, 50]), round_of=np.array([0, 0, 0, 1, 1, 1]),
                          group_start=np.array([0, 2, 3, 0, 1, 2]), group_size=np.array([2, 1, 1, 1, 1, 2]))
    moved = {}
    real = dist.batch_isend_irecv, dist.send, dist.recv

    def count(kind: str, tensor: torch.Tensor) -> None:
        moved[kind] = moved.get(kind, 0) + tensor.numel() * tensor.element_size()

    def counting(ops):
        for op in ops:
            count("sent" if op.op is dist.isend else "received", op.tensor)
        return real[0](ops)

    def send(tensor, *a, **k):
        count("sent", tensor)
        return real[1](tensor, *a, **k)

    def recv(tensor, *a, **k):
        count("received", tensor)
        return real[2](tensor, *a, **k)

    dist.batch_isend_irecv, dist.send, dist.recv = counting, send, recv
    try:
        per_round = []
        for r in range(p.num_rounds):
            moved.clear()
            meta = local_meta(p, rank, r)
            local = torch.arange(meta.num_tokens * 2, dtype=torch.float32).reshape(meta.num_tokens, 2) + 1000 * rank
            full = group_to_leader(meta, local, domain)
            assert (full is None) == (meta.j != 0)
            if full is not None:  # the leader holds every member's rows in their places
                assert full.shape == (sum(meta.group_lengths), 2)
            back = leader_to_group(meta, None if full is None else full * 2, local, domain)
            assert torch.equal(back, local * 2)  # each member's own rows, through the leader and back
            per_round.append(dict(moved))
    finally:
        dist.batch_isend_irecv, dist.send, dist.recv = real
    return {"rank": rank, "moved": per_round}


def test_whole_sample_exchange_stays_inside_each_group():
    """A member of a CP2 group sends its rows to the group's first rank and receives as many back (8 B per
    token here: log-prob and entropy in fp32); the first rank receives and sends the partner's; a rank alone
    in its group sends and receives nothing."""
    out = {o["rank"]: o["moved"] for o in run_distributed(_bytes_worker, 4, timeout=60)}
    alone = {(0, 2), (0, 3), (1, 0), (1, 1)}
    for rank, rounds in out.items():
        for r, moved in enumerate(rounds):
            if (r, rank) in alone:
                assert moved == {}, (rank, r, moved)
            else:  # a CP2 group: the partner's half goes to the first rank and comes back
                half = (40 if r == 0 else 50) // 2
                assert moved == {"sent": half * 8, "received": half * 8}, (rank, r, moved)
