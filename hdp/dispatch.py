"""Moving samples to the ranks a plan assigns them to, and outputs back to the caller's order.

Dimension legend:
    S    samples of the step, in the caller's order (plan columns are indexed by them)
    Sg   samples of one group, in group order
    L_i  length of sample i
    T    tokens this rank holds in one round (its local zigzag chunks, packed)
    Tr   tokens this rank holds over all rounds (sum of T)
    F    trailing feature elements of a per-token tensor, flattened (prod of shape[1:])
    N    ranks in the domain; R rounds

Local token order (the same as :mod:`hdp.cp.metadata`, whose ``rank_layout`` computes it): for
each sample of the rank's group in group order, its front chunk then its back chunk (zigzag
chunks j and 2k-1-j with boundaries ``floor(c * L / 2k)``, :mod:`hdp.packing.chunks`).  The
position id of a local token is its offset inside its own sample, so RoPE sees the positions of
the unsplit sample.

What the engines use (every rank holds the whole batch: the library door's callers and verl, which
hands each rank the mini-batch):

* :func:`local_meta` / :func:`pack` — this rank's chunks of a round, no communication;
* :func:`gather_outputs` — per-token outputs of the local chunks (log-probs, entropies) go back as
  full per-sample tensors in the caller's order, with one padded ``all_gather`` (or ``gather``),
  after a fixed-size header (dtype and feature shape, plus an error flag so a bad input raises on
  every rank instead of hanging);
* :func:`group_to_leader` — inside one round, the group's first rank (its leader) assembles the
  group's samples whole from its members' rows (for a loss that needs whole samples, such as
  verl's), point-to-point among the group's k ranks only; :func:`leader_to_group` hands each member
  its rows of what the leader computed from them (the loss's gradient): 2(k-1) messages per group.
  :func:`gather_whole_samples` then collects those whole samples from the groups' leaders with one
  ``gather``.  :func:`group_samples_flat` gives every member the whole samples instead, its own rows
  differentiable (k(k-1) messages; verl's stock CP engine all-gathers so and runs its loss on every rank).

Every collective names its process group; none runs on ``group=None``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist

from hdp.checksum import check_cu_seqlens, check_plan_domain, collective_device
from hdp.cp.metadata import positions, rank_chunks, rank_layout
from hdp.groups import DomainGroups
from hdp.packing.plan import Plan

__all__ = [
    "LocalMeta",
    "local_meta",
    "local_metas",
    "pack",
    "group_to_leader",
    "leader_to_group",
    "group_samples_flat",
    "gather_outputs",
    "gather_whole_samples",
]

@dataclass(frozen=True, eq=False)
class LocalMeta:
    """Where this rank's local tokens of one round come from (CPU tensors; move them with ``.to``)."""

    round_index: int
    """Round of the plan."""
    rank: int
    """Domain rank."""
    idle: bool
    """True when no group of the round covers this rank: it runs an empty micro-batch (k = 1, no samples)."""
    group_start: int
    """First domain rank of the group (this rank itself when idle)."""
    k: int
    """Group size (1 = plain data parallel, or idle)."""
    j: int
    """This rank's position in the group (0-based ring position)."""
    samples: tuple[int, ...]
    """Caller indices of the group's samples, in group order."""
    group_lengths: tuple[int, ...]
    """Full lengths of those samples (what ``hdp.cp.cp_attention`` takes as ``group_lengths``)."""
    front: tuple[tuple[int, int], ...]
    """Per sample, the (start, end) of the front chunk in sample coordinates."""
    back: tuple[tuple[int, int], ...]
    """Per sample, the (start, end) of the back chunk in sample coordinates."""
    cu_seqlens: torch.Tensor
    """[Sg+1] int32: local token boundaries of each sample (front and back chunk together)."""
    position_ids: torch.Tensor
    """[T] int64: offset of each local token inside its own sample (RoPE positions)."""
    sample_index: torch.Tensor
    """[T] int64: caller index of the sample each local token belongs to."""

    @property
    def num_tokens(self) -> int:
        """T: tokens held locally in this round."""
        return int(self.position_ids.numel())

    @property
    def token_offset(self) -> torch.Tensor:
        """[T] int64: offset of each local token inside its sample (same as ``position_ids``)."""
        return self.position_ids


