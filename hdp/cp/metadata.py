"""Per-rank metadata of zigzag context parallelism (pure: no torch.distributed, no device).

Dimension legend:
    S   samples of the packed group (in group order)
    k   ranks in the CP group; j this rank's position in it (0-based)
    L   sample length; T tokens held locally by a rank (sum over samples of front + back chunk)

Zigzag chunking (:mod:`hdp.packing.chunks`): sample s is cut into 2k chunks with boundaries
``floor(c * L / 2k)``; rank j holds chunk j ("front") and chunk 2k-1-j ("back").  A rank's local
token layout is, for each sample in group order, its front chunk then its back chunk.

Ring schedule (zigzag ring attention, see ring-flash-attention ``zigzag_ring_flash_attn``):
at step s rank j holds the K/V of source i = (j - s) mod k.
  * s = 0: local q vs local kv, causal (front+back concatenated is causal-correct because the
    front chunk precedes the back chunk in the sample);
  * i < j: all local q vs the *front* chunks of i, non-causal (chunk i precedes chunks j and
    2k-1-j; i's back chunk 2k-1-i follows both and is invisible);
  * i > j: only the local *back* chunks vs all of i, non-causal (chunks i and 2k-1-i both
    precede 2k-1-j; the local front chunk j precedes both and sees nothing).
Both non-causal cases cost about 2·c² for chunk size c, so every step is balanced.

Sliding windows (:func:`step_sees_keys`): a query at sample position p sees keys at [p - left, p],
so a step whose source keys all lie more than ``left`` positions before every local query of the
same sample computes nothing and is skipped (its K/V still travels on around the ring).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from hdp.packing.chunks import rank_chunks

__all__ = [
    "StepCase",
    "RingStep",
    "RankLayout",
    "rank_layout",
    "group_layouts",
    "ring_schedule",
    "positions",
    "step_sees_keys",
    "AllGatherIndex",
    "allgather_index",
]


class StepCase(enum.Enum):
    """Which block of the causal mask one ring step computes."""

    LOCAL_CAUSAL = "local_causal"
    """Step 0: local q against local k/v, causal."""
    FRONT_KEYS = "front_keys"
    """Source i < j: all local q against the front chunks of i, non-causal."""
    BACK_QUERIES = "back_queries"
    """Source i > j: local back chunks against all of i, non-causal."""


@dataclass(frozen=True)
class RingStep:
    """One step of the ring: the source position whose K/V this rank holds, and the case."""

    step: int
    """Step index s (0 .. k-1)."""
    source: int
    """Group position i = (j - s) mod k whose K/V is held at this step."""
    case: StepCase
    """Which q rows / k columns the step computes."""


def _check_lengths(lengths: Sequence[int], k: int, j: int) -> tuple[int, ...]:
    lens = tuple(int(x) for x in lengths)
    if any(x < 0 for x in lens):
        raise ValueError(f"group_lengths={list(lens)}: sample lengths must be >= 0")
    if k < 1:
        raise ValueError(f"k_group={k}: a CP group has at least one rank")
    if not 0 <= j < k:
        raise ValueError(f"position={j}: must be in [0, {k}) for a group of {k} ranks")
    return lens


def _cu(lens: np.ndarray) -> torch.Tensor:
    cu = np.zeros(len(lens) + 1, dtype=np.int64)  # [S+1]
    np.cumsum(lens, out=cu[1:])
    return torch.from_numpy(cu.astype(np.int32))


@dataclass(frozen=True, eq=False)
class RankLayout:
    """Local token layout of one rank of a CP group (CPU tensors; move them with ``.to``)."""

    lengths: tuple[int, ...]
    """Sample lengths in group order."""
    k: int
    """CP group size."""
    j: int
    """This rank's position in the group."""
    front: tuple[tuple[int, int], ...]
    """Per sample, the (start, end) of the front chunk in sample coordinates."""
    back: tuple[tuple[int, int], ...]
    """Per sample, the (start, end) of the back chunk in sample coordinates."""
    num_tokens: int
    """T: tokens held locally."""
    cu_seqlens: torch.Tensor
    """[S+1] int32: local q boundaries per sample (front and back chunk together)."""
    cu_front: torch.Tensor
    """[S+1] int32: boundaries of the front chunks alone (as if packed)."""
    cu_back: torch.Tensor
    """[S+1] int32: boundaries of the back chunks alone (as if packed)."""
    cu_chunks: torch.Tensor
    """[2S+1] int32: boundaries of every chunk of the local layout (front_0, back_0, front_1, ...)."""
    front_index: torch.Tensor
    """[sum front] int64: local indices of the front-chunk tokens."""
    back_index: torch.Tensor
    """[sum back] int64: local indices of the back-chunk tokens."""
    positions: torch.Tensor
    """[T] int64: sample position of every local token (front chunk then back chunk, per sample)."""

    @property
    def front_tokens(self) -> int:
        """Number of local tokens in front chunks."""
        return int(self.front_index.numel())

    @property
    def back_tokens(self) -> int:
        """Number of local tokens in back chunks."""
        return int(self.back_index.numel())


