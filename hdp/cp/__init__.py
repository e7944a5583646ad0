"""Context-parallel attention algorithms (ring, all-gather K/V) over hdp rank groups.

:func:`cp_attention` is the one entry point: it takes this rank's local THD tensors of a packed
group (zigzag layout, :mod:`hdp.cp.metadata`), validates everything before any communication,
and runs the chosen algorithm (or the plain local kernel when the group has one rank).

Legend: T local tokens, Hq/Hkv query/kv heads, D query/key head dim, Dv value head dim.
"""

from __future__ import annotations

import enum
import logging
import math
from typing import Sequence

import torch

from hdp.cp import metadata
from hdp.cp.allgather import allgather_attention
from hdp.cp.ring import ring_attention
from hdp.groups import DomainGroups, RingSpec
from hdp.kernels import AttentionKernel, KeyWindow, get_kernel, kernel_attention

__all__ = ["CPAlgorithm", "cp_attention"]

logger = logging.getLogger(__name__)


class CPAlgorithm(enum.Enum):
    """Context-parallel attention algorithm."""

    RING = "ring"
    """Zigzag P2P ring over any contiguous rank range."""
    ALLGATHER = "allgather"
    """All-gather K/V over an aligned power-of-two block group."""


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"q/k/v: expected THD tensors [T, H, D]; got q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)}"
        )
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k{tuple(k.shape)} and v{tuple(v.shape)} must have the same tokens and heads")
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q{tuple(q.shape)} and k{tuple(k.shape)} must have the same tokens T and head dim D")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"heads: Hq={q.shape[1]} must be a multiple of Hkv={k.shape[1]}")
    if q.dtype != k.dtype or q.dtype != v.dtype or q.device != k.device or q.device != v.device:
        raise ValueError("q, k, v must share dtype and device")


def cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group_lengths: Sequence[int],
    k_group: int,
    *,
    ring: RingSpec | None = None,
    groups: DomainGroups | None = None,
    algo: CPAlgorithm | str = CPAlgorithm.RING,
    kernel: AttentionKernel | None = None,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    window: int | None = None,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a packed group, split zigzag over ``k_group`` ranks; returns out [T, Hq, Dv].

    q: [T, Hq, D], k: [T, Hkv, D], v: [T, Hkv, Dv] are this rank's local tokens (for each sample of
    ``group_lengths``, its front then its back chunk).  ``ring`` (from ``DomainGroups.ring``) gives
    this rank's position and peers and is required when ``k_group > 1``; ``groups`` is required for
    ``CPAlgorithm.ALLGATHER``, which needs an aligned power-of-two block.  ``kernel`` defaults to
    :func:`hdp.kernels.get_kernel` of q's device, ``scale`` to ``1/sqrt(D)``.  ``cu_seqlens``, if the
    caller has one for its local tokens, is checked against the layout implied by ``group_lengths``.
    ``window``: each query sees the keys at most ``window`` sample positions before it (Megatron
    ``window_size=(window, 0)``), across CP chunk boundaries; ``sink`` [Hq]: softmax sink logits
    (:mod:`hdp.kernels.variants`).  Differentiable in q, k, v and ``sink``.
    """
    try:
        algo = CPAlgorithm(algo)
    except ValueError as exc:
        raise ValueError(f"algo={algo!r}: choose one of {[a.value for a in CPAlgorithm]}") from exc
    _validate(q, k, v)
    if k_group < 1:
        raise ValueError(f"k_group={k_group}: a CP group has at least one rank")
    if k_group > 1:
        if ring is None:
            raise ValueError(f"ring=None: k_group={k_group} needs the RingSpec of this rank's group")
        if ring.size != k_group:
            raise ValueError(f"ring has {ring.size} ranks but k_group={k_group}; pass the ring of this group")
    position = ring.position if k_group > 1 and ring is not None else 0
    layout = metadata.rank_layout(group_lengths, k_group, position)
    if q.shape[0] != layout.num_tokens:
        raise ValueError(
            f"q has {q.shape[0]} tokens but group_lengths={list(layout.lengths)} on {k_group} rank(s) "
            f"give position {position} {layout.num_tokens} tokens (cu_seqlens={layout.cu_seqlens.tolist()}); "
            "pass the local zigzag chunks of exactly these samples"
        )
    if cu_seqlens is not None:
        given = [int(x) for x in cu_seqlens.tolist()]
        if given != layout.cu_seqlens.tolist():
            raise ValueError(
                f"cu_seqlens={given} does not match the local layout {layout.cu_seqlens.tolist()} of "
                f"group_lengths={list(layout.lengths)} at position {position} of {k_group}; "
                "pass the boundaries of the local zigzag chunks (front + back per sample)"
            )
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
        raise ValueError(f"window={window!r}: pass the keys' reach before each query (an integer >= 0) or None")
    if sink is not None and tuple(sink.shape) != (q.shape[1],):
        raise ValueError(f"sink{tuple(sink.shape)}: expected one logit per query head, [{q.shape[1]}]")
    kernel = kernel if kernel is not None else get_kernel(q.device)
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[2])

    if k_group == 1:
        win = None if window is None else KeyWindow(window, layout.positions.to(q.device), layout.positions.to(q.device))
        out, _ = kernel_attention(q, k, v, layout.cu_seqlens, layout.cu_seqlens, True, scale, kernel, window=win,
                                  sink=sink)
        return out
    assert ring is not None
    if algo is CPAlgorithm.ALLGATHER:
        if groups is None:
            raise ValueError("groups=None: algo=allgather needs the DomainGroups with the cached block groups")
        if groups.domain is not ring.group:
            raise ValueError("groups and ring belong to different domains; build the ring with groups.ring()")
        block = groups.block_group(ring.start, ring.size)  # ValueError names a non-aligned block
        index = metadata.allgather_index(group_lengths, k_group, position)
        out, _ = allgather_attention(q, k, v, block, index, kernel, scale, window=window, sink=sink)
        return out
    layouts = metadata.group_layouts(group_lengths, k_group)
    out, _ = ring_attention(q, k, v, ring, layouts, kernel, scale, window=window, sink=sink)
    return out