def local_meta(plan: Plan, rank: int, round_index: int) -> LocalMeta:
    """Metadata of domain ``rank``'s local tokens in round ``round_index`` (pure; no communication)."""
    if not 0 <= round_index < plan.num_rounds:
        raise ValueError(f"round_index={round_index}: the plan has rounds 0..{plan.num_rounds - 1}")
    if not 0 <= rank < plan.num_ranks:
        raise ValueError(f"rank={rank}: outside the domain [0, {plan.num_ranks}) of the plan")
    group = plan.rounds[round_index].group_of(rank)
    if group is None:
        start, k, samples, lengths = rank, 1, (), ()
    else:
        start, k, samples, lengths = group.start, group.size, group.samples, group.lengths
    j = rank - start
    lay = rank_layout(lengths, k, j)
    counts = torch.diff(lay.cu_seqlens.to(torch.int64))  # [Sg] local tokens per sample
    sample_index = torch.repeat_interleave(torch.tensor(samples, dtype=torch.int64), counts)  # [T]
    return LocalMeta(
        round_index=round_index,
        rank=rank,
        idle=group is None,
        group_start=start,
        k=k,
        j=j,
        samples=tuple(samples),
        group_lengths=tuple(lengths),
        front=lay.front,
        back=lay.back,
        cu_seqlens=lay.cu_seqlens,
        position_ids=positions(lengths, k, j),
        sample_index=sample_index,
    )


def local_metas(plan: Plan, rank: int) -> tuple[LocalMeta, ...]:
    """:func:`local_meta` of ``rank`` for every round of the plan, in round order."""
    return tuple(local_meta(plan, rank, r) for r in range(plan.num_rounds))


def _check_sample_tensor(name: str, index: int, tensor: object, length: int) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}[{index}] is {type(tensor).__name__}; pass a torch.Tensor [L_i, ...] per sample")
    if tensor.dim() < 1 or tensor.shape[0] != length:
        raise ValueError(
            f"{name}[{index}].shape={tuple(tensor.shape)}: the plan gives sample {index} length {length}; "
            "pass one tensor per sample with the sample's tokens on dim 0"
        )
    return tensor


def pack(meta: LocalMeta, tensors: Sequence[torch.Tensor] | Mapping[int, torch.Tensor]) -> torch.Tensor:
    """[T, ...]: the local chunks of ``tensors[i]`` ([L_i, ...] per caller sample i) in canonical order.

    Differentiable (slices and one ``cat``).  Only the group's samples are read; an idle or empty
    round needs at least one tensor to take trailing shape, dtype and device from.
    """
    parts: list[torch.Tensor] = []
    for s, length, (fs, fe), (bs, be) in zip(meta.samples, meta.group_lengths, meta.front, meta.back):
        t = _check_sample_tensor("tensors", s, tensors[s], length)
        parts += [t[fs:fe], t[bs:be]]
    if parts:
        return torch.cat(parts)  # [T, ...]
    like = next(iter(tensors.values() if isinstance(tensors, Mapping) else tensors), None)
    if like is None:
        raise ValueError("tensors is empty: pass the per-sample tensors (needed for dtype and trailing shape)")
    return like.new_empty((0, *like.shape[1:]))  # [0, ...]


# ---------------------------------------------------------------- header agreement (fixed size)

_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool,
)
_MAX_FEATURE_DIMS = 8
# [error flag, key (must agree), dtype code (-1 unknown), ndim (-1 unknown), dims...]
_HEADER = 4 + _MAX_FEATURE_DIMS


def _header(error: str | None, like: torch.Tensor | None, key: int) -> list[int]:
    head = [1 if error else 0, key, -1, -1] + [0] * _MAX_FEATURE_DIMS
    if like is not None and not error:
        head[2] = _DTYPES.index(like.dtype)
        head[3] = like.dim() - 1
        head[4 : 4 + like.dim() - 1] = list(like.shape[1:])
    return head