def rank_layout(lengths: Sequence[int], k: int, j: int) -> RankLayout:
    """Layout of rank ``j`` of a ``k``-rank group holding samples of ``lengths`` (in group order)."""
    lens = _check_lengths(lengths, k, j)
    chunks = [rank_chunks(n, k, j) for n in lens]
    front = tuple(c[0] for c in chunks)
    back = tuple(c[1] for c in chunks)
    fl = np.array([e - s for s, e in front], dtype=np.int64)  # [S]
    bl = np.array([e - s for s, e in back], dtype=np.int64)  # [S]
    tot = fl + bl  # [S]
    starts = np.concatenate([[0], np.cumsum(tot)[:-1]]).astype(np.int64) if lens else np.zeros(0, np.int64)
    front_idx = [np.arange(s, s + f, dtype=np.int64) for s, f in zip(starts, fl)]
    back_idx = [np.arange(s + f, s + f + b, dtype=np.int64) for s, f, b in zip(starts, fl, bl)]
    chunk_lens = np.stack([fl, bl], axis=1).reshape(-1)  # [2S] (front_0, back_0, front_1, ...)
    cat = lambda parts: torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, np.int64))  # noqa: E731
    pos = [np.arange(a, b, dtype=np.int64) for chunk in zip(front, back) for a, b in chunk]
    return RankLayout(
        lengths=lens,
        k=k,
        j=j,
        front=front,
        back=back,
        num_tokens=int(tot.sum()),
        cu_seqlens=_cu(tot),
        cu_front=_cu(fl),
        cu_back=_cu(bl),
        cu_chunks=_cu(chunk_lens),
        front_index=cat(front_idx),
        back_index=cat(back_idx),
        positions=cat(pos),
    )


def group_layouts(lengths: Sequence[int], k: int) -> tuple[RankLayout, ...]:
    """Layouts of all ``k`` ranks of a group (rank j needs its sources' layouts for the ring)."""
    return tuple(rank_layout(lengths, k, j) for j in range(k))


def ring_schedule(k: int, j: int) -> tuple[RingStep, ...]:
    """The k steps of the zigzag ring for position ``j``: source ``(j - s) mod k`` and its case."""
    if not 0 <= j < k:
        raise ValueError(f"position={j}: must be in [0, {k})")
    steps = []
    for s in range(k):
        i = (j - s) % k
        case = StepCase.LOCAL_CAUSAL if s == 0 else (StepCase.FRONT_KEYS if i < j else StepCase.BACK_QUERIES)
        steps.append(RingStep(step=s, source=i, case=case))
    return tuple(steps)


def positions(lengths: Sequence[int], k: int, j: int) -> torch.Tensor:
    """[T] int64: position id of every local token inside its sample (for RoPE)."""
    return rank_layout(lengths, k, j).positions


