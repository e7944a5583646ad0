"""Benchmark of context-parallel attention on CPU gloo ranks: efficiency of CP-k against one process.

``bench_attention(ranks=2, tokens=8192, algo="ring")`` times forward + backward of one causal
sample of ``tokens`` tokens split zigzag over ``ranks`` gloo processes (one thread each), and the
same sample in one process (one thread) with the reference kernel, and reports

    efficiency = T1 / (k · Tk)

plus the largest absolute difference of the CP output and gradients from the single-process run.
Run as ``python -m benchmarks attention --ranks 2 --tokens 8192 --algo ring --json``.

Legend: T tokens, Hq/Hkv query/kv heads, D head dim.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from hdp.cp import CPAlgorithm, cp_attention
from hdp.cp.metadata import positions, rank_layout
from hdp.groups import DomainGroups
from hdp.kernels import get_kernel, kernel_attention

__all__ = ["bench_attention"]

logger = logging.getLogger(__name__)


def _inputs(tokens: int, heads: int, kv_heads: int, head_dim: int, seed: int) -> list[torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], dout [T, Hq, D] in float32, deterministic."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(tokens, heads, head_dim), (tokens, kv_heads, head_dim), (tokens, kv_heads, head_dim)]
    shapes.append((tokens, heads, head_dim))
    return [torch.randn(s, generator=gen, dtype=torch.float32) for s in shapes]


def _fwd_bwd_single(inputs: list[torch.Tensor], scale: float) -> tuple[float, float, list[torch.Tensor]]:
    q, k, v, dout = (t.clone().requires_grad_(i < 3) for i, t in enumerate(inputs))
    cu = torch.tensor([0, q.shape[0]], dtype=torch.int32)
    t0, c0 = time.perf_counter(), time.process_time()
    out, _ = kernel_attention(q, k, v, cu, cu, True, scale, get_kernel(q.device))
    out.backward(dout)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    return dt, dc, [out.detach(), q.grad, k.grad, v.grad]


def _rank_main(rank: int, world: int, cfg: dict[str, Any]) -> tuple[Any, ...]:
    """One rank (launched by :func:`hdp.trainer.launch.spawn`): (rank, times, local index, grads)."""
    domain = dist.group.WORLD
    groups = DomainGroups.build(domain)
    ring = groups.ring(0, world)
    lengths = [cfg["tokens"]]
    idx = positions(lengths, world, rank)  # one sample: position == index into the full sample
    assert idx.numel() == rank_layout(lengths, world, rank).num_tokens
    full = _inputs(cfg["tokens"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["seed"])
    q, k, v, dout = (t[idx] for t in full)  # [T_local, H, D] each
    times = []
    grads: list[torch.Tensor] = []
    for it in range(cfg["repeats"] + 1):  # the first iteration is a warm-up
        lq, lk, lv = (t.clone().requires_grad_(True) for t in (q, k, v))
        dist.barrier(group=domain)
        t0, c0 = time.perf_counter(), time.process_time()
        out = cp_attention(lq, lk, lv, lengths, world, ring=ring, groups=groups, algo=cfg["algo"], scale=cfg["scale"])
        out.backward(dout)
        c1 = time.process_time()  # CPU time of this rank, before waiting for the slowest one
        dist.barrier(group=domain)
        if it > 0:
            times.append((time.perf_counter() - t0, c1 - c0))
        grads = [out.detach(), lq.grad, lk.grad, lv.grad]
    return rank, times, idx.numpy(), [g.numpy() for g in grads]


def _run_ranks(ranks: int, cfg: dict[str, Any], timeout: float) -> list[tuple[Any, ...]]:
    from hdp.trainer.launch import spawn

    return spawn(_rank_main, ranks, cfg, timeout=timeout, threads=1)


def bench_attention(
    ranks: int = 2,
    tokens: int = 8192,
    algo: str = "ring",
    heads: int = 4,
    kv_heads: int | None = None,
    head_dim: int = 64,
    repeats: int = 3,
    seed: int = 0,
    timeout: float = 600.0,
) -> dict[str, Any]:
    """Time CP-``ranks`` attention (fwd + bwd, float32, 1 thread per rank) against one process.

    Returns ``{"algo", "ranks", "tokens", "t1_s", "tk_s", "efficiency", "max_abs_err"}`` (best of
    ``repeats`` after one warm-up, for both runs) plus the shape used and ``load_1m``, the 1-minute
    load average before the CP run (the ranks need ``ranks`` idle cores for a fair figure), and the
    same ratio from per-process CPU time (``cpu_efficiency``: insensitive to other load, blind to
    time spent waiting on communication).
    """
    cp_algo = CPAlgorithm(algo)
    if ranks < 1:
        raise ValueError(f"ranks={ranks}: need at least 1")
    if cp_algo is CPAlgorithm.ALLGATHER and ranks > 1 and ranks & (ranks - 1):
        raise ValueError(f"ranks={ranks}: algo=allgather needs a power-of-two group; use algo='ring'")
    if tokens < 1:
        raise ValueError(f"tokens={tokens}: need at least 1")
    kv_heads = heads if kv_heads is None else kv_heads
    scale = 1.0 / math.sqrt(head_dim)
    cfg = dict(tokens=tokens, heads=heads, kv_heads=kv_heads, head_dim=head_dim, seed=seed,
               repeats=repeats, algo=cp_algo, scale=scale)

    # single process, one thread (restore the caller's thread count afterwards)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        inputs = _inputs(tokens, heads, kv_heads, head_dim, seed)
        t1_all: list[tuple[float, float]] = []
        ref: list[torch.Tensor] = []
        for it in range(repeats + 1):
            dt, dc, ref = _fwd_bwd_single(inputs, scale)
            if it > 0:
                t1_all.append((dt, dc))
    finally:
        torch.set_num_threads(threads)

    load = os.getloadavg()[0]  # other work on the machine skews tk_s more than t1_s
    per_rank = _run_ranks(ranks, cfg, timeout)
    # a step ends when the slowest rank does
    tk_all = [max(r[1][i][0] for r in per_rank) for i in range(repeats)]
    tk_cpu = min(max(r[1][i][1] for r in per_rank) for i in range(repeats))
    err = 0.0
    for _, _, idx, grads in per_rank:
        for got, want in zip(grads, ref):
            err = max(err, (torch.from_numpy(got) - want[torch.from_numpy(idx)]).abs().max().item())
    t1, tk = min(t[0] for t in t1_all), min(tk_all)
    t1_cpu = min(t[1] for t in t1_all)
    res = {
        "algo": cp_algo.value,
        "ranks": ranks,
        "tokens": tokens,
        "t1_s": t1,
        "tk_s": tk,
        "efficiency": t1 / (ranks * tk),
        "max_abs_err": err,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "repeats": repeats,
        "load_1m": load,
        "t1_cpu_s": t1_cpu,
        "tk_cpu_s": tk_cpu,
        "cpu_efficiency": t1_cpu / (ranks * tk_cpu),
    }
    logger.info("bench_attention: %s", res)
    return res