def _agree(
    what: str,
    error: str | None,
    like: torch.Tensor | None,
    group: dist.ProcessGroup,
    dev: torch.device,
    key: int = 0,
) -> tuple[torch.dtype, tuple[int, ...]]:
    """All-gather a fixed-size header; raise the same ValueError on every rank if any rank is bad.

    ``key`` (e.g. a digest of the owner list) must be equal on every rank.
    """
    if like is not None and not error:
        if like.dtype not in _DTYPES:
            error = f"dtype {like.dtype} is not supported; use one of {list(_DTYPES)}"
        elif like.dim() - 1 > _MAX_FEATURE_DIMS:
            error = f"{like.dim() - 1} trailing dims; at most {_MAX_FEATURE_DIMS} are supported (flatten them)"
    mine = torch.tensor(_header(error, like, key), dtype=torch.int64, device=dev)  # [_HEADER]
    n = dist.get_world_size(group)
    heads = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(heads, mine, group=group)
    table = [h.cpu().tolist() for h in heads]  # N x [_HEADER]
    if error:
        raise ValueError(f"{what} on domain rank {dist.get_rank(group)}: {error}")
    failed = [r for r, h in enumerate(table) if h[0]]
    if failed:
        raise ValueError(f"{what}: invalid input on domain ranks {failed} (see their errors); no data was sent")
    keys = [h[1] for h in table]
    if len(set(keys)) > 1:
        odd = [r for r, k in enumerate(keys) if k != keys[0]]
        raise ValueError(f"{what}: domain ranks {odd} passed different arguments (e.g. owners) than rank 0; "
                         "pass the same on every rank")
    known = {(h[2], h[3], tuple(h[4 : 4 + h[3]])) for h in table if h[2] >= 0}
    if len(known) > 1:
        described = sorted((_DTYPES[c], shape) for c, _, shape in known)
        raise ValueError(f"{what}: ranks disagree on (dtype, trailing shape): {described}; pass the same on every rank")
    if not known:
        raise ValueError(f"{what}: no rank has a tensor to take dtype and trailing shape from; pass like=")
    code, _, shape = known.pop()
    return _DTYPES[code], shape


def _check_domain(plan: Plan, group: dist.ProcessGroup) -> int:
    if group is None:
        raise ValueError("domain_group=None: pass the domain's process group explicitly (None means the whole world)")
    check_plan_domain(plan, dist.get_world_size(group))
    return dist.get_rank(group)


# ---------------------------------------------------------------- gather outputs


