"""All-gather K/V context parallelism over a cached aligned power-of-two block group.

Dimension legend:
    T       tokens held by this rank (THD layout); P = pad, rows per rank in the gathered buffer
    Tk'     packed key prefixes this rank attends (sum over its chunks of the chunk's end position)
    Hq/Hkv  query / key-value heads (GQA); D query/key head dim, Dv value head dim; k group size

Every rank all-gathers the (padded) local K/V of the group, rebuilds for each local chunk the
key prefix [0, end of chunk) of its sample (:func:`hdp.cp.metadata.allgather_index`), and runs one
bottom-right causal varlen kernel call with every chunk as its own query sequence: the front chunk
attends keys [0, end_of_front), the back chunk keys [0, end_of_back) (Llama-3 style CP).
Backward re-gathers K/V (nothing of size k·T is saved between passes), scatters the key-prefix
gradients into the gathered layout and reduce-scatters them back to their owners.  K and V travel
as one buffer [.., Hkv, D + Dv] (so Dv may differ from D); a sliding window passes the chunks' and
prefixes' sample positions (:class:`hdp.cp.metadata.AllGatherIndex`) to the kernel.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hdp.cp.autograd import CPAttentionFunction
from hdp.cp.metadata import AllGatherIndex
from hdp.kernels import AttentionKernel, KeyWindow
from hdp.memory_meter import track

__all__ = ["allgather_forward", "allgather_backward", "allgather_attention"]

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single (the old names warn);
# same signatures.  Drop the fallbacks once torch < 2.13 is no longer supported.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _gather_kv(k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup, index: AllGatherIndex) -> torch.Tensor:
    """All-gather local K/V padded to ``index.pad`` rows: returns [k·P, Hkv, D+Dv]."""
    size = dist.get_world_size(group)
    dk = k.shape[-1]
    buf = torch.zeros((index.pad, k.shape[1], dk + v.shape[-1]), dtype=k.dtype, device=k.device)  # [P, Hkv, D+Dv]
    buf[: k.shape[0], :, :dk] = k
    buf[: k.shape[0], :, dk:] = v
    gathered = torch.empty((size * index.pad,) + tuple(buf.shape[1:]), dtype=k.dtype, device=k.device)
    track(buf, gathered)
    _all_gather_single(gathered, buf, group=group)  # [k·P, Hkv, D+Dv]
    return gathered


def _reduce_scatter(full: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum ``full [k·P, ...]`` over the group and return this rank's rows [P, ...]."""
    size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    rows = full.shape[0] // size
    if dist.get_backend(group) == "gloo":  # gloo has no reduce_scatter: all-reduce, keep our slice
        dist.all_reduce(full, group=group)
        return full[rank * rows : (rank + 1) * rows]
    part = torch.empty((rows,) + tuple(full.shape[1:]), dtype=full.dtype, device=full.device)
    _reduce_scatter_single(part, full, group=group)
    return part


def _keys(gathered: torch.Tensor, index: AllGatherIndex) -> torch.Tensor:
    return gathered.index_select(0, index.key_index.to(gathered.device))  # [Tk', Hkv, D+Dv]


def _window(window: int | None, index: AllGatherIndex, dev: torch.device) -> KeyWindow | None:
    return None if window is None else KeyWindow(window, index.q_positions.to(dev), index.k_positions.to(dev))


def allgather_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    index: AllGatherIndex,
    window: int | None,
    kernel: AttentionKernel,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather CP forward on the block ``group``: returns ``(out [T, Hq, Dv], lse [Hq, T])``."""
    dk = k.shape[-1]
    keys = _keys(_gather_kv(k, v, group, index), index)  # [Tk', Hkv, D+Dv]
    track(keys)
    return kernel.forward(q, keys[..., :dk], keys[..., dk:], index.cu_q, index.cu_k, True, scale,
                          window=_window(window, index, q.device))


def allgather_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    group: dist.ProcessGroup,
    index: AllGatherIndex,
    window: int | None,
    kernel: AttentionKernel,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All-gather CP backward: re-gathers K/V, reduce-scatters dK/dV; returns ``(dq, dk, dv)``."""
    size = dist.get_world_size(group)
    dk = k.shape[-1]
    keys = _keys(_gather_kv(k, v, group, index), index)  # [Tk', Hkv, D+Dv]
    dq, dkp, dvp = kernel.backward(dout, q, keys[..., :dk], keys[..., dk:], out, lse, index.cu_q, index.cu_k, True,
                                   scale, window=_window(window, index, q.device))
    acc_t = _acc_dtype(k.dtype)
    full = torch.zeros((size * index.pad,) + tuple(keys.shape[1:]), dtype=acc_t, device=k.device)  # [k·P, Hkv, D+Dv]
    track(full)
    dkv = torch.cat([dkp, dvp], dim=-1).to(acc_t)  # [Tk', Hkv, D+Dv]
    full.index_add_(0, index.key_index.to(k.device), dkv)
    mine = _reduce_scatter(full, group)[: k.shape[0]]  # [T, Hkv, D+Dv]
    return dq, mine[..., :dk].to(k.dtype).contiguous(), mine[..., dk:].to(v.dtype).contiguous()


def allgather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    index: AllGatherIndex,
    kernel: AttentionKernel,
    scale: float,
    *,
    window: int | None = None,
    sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable all-gather CP attention: ``(out [T, Hq, Dv], lse [Hq, T])``; ``window``/``sink`` as in
    :func:`hdp.cp.ring.ring_attention`."""
    return CPAttentionFunction.apply(q, k, v, sink, allgather_forward, allgather_backward, (group, index, window),
                                     kernel, scale)
