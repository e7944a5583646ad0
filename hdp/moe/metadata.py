"""Dispatch metadata of one MoE layer with the all-to-all token dispatcher (pure: no torch.distributed).

Dimension legend:
    T   tokens held by this rank (the layer input, flattened)
    H   hidden size
    E   experts in the layer; L = E / ep local experts of a rank; ep expert-parallel ranks
    S   tokens this rank *sends*: T · topk (one row per selected (token, expert) pair)
    R   tokens this rank *receives* (rows its local experts compute)

Layout, identical to Megatron-core's ``MoEAlltoAllTokenDispatcher`` (dropless, TP = 1):

1. permutation 1 (``sorted_indices`` [S]): rows ordered by global expert, tokens in ascending order
   inside an expert (Megatron's ``permute``: ``arange(T).expand(E, T).masked_select(map.T)``);
   expert e of rank j = e // L, so the rows for rank j are one contiguous chunk of
   ``input_splits[j]`` rows.
2. all-to-all over the EP group: rank j sends ``input_splits[j]`` rows to j and receives
   ``output_splits[j]`` rows from j; the received rows are [R] = concatenation over source ranks j
   of (rows for local expert 0, …, rows for local expert L-1).
3. regroup (``group_index`` [R], Megatron's ``sort_chunks_by_idxs``): rows ordered by (local
   expert, source rank), so each local expert's rows are contiguous
   (``tokens_per_local_expert[l]`` of them).  ``x_grouped = x_received[group_index]``.

``counts`` is the [ep, E] matrix of tokens every EP rank routes to every expert (the all-gathered
``routing_map.sum(0)``); everything else follows from it and the routing map.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DispatchMeta", "dispatch_meta", "permutation_indices"]


@dataclass(frozen=True)
class DispatchMeta:
    """Split sizes and row orders of one dispatch/combine round trip of this rank."""

    ep_size: int
    """Expert-parallel ranks."""
    ep_rank: int
    """This rank's index in the EP group."""
    num_local_experts: int
    """L: experts held by each rank."""
    input_splits: tuple[int, ...]
    """[ep] rows this rank sends to each EP rank (dispatch direction)."""
    output_splits: tuple[int, ...]
    """[ep] rows this rank receives from each EP rank (dispatch direction)."""
    tokens_per_local_expert: tuple[int, ...]
    """[L] rows each local expert computes (over all source ranks)."""
    group_index: torch.Tensor | None
    """[R] int64: received row feeding grouped row r; ``None`` when the regroup is the identity."""

    @property
    def num_sent(self) -> int:
        """S: rows sent (T · topk)."""
        return sum(self.input_splits)

    @property
    def num_received(self) -> int:
        """R: rows received and computed here."""
        return sum(self.output_splits)


def permutation_indices(routing_map: torch.Tensor) -> torch.Tensor:
    """Permutation 1: [S] int64 token index of every sent row, rows ordered by expert.

    ``routing_map`` [T, E] bool.  Same order as Megatron-core's ``moe_utils.permute`` (dropless).
    """
    if routing_map.dim() != 2 or routing_map.dtype != torch.bool:
        raise TypeError(
            f"routing_map: expected a 2-D bool tensor [T, E], got {routing_map.dtype} {tuple(routing_map.shape)}"
        )
    num_tokens, num_experts = routing_map.shape
    map_t = routing_map.T.contiguous()  # [E, T]
    token_idx = torch.arange(num_tokens, device=routing_map.device).unsqueeze(0).expand(num_experts, -1)  # [E, T]
    return token_idx.masked_select(map_t)  # [S]


def dispatch_meta(counts: torch.Tensor, ep_rank: int) -> DispatchMeta:
    """Metadata of this rank from ``counts`` [ep, E]: tokens rank j routes to expert e (all ranks).

    ``counts`` may live on any device; it is read to the host once (the split sizes are host
    integers for ``all_to_all_single``, as in Megatron).
    """
    if counts.dim() != 2:
        raise ValueError(f"counts: expected [ep, E], got shape {tuple(counts.shape)}")
    ep, num_experts = counts.shape
    if not 0 <= ep_rank < ep:
        raise ValueError(f"ep_rank={ep_rank}: must be in [0, {ep})")
    if num_experts % ep:
        raise ValueError(f"counts: {num_experts} experts are not divisible by ep={ep}")
    n_local = num_experts // ep
    c = counts.detach().to("cpu", torch.int64).view(ep, ep, n_local)  # [src rank, dst rank, local expert]
    input_splits = tuple(int(v) for v in c[ep_rank].sum(dim=1))  # [ep]: what I send to each rank
    mine = c[:, ep_rank, :]  # [ep src, L]: what each rank sends to my local experts
    output_splits = tuple(int(v) for v in mine.sum(dim=1))
    per_expert = tuple(int(v) for v in mine.sum(dim=0))
    group_index: torch.Tensor | None = None
    if n_local > 1 and ep > 1:
        # received row offset of the chunk (src j, local expert l): chunks are ordered (j, l)
        flat = mine.reshape(-1)  # [ep * L], order (j, l)
        starts = torch.cumsum(flat, 0) - flat  # [ep * L]
        order = torch.arange(ep * n_local).view(ep, n_local).T.reshape(-1)  # chunk ids in (l, j) order
        pieces = [torch.arange(int(starts[i]), int(starts[i]) + int(flat[i])) for i in order.tolist()]
        group_index = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)
        if torch.equal(group_index, torch.arange(group_index.numel())):
            group_index = None
    return DispatchMeta(
        ep_size=ep,
        ep_rank=ep_rank,
        num_local_experts=n_local,
        input_splits=input_splits,
        output_splits=output_splits,
        tokens_per_local_expert=per_expert,
        group_index=group_index,
    )