def gather_outputs(
    plan: Plan,
    rank: int,
    local_outputs_per_round: Sequence[torch.Tensor],
    domain_group: dist.ProcessGroup,
    dst: int | Literal["all"] | None = "all",
) -> list[torch.Tensor] | None:
    """Full per-sample outputs ``[L_i, ...]`` in the caller's order from every rank's local chunks.

    ``local_outputs_per_round[r]`` is this rank's ``[T_r, ...]`` output of round r in the local
    order of :func:`local_meta` (empty ``[0, ...]`` for idle rounds, still with the trailing
    shape).  Tensors are padded to the largest per-rank token count (known from the plan on every
    rank) and gathered over the explicit ``domain_group``: ``dst="all"`` or ``None`` returns the
    result on every rank (``all_gather``); ``dst=r`` only on domain rank r (``gather``), ``None``
    elsewhere.  Detached: outputs for the caller, not for backward.
    """
    me = _check_domain(plan, domain_group)
    if rank != me:
        raise ValueError(f"rank={rank} but this process is domain rank {me} of domain_group; pass its own rank")
    target = "all" if dst is None else dst
    bad_dst = isinstance(target, bool) or not isinstance(target, int) or not 0 <= target < plan.num_ranks
    if target != "all" and bad_dst:
        raise ValueError(f"dst={dst!r}: pass 'all' (or None) or a domain rank in [0, {plan.num_ranks})")
    metas = local_metas(plan, me)
    error: str | None = None
    if len(local_outputs_per_round) != plan.num_rounds:
        error = f"len(local_outputs_per_round)={len(local_outputs_per_round)}; the plan has {plan.num_rounds} rounds"
    else:
        for meta, t in zip(metas, local_outputs_per_round):
            if not isinstance(t, torch.Tensor) or t.dim() < 1 or t.shape[0] != meta.num_tokens:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                error = (
                    f"local_outputs_per_round[{meta.round_index}] is {shape}; rank {me} holds "
                    f"{meta.num_tokens} tokens in round {meta.round_index}"
                )
                break
            if t.dtype != local_outputs_per_round[0].dtype or t.shape[1:] != local_outputs_per_round[0].shape[1:]:
                error = "local outputs of different rounds must share dtype and trailing shape"
                break
    template = local_outputs_per_round[0] if not error and local_outputs_per_round else None
    dev = collective_device(domain_group, template)
    dtype, feat = _agree("gather_outputs", error, template, domain_group, dev)
    width = int(np.prod(feat, dtype=np.int64))  # F

    per_rank = plan.tokens_per_rank().sum(axis=0) if plan.num_rounds else np.zeros(plan.num_ranks, np.int64)  # [N]
    pad = int(per_rank.max(initial=0))
    mine = (
        torch.cat([t.detach().reshape(t.shape[0], width) for t in local_outputs_per_round])
        if local_outputs_per_round
        else torch.empty((0, width), dtype=dtype, device=dev)
    )  # [Tr, F]
    buf = torch.zeros((pad, width), dtype=dtype, device=dev)  # [P, F]
    buf[: mine.shape[0]] = mine
    if target == "all":
        bufs = [torch.empty_like(buf) for _ in range(plan.num_ranks)]  # N x [P, F]
        dist.all_gather(bufs, buf, group=domain_group)
    else:
        bufs = [torch.empty_like(buf) for _ in range(plan.num_ranks)] if me == target else None
        dist.gather(buf, bufs, group=domain_group, group_dst=target)
        if bufs is None:
            return None

    lengths = plan.lengths
    starts = np.zeros(plan.num_samples + 1, dtype=np.int64)  # [S+1] offsets in the flat output
    np.cumsum(lengths, out=starts[1:])
    flat = torch.empty((int(starts[-1]), width), dtype=dtype, device=dev)  # [sum L, F]
    starts_t = torch.from_numpy(starts[:-1])
    for r in range(plan.num_ranks):
        ms = local_metas(plan, r)
        if not ms or sum(m.num_tokens for m in ms) == 0:
            continue
        sample_of = torch.cat([m.sample_index for m in ms])  # [Tr]
        offset = torch.cat([m.position_ids for m in ms])  # [Tr]
        rows = (starts_t[sample_of] + offset).to(dev)  # [Tr] row in flat
        flat[rows] = bufs[r][: rows.numel()]
    return [
        flat[int(starts[i]) : int(starts[i + 1])].reshape(int(lengths[i]), *feat)  # [L_i, ...]
        for i in range(plan.num_samples)
    ]