def step_sees_keys(lay: RankLayout, src: RankLayout, case: StepCase, left: int | None) -> bool:
    """Whether a ring step of ``case`` (queries of ``lay``, keys of ``src``) has any visible key under a
    sliding window of ``left`` positions (``None``: no window; the step always computes)."""
    if left is None or case is StepCase.LOCAL_CAUSAL:
        return True
    for s in range(len(lay.lengths)):
        (fs, fe), (bs, be) = lay.front[s], lay.back[s]
        (sfs, sfe), (sbs, sbe) = src.front[s], src.back[s]
        if case is StepCase.FRONT_KEYS:  # every local query against src's front chunk
            first_q = fs if fe > fs else bs
            has_q, last_k = (fe > fs or be > bs), sfe - 1
            has_k = sfe > sfs
        else:  # BACK_QUERIES: the local back chunk against all of src
            first_q, has_q = bs, be > bs
            has_k = sfe > sfs or sbe > sbs
            last_k = sbe - 1 if sbe > sbs else sfe - 1
        if has_q and has_k and first_q - left <= last_k:
            return True
    return False


@dataclass(frozen=True, eq=False)
class AllGatherIndex:
    """How rank j rebuilds the key prefixes it needs from an all-gathered, padded K/V buffer.

    The gathered buffer holds rank r's local token t at row ``r * pad + t``.  Rank j treats each
    local chunk as its own query sequence (``cu_q = cu_chunks``, 2S sequences) against the key
    prefix [0, end of that chunk) of its sample, bottom-right causal.
    """

    pad: int
    """Rows per rank in the gathered buffer (max local tokens over the group)."""
    key_index: torch.Tensor
    """[Tk'] int64: rows of the gathered buffer forming the packed key prefixes."""
    cu_q: torch.Tensor
    """[2S+1] int32: local chunk boundaries (front_0, back_0, front_1, ...)."""
    cu_k: torch.Tensor
    """[2S+1] int32: boundaries of the key prefixes, paired with ``cu_q``."""
    q_positions: torch.Tensor
    """[T] int64: sample position of every local query row (the local layout's positions)."""
    k_positions: torch.Tensor
    """[Tk'] int64: sample position of every key of the prefixes (0 .. end of the chunk, per chunk)."""


def allgather_index(lengths: Sequence[int], k: int, j: int) -> AllGatherIndex:
    """Index metadata for the all-gather algorithm on rank ``j`` of a ``k``-rank group."""
    lens = _check_lengths(lengths, k, j)
    lays = group_layouts(lens, k)
    pad = max(lay.num_tokens for lay in lays)
    sample_start = [lay.cu_seqlens.numpy()[:-1].astype(np.int64) for lay in lays]
    key_parts: list[np.ndarray] = []
    prefix_lens: list[int] = []
    for s, n in enumerate(lens):
        origin = np.empty(n, dtype=np.int64)  # [L]: gathered-buffer row of every token of sample s
        for r, lay in enumerate(lays):
            base = r * pad + int(sample_start[r][s])
            (fs, fe), (bs, be) = lay.front[s], lay.back[s]
            origin[fs:fe] = base + np.arange(fe - fs)
            origin[bs:be] = base + (fe - fs) + np.arange(be - bs)
        fe_j, be_j = lays[j].front[s][1], lays[j].back[s][1]
        key_parts += [origin[:fe_j], origin[:be_j]]
        prefix_lens += [fe_j, be_j]
    key_index = np.concatenate(key_parts) if key_parts else np.zeros(0, np.int64)
    k_pos = [np.arange(n, dtype=np.int64) for n in prefix_lens]
    return AllGatherIndex(
        pad=pad,
        key_index=torch.from_numpy(key_index),
        cu_q=lays[j].cu_chunks,
        cu_k=_cu(np.asarray(prefix_lens, dtype=np.int64)),
        q_positions=lays[j].positions,
        k_positions=torch.from_numpy(np.concatenate(k_pos) if k_pos else np.zeros(0, np.int64)),
    )
