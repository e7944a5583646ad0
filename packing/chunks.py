"""Zigzag chunking of one sample over a context-parallel group (pure numpy).

A sample of ``length`` tokens on a group of ``k`` ranks is cut into ``2k`` contiguous chunks
with boundaries ``b_c = floor(c * length / (2k))`` for ``c = 0..2k``.  Rank ``j`` of the group
(0-based position inside the group) holds chunks ``j`` and ``2k-1-j`` — the "front" and the
"back" chunk — so every rank gets about the same causal attention work (TransformerEngine and
Megatron use the same zigzag order; see ring-flash-attention's ``zigzag_ring_flash_attn``).
Chunk sizes differ by at most one token; a sample shorter than ``2k`` has empty chunks.  No
padding is ever added, so the split is exact.
"""

from __future__ import annotations

import numpy as np

__all__ = ["zigzag_bounds", "rank_chunks", "rank_token_count"]


def zigzag_bounds(length: int, k: int) -> np.ndarray:
    """Return the ``2k + 1`` chunk boundaries of a sample of ``length`` tokens on ``k`` ranks."""
    if k < 1:
        raise ValueError(f"k={k}: a group has at least one rank")
    if length < 0:
        raise ValueError(f"length={length}: must be >= 0")
    c = np.arange(2 * k + 1, dtype=np.int64)
    return (c * int(length)) // (2 * k)


def rank_chunks(length: int, k: int, j: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Return ``((front_start, front_end), (back_start, back_end))`` held by group rank ``j``.

    For ``k == 1`` the front chunk is the first half and the back chunk the second half, so the
    two chunks concatenated are the whole sample in order.
    """
    if not 0 <= j < k:
        raise ValueError(f"j={j}: group rank must be in [0, {k})")
    b = zigzag_bounds(length, k)
    back = 2 * k - 1 - j
    return (int(b[j]), int(b[j + 1])), (int(b[back]), int(b[back + 1]))


def rank_token_count(length: int, k: int, j: int) -> int:
    """Number of tokens of the sample held by group rank ``j``."""
    (fs, fe), (bs, be) = rank_chunks(length, k, j)
    return (fe - fs) + (be - bs)