def gather_whole_samples(
    plan: Plan,
    rank: int,
    whole: Mapping[int, torch.Tensor],
    domain_group: dist.ProcessGroup,
    dst: int,
    trailing: tuple[int, ...],
    dtype: torch.dtype,
) -> list[torch.Tensor] | None:
    """Per-sample outputs ``[L_i, *trailing]`` in the caller's order on domain rank ``dst`` (``None``
    elsewhere), from the whole samples the first rank of each group holds (:func:`group_to_leader`).

    ``whole[r]`` is this rank's ``[Σ L_i, *trailing]`` of the group it starts in round r, in group order
    (rounds where it starts no group are absent).  What every rank sends and where it lands follow from
    the plan's groups alone, so one padded ``gather`` over ``domain_group`` is the only communication:
    no per-rank layouts (:func:`gather_outputs` rebuilds every rank's chunk layout) and no header (the
    caller states ``dtype`` and ``trailing``).  Detached: outputs for the caller.
    """
    me = _check_domain(plan, domain_group)
    assert rank == me, f"rank={rank} but this process is domain rank {me}"
    led: list[list[tuple[int, tuple[int, ...]]]] = [[] for _ in range(plan.num_ranks)]  # N x [(round, samples)]
    for rnd in plan.rounds:
        for g in rnd.groups:
            led[g.start].append((rnd.index, g.samples))
    lengths = plan.lengths
    sent = [int(sum(int(lengths[i]) for _, ss in rounds for i in ss)) for rounds in led]  # [N] rows each rank sends
    width = int(np.prod(trailing, dtype=np.int64))  # F
    dev = collective_device(domain_group)
    buf = torch.zeros((max(sent, default=0), width), dtype=dtype, device=dev)  # [P, F]
    if led[me]:
        mine = torch.cat([whole[r].detach().reshape(-1, width) for r, _ in led[me]])  # [sent[me], F]
        assert mine.shape[0] == sent[me], f"rank {me} holds {mine.shape[0]} rows of whole samples; the plan says {sent[me]}"
        buf[: mine.shape[0]] = mine.to(device=dev, dtype=dtype)
    bufs = [torch.empty_like(buf) for _ in range(plan.num_ranks)] if me == dst else None
    dist.gather(buf, bufs, group=domain_group, group_dst=dst)
    if bufs is None:
        return None
    out: list[torch.Tensor | None] = [None] * plan.num_samples
    for q, rounds in enumerate(led):
        order = [i for _, ss in rounds for i in ss]  # rank q's samples, in the order it sent them
        for i, rows in zip(order, bufs[q][: sent[q]].split([int(lengths[i]) for i in order])):
            out[i] = rows.reshape(int(lengths[i]), *trailing)  # [L_i, ...]
    assert all(x is not None for x in out), "every sample is in exactly one group"
    return out  # type: ignore[return-value]


# ---------------------------------------------------------------- whole samples inside a group

_TAG_GROUP = 21
_TAG_LEADER = 22


def _flat_rows(lengths: Sequence[int], k: int, j: int) -> torch.Tensor:
    """[T_j] int64: the row, in the group's samples laid one after another, of each local token of group
    position ``j`` (its front and back chunk of each sample in turn, as :func:`local_meta` orders them)."""
    parts, start = [], 0
    for n in lengths:
        (fs, fe), (bs, be) = rank_chunks(n, k, j)
        parts += [np.arange(start + fs, start + fe, dtype=np.int64), np.arange(start + bs, start + be, dtype=np.int64)]
        start += n
    return torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, np.int64))


def _check_local(meta: LocalMeta, local: torch.Tensor) -> None:
    """ValueError unless ``local`` holds a row per local token of ``meta``'s round."""
    if local.shape[0] != meta.num_tokens:
        raise ValueError(f"local has {local.shape[0]} rows; round {meta.round_index} of rank {meta.rank} holds "
                         f"{meta.num_tokens} tokens")


def _received(meta: LocalMeta, local: torch.Tensor, members: Sequence[int], groups: DomainGroups, tag: int,
              send: torch.Tensor | None = None) -> torch.Tensor:
    """[Σ L_i, ...]: the group's samples laid one after another, with the rows of the group positions
    ``members`` that hold tokens received from them (detached; zeros elsewhere); ``send`` [T, ...], when
    given, goes to each of them in the same batch of point-to-point ops on the domain group."""
    lengths = meta.group_lengths
    flat = local.new_zeros((sum(lengths), *local.shape[1:]))  # [Σ L_i, ...]
    peers = [(meta.group_start + j, rows) for j in members
             for rows in [_flat_rows(lengths, meta.k, j)] if rows.numel() > 0]  # [(rank, [T_q] rows)]
    bufs = [local.new_empty((rows.numel(), *local.shape[1:])) for _, rows in peers]
    ops = []
    for (q, _), buf in zip(peers, bufs):
        peer = groups.global_ranks[q]
        if send is not None and send.shape[0]:
            ops.append(dist.P2POp(dist.isend, send, peer, groups.domain, tag))
        ops.append(dist.P2POp(dist.irecv, buf, peer, groups.domain, tag))
    for work in (dist.batch_isend_irecv(ops) if ops else []):
        work.wait()
    for (_, rows), buf in zip(peers, bufs):
        flat[rows.to(local.device)] = buf
    return flat


def group_samples_flat(plan: Plan, meta: LocalMeta, local: torch.Tensor, groups: DomainGroups) -> torch.Tensor:
    """[Σ L_i, ...]: the whole samples of this rank's group in round ``meta.round_index``, one after
    another in the group's order (``meta.samples``).

    ``local`` [T, ...] are this rank's per-token values of the round (its zigzag chunks, as
    :func:`local_meta` orders them).  Every member with tokens sends them to every other member with
    tokens and receives theirs (one batch of point-to-point ops on the domain group, peers by global
    rank): per-rank bytes are the group's tokens, a rank alone in its group sends and receives
    nothing, and only the rows of the group's k members are computed (`_flat_rows`: no metas, no O(N)
    work; the layout comes from ``meta`` alone, ``plan`` is not read).  Own rows keep their graph
    (others' arrive detached), so when every member computes the same loss of the whole samples and
    differentiates through its own rows, the domain sum of gradients is the gradient of that loss.
    Each member's rows are placed with one indexed write (no per-sample work).  Collective over the
    group's members that hold tokens: each calls it in the same round.
    """
    _check_local(meta, local)
    if meta.k == 1:  # a rank alone holds its samples whole, in group order (chunks 0 and 1 of each, in turn)
        return local
    send = local.detach().contiguous()
    flat = _received(meta, local, [j for j in range(meta.k) if j != meta.j], groups, _TAG_GROUP, send=send)
    own = _flat_rows(meta.group_lengths, meta.k, meta.j).to(local.device)  # [T]
    return flat.index_put((own,), local)  # out-of-place: grad flows to `local`


def group_to_leader(meta: LocalMeta, local: torch.Tensor, groups: DomainGroups) -> torch.Tensor | None:
    """[Σ L_i, ...] on the group's first rank (position 0, its leader): the group's whole samples in round
    ``meta.round_index``, one after another in group order, from every member's ``local`` [T, ...] rows
    (its zigzag chunks, as :func:`local_meta` orders them); ``None`` on the other members, which each send
    their rows to the leader (one message each; a member without tokens sends nothing).  Detached: the
    leader computes on the whole samples and hands each member its rows of the result back with
    :func:`leader_to_group`.  A rank alone in its group gets ``local`` back.  Collective over the
    group's members that hold tokens (the leader always holds some: it has every sample's last token)."""
    _check_local(meta, local)
    if meta.k == 1:
        return local.detach()
    lengths = meta.group_lengths
    send = local.detach().contiguous()
    if meta.j != 0:
        dist.send(send, groups.global_ranks[meta.group_start], group=groups.domain, tag=_TAG_LEADER)
        return None
    flat = _received(meta, local, range(1, meta.k), groups, _TAG_LEADER)  # [Σ L_i, ...]
    flat[_flat_rows(lengths, meta.k, 0).to(local.device)] = send
    return flat


def leader_to_group(meta: LocalMeta, full: torch.Tensor | None, like: torch.Tensor,
                    groups: DomainGroups) -> torch.Tensor:
    """[T, ...] this member's rows of ``full`` [Σ L_i, ...], which the group's leader holds (laid out as
    :func:`group_to_leader` returns; ``None`` on the other members): the leader sends each member with
    tokens its rows (one message each) and keeps its own; a member receives its rows into a tensor
    like ``like`` [T, ...].  A rank alone in its group gets its rows of ``full``.  Collective over the
    group's members that hold tokens, after :func:`group_to_leader` in the same round."""
    lengths = meta.group_lengths
    if meta.j != 0:
        out = torch.empty_like(like)  # [T, ...]
        dist.recv(out, groups.global_ranks[meta.group_start], group=groups.domain, tag=_TAG_LEADER)
        return out
    assert full is not None, "the group's leader holds what it hands back"
    if meta.k == 1:
        return full
    sends = [(meta.group_start + j, full[rows.to(full.device)]) for j in range(1, meta.k)
             for rows in [_flat_rows(lengths, meta.k, j)] if rows.numel() > 0]  # [(rank, [T_q, ...])]
    ops = [dist.P2POp(dist.isend, rows, groups.global_ranks[q], groups.domain, _TAG_LEADER) for q, rows in sends]
    for work in (dist.batch_isend_irecv(ops) if ops else []):
        work.wait()
    return full[_flat_rows(lengths, meta.k, 0).to(full.device)]
