"""`hdp bench device`: what one accelerator can tell that CPU runs cannot, in one command.

NOT RUN ON HARDWARE: every row below was written and run on CPU only (``--dry-run``, small shapes, the
CUDA kernel adapters through a CPU stand-in of their ops); docs/results.md gets the figures of the first
GPU run.  Rows (``ROWS``), each ``{"row", "status": ok | fail | skipped | error, "reason", "seconds",
"hardware", "figures", "summary"}``; a row that lacks something reports ``skipped`` with the reason,
never a figure it did not measure:

* ``kernel_exactness``: each CUDA attention adapter present (flash-attn, torch's fused flash attention)
  against the fp64 reference kernel, forward and backward, bf16 and fp16, on the kernel calls of a
  zigzag ring over a 3-sample pack (causal, GQA): every call's out / lse / dq / dk / dv, the calls'
  partial outputs merged with the ring's own log-sum-exp merge, and the gradients summed as the ring
  sums them, against full attention on the pack.  Tolerances: `TOLERANCES`.
* ``kernel_speed``: tokens/s of forward + backward of those adapters (and of the reference at the
  shortest lengths) against torch SDPA on the same causal sample, 4K-32K tokens, side by side.
* ``cost_terms``: the per-token and per-ring-step quantities ``hdp calibrate`` fits, measured on this
  device for one attention layer of Llama-3-8B's shape: timing records of one-rank packs and of every
  position of zigzag rings of 2, 4 and 8 replayed on this one device (the kernel calls, merges and
  accumulations of `hdp.cp.ring`; no K/V transfer: one device has no ring link, so the link terms stay
  the base profile's), fitted with `hdp.packing.calibrate` against ``h100-nvlink`` and written as a
  cost-model file (``device_cost.json``, with the records as ``device_records.jsonl``) that
  ``hdp plan --cost-model`` loads; the profile-level figures (attention TFLOP/s, merge picoseconds per
  element, step overhead) beside the preset's.
* ``logprobs``: `hdp.logprobs.logprobs_entropy` against the naive fp32 ``log_softmax`` at T = 16K,
  V = 151,936 (bf16 logits): forward + backward time and the allocator's peak above the logits.
* ``engine_pp1``: `HdpEngine.build` with world size 1 on the device, a few steps of a small GPT in bf16
  against the same seed on CPU in fp32, one batch repeated so that the loss falls by more than
  `ENGINE_MIN_DROP` (losses within `ENGINE_LOSS_RTOL`), the engine's predicted
  against measured peak memory, step time.
* ``train_job``: ``hdp bench train --device cuda|npu`` (`hdp.trainer.bench.train`): static CP and hdp side by side
  on every local device (one rank each, NCCL / HCCL; on CPU two gloo ranks), a small GPT in bf16: tokens/s per
  device, MFU against the device's datasheet peak, the allocator's peak memory, the paired speedup with its
  interval, losses equal across the policies.
* ``engine_vpp``: virtual pipeline stages need ``pp > 1`` (`ParallelConfig`), which needs two ranks;
  one device runs one rank (NCCL takes one rank per GPU), so this row is skipped with that reason.

``dry_run=True`` runs every row on CPU with small shapes in seconds (CI runs it); its figures are not
hardware figures.  The rows that need a process group (log-probs, engine) run in spawned one-rank jobs
(`hdp.trainer.launch.spawn`) so each starts with a clean allocator and Megatron state.

Legend: T tokens, Hq/Hkv query/kv heads, D head dim, V vocabulary, k ring size, j ring position.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import platform
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hdp import device as _device
from hdp.kernels import AttentionKernel, KernelName, get_kernel, kernel_attention, reference

__all__ = ["ROWS", "TOLERANCES", "ENGINE_LOSS_RTOL", "ENGINE_MIN_DROP", "BUDGET_S", "DeviceShapes", "FULL", "DRY",
           "bench_device", "ring_calls", "RingCall", "format_table"]

logger = logging.getLogger(__name__)

ROWS = ("kernel_exactness", "kernel_speed", "cost_terms", "logprobs", "engine_pp1", "train_job", "engine_vpp")
"""The rows of `bench_device`, in the order they run."""

TOLERANCES: dict[str, dict[str, float]] = {
    # out, dq, dk, dv: max |got - fp64| / max |fp64|; lse: max |got - fp64| (natural log units)
    "bfloat16": {"out": 2e-2, "lse": 2e-3, "grad": 5e-2},
    "float16": {"out": 5e-3, "lse": 2e-3, "grad": 1.5e-2},
}
"""Allowed errors of a kernel against the fp64 reference on the same (rounded) inputs, per dtype."""

ENGINE_LOSS_RTOL = 3e-2
"""Allowed relative difference of each step's loss, bf16 on the device against fp32 on CPU, on a run whose
loss falls by more than `ENGINE_MIN_DROP` (bf16 against fp32, both on CPU: at most 4.6e-3 with the `FULL`
shapes, 7.71 -> 4.16 in 6 steps; 2.8e-4 with `DRY`, 4.87 -> 3.08 in 8)."""

ENGINE_MIN_DROP = 0.3
"""Least fall of the CPU run's loss, first to last step, as a fraction of the first, for the comparison to
say something (a run that learns nothing has the same loss whatever it computes)."""

BUDGET_S = 480.0
"""Wall-clock budget of one run (8 minutes): rows that would start after it are skipped."""


@dataclass(frozen=True, kw_only=True)
class DeviceShapes:
    """The sizes one run uses (`FULL` on a GPU, `DRY` for ``--dry-run`` on CPU)."""

    pack: tuple[int, ...]
    """Exactness: sample lengths of the pack (3 samples)."""
    ring: int
    """Exactness: zigzag ring size whose kernel calls are checked."""
    heads: int
    """Exactness: query heads."""
    kv_heads: int
    """Exactness: key/value heads (GQA)."""
    head_dim: int
    """Exactness: head dim."""
    speed_tokens: tuple[int, ...]
    """Speed: lengths of the causal sample."""
    attn_heads: int
    """Speed and cost terms: query heads (Llama-3-8B: 32)."""
    attn_kv_heads: int
    """Speed and cost terms: key/value heads (Llama-3-8B: 8)."""
    attn_head_dim: int
    """Speed and cost terms: head dim (Llama-3-8B: 128)."""
    reference_max_tokens: int
    """Speed: the reference kernel is timed up to this length."""
    repeats: int
    """Timed repeats after one warm-up (the best is reported)."""
    cost_layouts: tuple[tuple[int, ...], ...]
    """Cost terms: per-rank local layouts (a ring of k holds every sequence k times longer)."""
    cost_singles: tuple[int, ...]
    """Cost terms: one-rank single samples beside the layouts."""
    cost_rings: tuple[int, ...]
    """Cost terms: ring sizes replayed."""
    logprobs_tokens: int
    """Log-probs: tokens T."""
    logprobs_vocab: int
    """Log-probs: vocabulary V."""
    engine_layers: int
    """Engine: transformer layers of the small GPT."""
    engine_hidden: int
    """Engine: hidden size."""
    engine_heads: int
    """Engine: attention heads."""
    engine_vocab: int
    """Engine: vocabulary."""
    engine_lengths: tuple[int, ...]
    """Engine: sample lengths of every step's batch."""
    engine_budget: int
    """Engine: max tokens per rank (rounds of the world-1 plan)."""
    engine_steps: int
    """Engine: steps (the first is not timed)."""
    cpu_threads: int
    """Threads of the CPU reference engine run."""


FULL = DeviceShapes(
    pack=(3001, 1024, 517), ring=3, heads=8, kv_heads=2, head_dim=128,
    speed_tokens=(4096, 8192, 16384, 32768), attn_heads=32, attn_kv_heads=8, attn_head_dim=128,
    reference_max_tokens=4096, repeats=3,
    cost_layouts=((8192,), (256, 7392, 544), (4096, 4096), (3104, 3200, 1600, 160, 128)),
    cost_singles=(2048, 4096, 16384), cost_rings=(2, 4, 8),
    logprobs_tokens=16384, logprobs_vocab=151_936,
    engine_layers=4, engine_hidden=256, engine_heads=4, engine_vocab=2048,
    engine_lengths=(1024, 512, 256, 128, 64), engine_budget=1024, engine_steps=6, cpu_threads=8,
)
"""Shapes of a run on one GPU (the speed and cost rows use Llama-3-8B's attention, as `h100-nvlink`'s source)."""

DRY = DeviceShapes(
    pack=(37, 64, 23), ring=3, heads=4, kv_heads=2, head_dim=16,
    speed_tokens=(64, 128), attn_heads=2, attn_kv_heads=1, attn_head_dim=64,
    reference_max_tokens=128, repeats=3,
    cost_layouts=((1024,), (2048,), (1536, 512)), cost_singles=(512, 3072), cost_rings=(2, 4),
    logprobs_tokens=256, logprobs_vocab=1024,
    engine_layers=2, engine_hidden=64, engine_heads=4, engine_vocab=128,
    engine_lengths=(120, 60, 30, 20), engine_budget=128, engine_steps=8, cpu_threads=1,
)
"""Shapes of ``--dry-run`` on CPU (seconds)."""


class _Skip(Exception):
    """A row cannot run here; the message says why."""


@dataclass
class _Ctx:
    device: torch.device
    dry: bool
    shapes: DeviceShapes
    out_dir: Path
    deadline: float
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def accelerator(self) -> bool:
        return self.device.type != "cpu"


# ------------------------------------------------------------------------------------------ helpers


def _timed(device: torch.device, fn: Callable[[], Any], repeats: int) -> float:
    """Best seconds of ``fn()`` over ``repeats`` runs after one warm-up, from device events (the best: least
    disturbed by other work on the machine)."""
    fn()
    _device.synchronize(device)
    times = []
    for _ in range(max(1, repeats)):
        start, end = _device.new_event(device, enable_timing=True), _device.new_event(device, enable_timing=True)
        start.record()
        fn()
        end.record()
        _device.synchronize(device)
        times.append(start.elapsed_time(end) / 1e3)
    return float(min(times))


def _cu(lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32, device=device)  # [S+1]


def _kernels(ctx: _Ctx) -> list[tuple[str, AttentionKernel | None, str | None]]:
    """(name, kernel or None, why not) of every CUDA attention adapter: the fused ones present here.

    On ``--dry-run``: torch's fused-flash adapter through its CPU stand-in (`ReferenceFlashOps`).
    """
    from hdp.kernels import flash_attn as fa
    from hdp.kernels import torch_flash as tf

    if ctx.dry:
        fwd, bwd = tf.kernel_functions(tf.ReferenceFlashOps())
        return [("flash_attn", None, "runs on CUDA only (dry run on CPU)"),
                ("torch_flash", AttentionKernel(KernelName.TORCH_FLASH, fwd, bwd), None)]
    out: list[tuple[str, AttentionKernel | None, str | None]] = []
    for name in (KernelName.FLASH_ATTN, KernelName.TORCH_FLASH):
        if not _device.is_cuda(ctx.device):
            out.append((name.value, None, f"a CUDA adapter; this device is {ctx.device.type}"))
            continue
        try:
            out.append((name.value, get_kernel(ctx.device, name), None))
        except ValueError as exc:
            out.append((name.value, None, str(exc)))
    return out


def _generator(device: torch.device, seed: int) -> torch.Generator:
    """A seeded generator on ``device`` (inputs are drawn where they are used: 10 GB of logits drawn on the host
    would take longer than the row)."""
    return torch.Generator(device=device).manual_seed(seed)


def _randn(shape: Sequence[int], gen: torch.Generator, device: torch.device) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=gen, dtype=torch.float32, device=device)


# -------------------------------------------------------------------------------- ring kernel calls


@dataclass(frozen=True)
class RingCall:
    """One local-kernel call of a zigzag ring (what `hdp.cp.ring.ring_forward` computes at one step)."""

    position: int
    """Ring position j making the call."""
    step: int
    """Ring step s."""
    case: str
    """`hdp.cp.metadata.StepCase` value."""
    q_rows: torch.Tensor
    """[Tq] int64: pack indices of the call's queries (in the call's order)."""
    k_rows: torch.Tensor
    """[Tk] int64: pack indices of the call's keys."""
    cu_q: torch.Tensor
    """[S+1] int32 query boundaries of the call."""
    cu_k: torch.Tensor
    """[S+1] int32 key boundaries of the call."""
    causal: bool
    """Whether the call is causal (the local step only)."""
    local_rows: torch.Tensor | None
    """[Tq] int64: the queries' rows in position j's local layout (``None``: all of them, in order)."""


def _pack_index(lengths: Sequence[int], k: int, j: int) -> torch.Tensor:
    """[T_j] int64: the pack index of each token ring position j holds (its zigzag chunks, in local order)."""
    from hdp.cp.metadata import positions, rank_layout

    lay = rank_layout(lengths, k, j)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)  # [S]
    seq = np.repeat(np.arange(len(lengths)), np.diff(lay.cu_seqlens.numpy()))  # [T_j] sample of each token
    return torch.from_numpy(starts[seq]) + positions(lengths, k, j)


def ring_calls(lengths: Sequence[int], k: int) -> list[RingCall]:
    """Every local-kernel call of a zigzag ring of ``k`` over one pack, as `hdp.cp.ring` makes them.

    From the ring's metadata (`hdp.cp.metadata.rank_layout`, `ring_schedule`): step 0 is the causal local
    block, a source i < j gives its front chunks to all local queries, a source i > j all its tokens to
    the local back chunks.
    """
    from hdp.cp.metadata import StepCase, group_layouts, ring_schedule

    layouts = group_layouts(lengths, k)
    index = [_pack_index(lengths, k, j) for j in range(k)]
    calls = []
    for j, lay in enumerate(layouts):
        for st in ring_schedule(k, j):
            src = layouts[st.source]
            if st.case is StepCase.LOCAL_CAUSAL:
                args = (index[j], index[j], lay.cu_seqlens, lay.cu_seqlens, True, None)
            elif st.case is StepCase.FRONT_KEYS:
                args = (index[j], index[st.source][src.front_index], lay.cu_seqlens, src.cu_front, False, None)
            else:
                args = (index[j][lay.back_index], index[st.source], lay.cu_back, src.cu_seqlens, False, lay.back_index)
            calls.append(RingCall(j, st.step, st.case.value, *args))
    return calls


# --------------------------------------------------------------------------------- kernel exactness


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (want in fp64)."""
    scale = float(want.abs().max()) if want.numel() else 0.0
    err = float((got.double() - want).abs().max()) if want.numel() else 0.0
    return err / scale if scale > 0 else err


def _lse_err(got: torch.Tensor, want: torch.Tensor) -> tuple[float, int]:
    """(max abs error over the finite entries, entries where one side is -inf and the other not)."""
    fin = torch.isfinite(want)
    mismatch = int((torch.isneginf(got) != torch.isneginf(want)).sum())
    err = float((got.double()[fin] - want[fin]).abs().max()) if fin.any() else 0.0
    return err, mismatch


def _exactness_one(kernel: AttentionKernel, dtype: torch.dtype, ctx: _Ctx) -> dict[str, Any]:
    """One kernel, one dtype: per-call and ring-assembled errors against fp64 (see the module docstring)."""
    from hdp.cp.ring import merge_lse_

    sh, dev = ctx.shapes, ctx.device
    lengths, k = sh.pack, sh.ring
    t = sum(lengths)
    scale = 1.0 / math.sqrt(sh.head_dim)
    gen = _generator(dev, 33)
    q, kk, v, do = (_randn((t, h, sh.head_dim), gen, dev).to(dtype)
                    for h in (sh.heads, sh.kv_heads, sh.kv_heads, sh.heads))
    q64, k64, v64, do64 = (x.double() for x in (q, kk, v, do))  # the same rounded inputs in fp64
    cu = _cu(lengths, dev)
    out64, lse64 = reference.attn_fwd(q64, k64, v64, cu, cu, True, scale)  # [T, Hq, D], [Hq, T]
    dq64, dk64, dv64 = reference.attn_bwd(do64, q64, k64, v64, out64, lse64, cu, cu, True, scale)
    index = {j: _pack_index(lengths, k, j).to(dev) for j in range(k)}  # [T_j] pack index of position j's tokens
    worst = {"out": 0.0, "lse": 0.0, "dq": 0.0, "dk": 0.0, "dv": 0.0}
    lse_mismatch = 0
    merged: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    dq = torch.zeros_like(q64)
    dk = torch.zeros_like(k64)
    dv = torch.zeros_like(v64)
    calls = ring_calls(lengths, k)
    for c in calls:
        qr, kr = c.q_rows.to(dev), c.k_rows.to(dev)
        cq, ck = c.cu_q.to(dev), c.cu_k.to(dev)
        o, l = kernel.fwd(q[qr], kk[kr], v[kr], cq, ck, c.causal, scale)
        o64, l64 = reference.attn_fwd(q64[qr], k64[kr], v64[kr], cq, ck, c.causal, scale)
        worst["out"] = max(worst["out"], _rel(o, o64))
        e, mm = _lse_err(l, l64)
        worst["lse"], lse_mismatch = max(worst["lse"], e), lse_mismatch + mm
        # the ring's own merge of this call's partial result (hdp.cp.ring.merge_lse_)
        n_local = len(index[c.position])
        if c.position not in merged:
            merged[c.position] = (torch.zeros((n_local, sh.heads, sh.head_dim), dtype=torch.float32, device=dev),
                                  torch.full((sh.heads, n_local), -math.inf, dtype=torch.float32, device=dev))
        mo, ml = merged[c.position]
        if c.case == "local_causal":
            mo.copy_(o)
            ml.copy_(l)
        else:
            merge_lse_(mo, ml, o, l, rows=None if c.local_rows is None else c.local_rows.to(dev))
        # backward from the merged (full-attention) out / lse of the call's rows, as the ring passes them
        g = kernel.bwd(do[qr], q[qr], kk[kr], v[kr], out64[qr].to(dtype), lse64[:, qr].float(), cq, ck, c.causal, scale)
        want = reference.attn_bwd(do64[qr], q64[qr], k64[kr], v64[kr], out64[qr], lse64[:, qr], cq, ck, c.causal, scale)
        for name, a, b in zip(("dq", "dk", "dv"), g, want):
            worst[name] = max(worst[name], _rel(a, b))
        dq.index_add_(0, qr, g[0].double())
        dk.index_add_(0, kr, g[1].double())
        dv.index_add_(0, kr, g[2].double())
    ring_out = max(_rel(mo, out64[index[j]]) for j, (mo, _) in merged.items())
    ring_lse = max(_lse_err(ml, lse64[:, index[j]])[0] for j, (_, ml) in merged.items())
    assembled = {"dq": _rel(dq, dq64), "dk": _rel(dk, dk64), "dv": _rel(dv, dv64)}
    tol = TOLERANCES[str(dtype).replace("torch.", "")]
    checks = {
        "call_out": (worst["out"], tol["out"]), "call_lse": (worst["lse"], tol["lse"]),
        "call_dq": (worst["dq"], tol["grad"]), "call_dk": (worst["dk"], tol["grad"]),
        "call_dv": (worst["dv"], tol["grad"]),
        "ring_out": (ring_out, tol["out"]), "ring_lse": (ring_lse, tol["lse"]),
        "ring_dq": (assembled["dq"], tol["grad"]), "ring_dk": (assembled["dk"], tol["grad"]),
        "ring_dv": (assembled["dv"], tol["grad"]),
    }
    failed = [n for n, (err, lim) in checks.items() if not err <= lim] + (["lse_-inf_rows"] if lse_mismatch else [])
    return {"ok": not failed, "failed": failed, "calls": len(calls), "lse_inf_mismatch": lse_mismatch,
            "errors": {n: err for n, (err, _) in checks.items()}, "tolerances": tol}


def _row_kernel_exactness(ctx: _Ctx) -> dict[str, Any]:
    kernels = _kernels(ctx)
    results: dict[str, Any] = {}
    tested = 0
    for name, kern, why in kernels:
        if kern is None:
            results[name] = {"status": f"skipped: {why}"}
            continue
        tested += 1
        results[name] = {dt: _exactness_one(kern, getattr(torch, dt), ctx) for dt in TOLERANCES}
    if not tested:
        raise _Skip("no CUDA attention adapter can run here: " + "; ".join(f"{n}: {w}" for n, _, w in kernels))
    ok = all(r[dt]["ok"] for r in results.values() if "status" not in r for dt in TOLERANCES)
    sh = ctx.shapes
    worst = {n: max(r[dt]["errors"][n] for r in results.values() if "status" not in r for dt in TOLERANCES)
             for n in ("ring_out", "ring_dq")}
    return {"status": "ok" if ok else "fail",
            "figures": {"pack": list(sh.pack), "ring": sh.ring, "heads": sh.heads, "kv_heads": sh.kv_heads,
                        "head_dim": sh.head_dim, "kernels": results},
            "summary": f"{tested} adapter(s) x bf16/fp16, ring {sh.ring} over {list(sh.pack)}: worst ring out "
                       f"{worst['ring_out']:.1e}, dq {worst['ring_dq']:.1e} (rel)"}


# ------------------------------------------------------------------------------------- kernel speed


def _row_kernel_speed(ctx: _Ctx) -> dict[str, Any]:
    import torch.nn.functional as F

    sh, dev = ctx.shapes, ctx.device
    kernels = [(n, k) for n, k, _ in _kernels(ctx) if k is not None]
    if not kernels:
        raise _Skip("no CUDA attention adapter can run here")
    kernels.append(("reference", get_kernel(dev, KernelName.REFERENCE)))  # the pure-torch kernel
    hq, hkv, d = sh.attn_heads, sh.attn_kv_heads, sh.attn_head_dim
    scale = 1.0 / math.sqrt(d)
    dtype = torch.bfloat16
    gen = _generator(dev, 7)
    rows = []
    sdpa_ctx = _sdpa_backends(dev)
    for t in sh.speed_tokens:
        if time.monotonic() > ctx.deadline:
            ctx.notes.append(f"kernel_speed: stopped before {t} tokens (time budget)")
            break
        q, k, v, do = (_randn((t, h, d), gen, dev).to(dtype) for h in (hq, hkv, hkv, hq))
        cu = _cu([t], dev)
        row: dict[str, Any] = {"tokens": t}
        for name, kern in kernels:
            if name == "reference" and t > sh.reference_max_tokens:
                continue
            leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]

            def step(kern: AttentionKernel = kern, leaves: list[torch.Tensor] = leaves) -> None:
                out, _ = kernel_attention(*leaves, cu, cu, True, scale, kern)
                torch.autograd.grad(out, leaves, do)

            row[f"{name}_s"] = _timed(dev, step, sh.repeats)
        # SDPA on the same sample: [1, Hq, T, D], K/V expanded to Hq heads beforehand (not timed)
        qs = q.transpose(0, 1)[None].detach().requires_grad_(True)
        ks = k.repeat_interleave(hq // hkv, dim=1).transpose(0, 1)[None].detach().requires_grad_(True)
        vs = v.repeat_interleave(hq // hkv, dim=1).transpose(0, 1)[None].detach().requires_grad_(True)
        dos = do.transpose(0, 1)[None]

        def sdpa_step() -> None:
            with sdpa_ctx():
                out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
            torch.autograd.grad(out, (qs, ks, vs), dos)

        try:
            row["sdpa_s"] = _timed(dev, sdpa_step, sh.repeats)
        except RuntimeError as exc:  # no fused SDPA backend for this shape: say so, time nothing
            row["sdpa_s"] = None
            row["sdpa_error"] = str(exc).splitlines()[0]
        for name, _ in kernels:
            if f"{name}_s" in row:
                row[f"{name}_tokens_per_s"] = t / row[f"{name}_s"]
                if row.get("sdpa_s"):
                    row[f"{name}_speed_over_sdpa"] = row["sdpa_s"] / row[f"{name}_s"]
        rows.append(row)
        del q, k, v, do, qs, ks, vs, dos
        _device.empty_cache(dev)
    best = kernels[0][0]
    ratios = [r.get(f"{best}_speed_over_sdpa") for r in rows if r.get(f"{best}_speed_over_sdpa")]
    summary = (f"{best} / SDPA speed {min(ratios):.2f}-{max(ratios):.2f}x over {[r['tokens'] for r in rows]} tokens"
               if ratios else "no SDPA figure")
    if ctx.dry:
        summary += " (CPU stand-in: not a speed figure)"
    return {"status": "ok", "summary": summary,
            "figures": {"dtype": "bfloat16", "heads": hq, "kv_heads": hkv, "head_dim": d, "causal": True,
                        "sdpa_kv": "expanded to Hq heads beforehand", "repeats": sh.repeats, "lengths": rows}}


def _sdpa_backends(device: torch.device) -> Callable[[], Any]:
    """SDPA's fused backends only on an accelerator (the math backend would materialise T x T scores)."""
    import contextlib

    if device.type == "cpu":
        return contextlib.nullcontext
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fused = [b for b in (getattr(SDPBackend, n, None) for n in ("FLASH_ATTENTION", "CUDNN_ATTENTION",
                                                                 "EFFICIENT_ATTENTION")) if b is not None]
    return lambda: sdpa_kernel(fused)


# ---------------------------------------------------------------------------------------- cost terms


def _replay_position(q: Sequence[torch.Tensor], kv: Sequence[torch.Tensor], do: Sequence[torch.Tensor],
                     arrived: Sequence[torch.Tensor], layouts: Sequence[Any], j: int, kernel: AttentionKernel,
                     scale: float) -> None:
    """Forward and backward compute of ring position ``j`` on this one device, with every source's K/V
    already here: the kernel calls, log-sum-exp merges and dQ/dK/dV accumulations of
    `hdp.cp.ring.ring_forward` / `ring_backward`, without their transfers.  ``q[i]`` [T_i, Hq, D],
    ``kv[i]`` [2, T_i, Hkv, D], ``do[i]`` [T_i, Hq, D] of every position i; ``arrived[i]`` [2, T_i, Hkv, D]
    float32 stands for source i's dK/dV accumulator that the ring receives from the previous position
    (its values do not matter for the time)."""
    from hdp.cp.metadata import StepCase, ring_schedule
    from hdp.cp.ring import merge_lse_

    lay, dev = layouts[j], q[j].device
    qj = q[j]
    back = lay.back_index.to(dev)
    out = torch.zeros(qj.shape, dtype=torch.float32, device=dev)  # [T_j, Hq, D]
    lse = torch.full((qj.shape[1], qj.shape[0]), -math.inf, dtype=torch.float32, device=dev)  # [Hq, T_j]
    q_back = qj.index_select(0, back)  # [T_back, Hq, D]
    steps = ring_schedule(len(layouts), j)
    for st in steps:
        src, kvi = layouts[st.source], kv[st.source]
        if st.case is StepCase.LOCAL_CAUSAL:
            o, l = kernel.fwd(qj, kvi[0], kvi[1], lay.cu_seqlens, lay.cu_seqlens, True, scale)
            out.copy_(o)
            lse.copy_(l)
        elif st.case is StepCase.FRONT_KEYS:
            kf = kvi.index_select(1, src.front_index.to(dev))  # [2, T_front, Hkv, D]
            o, l = kernel.fwd(qj, kf[0], kf[1], lay.cu_seqlens, src.cu_front, False, scale)
            merge_lse_(out, lse, o, l)
        else:
            o, l = kernel.fwd(q_back, kvi[0], kvi[1], lay.cu_back, src.cu_seqlens, False, scale)
            merge_lse_(out, lse, o, l, rows=back)
    out = out.to(qj.dtype)
    dq = torch.zeros(qj.shape, dtype=torch.float32, device=dev)  # [T_j, Hq, D]
    out_back, do_back, lse_back = out.index_select(0, back), do[j].index_select(0, back), lse.index_select(1, back)
    for st in steps:
        src, kvi = layouts[st.source], kv[st.source]
        if st.case is StepCase.LOCAL_CAUSAL:
            dq_i, dk_i, dv_i = kernel.bwd(do[j], qj, kvi[0], kvi[1], out, lse, lay.cu_seqlens, lay.cu_seqlens, True,
                                          scale)
            dq += dq_i
            dkv = torch.stack([dk_i, dv_i]).float()  # [2, T_src, Hkv, D]
        elif st.case is StepCase.FRONT_KEYS:
            fidx = src.front_index.to(dev)
            kf = kvi.index_select(1, fidx)  # [2, T_front, Hkv, D]
            dq_i, dk_i, dv_i = kernel.bwd(do[j], qj, kf[0], kf[1], out, lse, lay.cu_seqlens, src.cu_front, False, scale)
            dq += dq_i
            dkv = torch.zeros((2,) + tuple(kvi.shape[1:]), dtype=torch.float32, device=dev)  # [2, T_src, Hkv, D]
            dkv.index_copy_(1, fidx, torch.stack([dk_i, dv_i]).float())
        else:
            dq_i, dk_i, dv_i = kernel.bwd(do_back, q_back, kvi[0], kvi[1], out_back, lse_back, lay.cu_back,
                                          src.cu_seqlens, False, scale)
            dq.index_add_(0, back, dq_i.float())
            dkv = torch.stack([dk_i, dv_i]).float()  # [2, T_src, Hkv, D]
        if st.step > 0:
            dkv += arrived[st.source]  # the accumulator that arrives from the previous position
    _ = dq.to(qj.dtype)


def _cost_records(ctx: _Ctx, kernel: AttentionKernel) -> list[dict[str, Any]]:
    """Group records: one-rank packs (``group_size`` 1) and rings of k replayed position by position
    (``seconds``: the slowest position, forward + backward)."""
    from hdp.cp.metadata import group_layouts

    sh, dev = ctx.shapes, ctx.device
    hq, hkv, d = sh.attn_heads, sh.attn_kv_heads, sh.attn_head_dim
    scale = 1.0 / math.sqrt(d)
    gen = _generator(dev, 11)
    cases = [(tuple(l), 1) for l in sh.cost_layouts] + [((n,), 1) for n in sh.cost_singles]
    cases += [(tuple(k * x for x in l), k) for k in sh.cost_rings for l in sh.cost_layouts]
    records = []
    for lengths, k in cases:
        if time.monotonic() > ctx.deadline:
            ctx.notes.append(f"cost_terms: stopped before group size {k} of {list(lengths)} (time budget)")
            break
        layouts = group_layouts(lengths, k)
        qs = [_randn((lay.num_tokens, hq, d), gen, dev).bfloat16() for lay in layouts]
        kvs = [_randn((2, lay.num_tokens, hkv, d), gen, dev).bfloat16() for lay in layouts]
        dos = [_randn((lay.num_tokens, hq, d), gen, dev).bfloat16() for lay in layouts]
        arrived = [torch.zeros((2, lay.num_tokens, hkv, d), dtype=torch.float32, device=dev) for lay in layouts]
        worst = max(_timed(dev, lambda j=j: _replay_position(qs, kvs, dos, arrived, layouts, j, kernel, scale),
                           sh.repeats) for j in range(k))
        records.append({"kind": "group", "lengths": list(lengths), "group_size": k, "seconds": worst})
        del qs, kvs, dos, arrived
    return records


_LINK = ("step_latency", "comm_per_token")


def _row_cost_terms(ctx: _Ctx) -> dict[str, Any]:
    from hdp.packing.calibrate import calibrate
    from hdp.packing.cost_file import load_cost_model, save_cost_model
    from hdp.packing.profiles import PROFILES, ModelPreset, cost_model

    kernels = [k for _, k, _ in _kernels(ctx) if k is not None]
    if not kernels:
        raise _Skip("no fused attention kernel here to time the ring's compute with")
    kernel = kernels[0]  # what get_kernel picks here: flash-attn when importable, else torch's fused kernel
    sh = ctx.shapes
    attn_dim = sh.attn_heads * sh.attn_head_dim
    preset = ModelPreset(name="attention-layer", linear_coef=0.0, n_layers=1, attn_dim=attn_dim,
                         kv_elems=2 * sh.attn_kv_heads * sh.attn_head_dim, dtype_bytes=2,
                         source="one attention layer (no projections): the shape the speed row times")
    profile = "h100-nvlink"
    base = cost_model(preset, profile)
    records = _cost_records(ctx, kernel)
    if len({r["group_size"] for r in records if r["group_size"] > 1}) < 2:
        raise _Skip(f"the time budget left {len(records)} records; the ring terms need two ring sizes")
    rec_path = ctx.out_dir / "device_records.jsonl"
    rec_path.write_text("".join(json.dumps(r) + "\n" for r in records))
    try:
        fit = calibrate(records, base=base)
    except ValueError as exc:  # records a busy machine made, that no cost model explains: a result, said so
        return {"status": "fail", "reason": str(exc), "summary": f"the {len(records)} records do not fit",
                "figures": {"kernel": kernel.name.value, "records_file": str(rec_path), "records": records}}
    # the replay moved no K/V: its link terms describe no link, so the file keeps the profile's (in seconds)
    u = fit.cost.unit_time_s
    cost = dataclasses.replace(fit.cost, **{n: getattr(base, n) * base.unit_time_s / u for n in _LINK})
    meta = fit.metadata(f"{preset.name}@{profile}")
    meta["fitted"] = [n for n in meta["fitted"] if n not in _LINK]
    meta["from_base"] = sorted(set(meta["from_base"]) | set(_LINK))
    meta["fit"]["reasons"].update({n: "not measured: one device has no ring link (replayed compute only)"
                                   for n in _LINK})
    path = save_cost_model(cost, ctx.out_dir / "device_cost.json", metadata=meta)
    loaded = load_cost_model(path)
    assert loaded == cost, "the cost-model file does not read back as written"
    hw = PROFILES[profile]
    fitted = set(meta["fitted"]) | {"unit_time_s"}
    # the profile's own quantities from the fitted ones (`hdp.packing.profiles.cost_model` inverted for one
    # layer); None where the records did not determine the parameter (the file keeps the profile's value)
    device_fig = {
        "attn_tflops": 6.0 * attn_dim / u / 1e12,
        "ring_merge_ps_per_elem": cost.merge_per_token * u / attn_dim * 1e12 if "merge_per_token" in fitted else None,
        "cp_split_ps_per_elem": cost.cp_per_token * u / attn_dim * 1e12 if "cp_per_token" in fitted else None,
        "step_overhead_us": cost.step_overhead * u / 2.0 * 1e6 if "step_overhead" in fitted else None,  # per pass
        "linear_s_per_token": cost.linear_coef * u if "linear_coef" in fitted else None,
    }
    preset_fig = {"attn_tflops": hw.attn_tflops, "ring_merge_ps_per_elem": hw.ring_merge_ps_per_elem,
                  "cp_split_ps_per_elem": hw.cp_split_ps_per_elem, "step_overhead_us": hw.step_overhead_us,
                  "linear_s_per_token": 0.0}
    merge = device_fig["ring_merge_ps_per_elem"]
    summary = (f"{device_fig['attn_tflops']:.3g} TFLOP/s attention ({profile}: {hw.attn_tflops:.3g}), merge "
               + (f"{merge:.3g} ps/elem" if merge is not None else "not determined")
               + f" ({hw.ring_merge_ps_per_elem:.3g}); "
               f"R2 {fit.r2:.3f} over {len(records)} records -> {path.name}")
    return {"status": "ok", "summary": summary,
            "figures": {"kernel": kernel.name.value, "records": len(records), "cost_model_file": str(path),
                        "records_file": str(rec_path), "base": f"{preset.name}@{profile}",
                        "fitted": meta["fitted"], "from_base": meta["from_base"], "reasons": meta["fit"]["reasons"],
                        "r2": fit.r2, "median_rel_err": fit.median_rel_err, "max_rel_err": fit.max_rel_err,
                        "warnings": list(fit.warnings), "parameters": dataclasses.asdict(cost),
                        "device": device_fig, "preset": preset_fig}}


# ------------------------------------------------------------------------------------------ log-probs


def _logprobs_worker(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """One-rank job: hdp's chunked log-probs against the naive fp32 path, forward + backward."""
    import torch.distributed as dist

    from hdp.logprobs import logprobs_entropy

    dev = _device.select_device(spec["device"])
    t, vocab = spec["tokens"], spec["vocab"]
    gen = _generator(dev, 5)
    logits = (2.0 * torch.randn((t, vocab), generator=gen, device=dev)).to(torch.bfloat16)  # [T, V] bf16
    targets = torch.randint(0, vocab, (t,), generator=gen, device=dev)  # [T]
    weights = torch.randn((t,), generator=gen, device=dev)  # [T]
    group = dist.group.WORLD

    def hdp_path() -> tuple[torch.Tensor, torch.Tensor]:
        x = logits.detach().requires_grad_(True)
        lp, _ = logprobs_entropy(x, targets, group)
        (lp * weights).sum().backward()
        return lp.detach(), x.grad

    def naive_path() -> tuple[torch.Tensor, torch.Tensor]:
        x = logits.detach().requires_grad_(True)
        lp = torch.log_softmax(x.float(), dim=-1).gather(1, targets[:, None])[:, 0]  # [T]
        (lp * weights).sum().backward()
        return lp.detach(), x.grad

    out: dict[str, Any] = {"tokens": t, "vocab": vocab, "logits_bytes": logits.numel() * logits.element_size()}
    values = {}
    for name, fn in (("hdp", hdp_path), ("naive_fp32", naive_path)):
        values[name] = fn()  # warm-up, and the values compared below
        _device.synchronize(dev)
        _device.empty_cache(dev)
        _device.reset_peak_memory(dev)
        before = _device.memory_stats(dev)["allocated_bytes"]
        out[f"{name}_s"] = _timed(dev, fn, spec["repeats"])
        stats = _device.memory_stats(dev)
        out[f"{name}_peak_over_logits_bytes"] = stats["peak_bytes"] - before if dev.type != "cpu" else None
    out["max_abs_logprob_diff"] = float((values["hdp"][0] - values["naive_fp32"][0]).abs().max())
    out["max_abs_grad_diff"] = float((values["hdp"][1].float() - values["naive_fp32"][1].float()).abs().max())
    out["speed_over_naive"] = out["naive_fp32_s"] / out["hdp_s"]
    if dev.type != "cpu":
        out["peak_ratio_naive_over_hdp"] = out["naive_fp32_peak_over_logits_bytes"] / max(
            1, out["hdp_peak_over_logits_bytes"])
    return out


def _row_logprobs(ctx: _Ctx) -> dict[str, Any]:
    from hdp.trainer.launch import spawn

    sh = ctx.shapes
    spec = {"device": str(ctx.device), "tokens": sh.logprobs_tokens, "vocab": sh.logprobs_vocab, "repeats": sh.repeats}
    res = spawn(_logprobs_worker, 1, spec, backend=_device.backend_for(ctx.device), threads=sh.cpu_threads,
                timeout=max(60.0, ctx.deadline - time.monotonic()))[0]
    ok = res["max_abs_logprob_diff"] <= 1e-3
    mem = (f", peak over logits {res['hdp_peak_over_logits_bytes'] / 2**30:.2f} vs "
           f"{res['naive_fp32_peak_over_logits_bytes'] / 2**30:.2f} GiB" if ctx.accelerator else ", memory: CPU has no "
           "allocator peak")
    summary = (f"T={res['tokens']} V={res['vocab']}: {res['hdp_s'] * 1e3:.1f} vs {res['naive_fp32_s'] * 1e3:.1f} ms"
               f"{mem}; |dlogp| {res['max_abs_logprob_diff']:.1e}")
    return {"status": "ok" if ok else "fail", "summary": summary, "figures": {**res, "logprob_tolerance": 1e-3}}


# -------------------------------------------------------------------------------------------- engine


def _engine_batches(spec: dict[str, Any]) -> list[Any]:
    """Every step's batch: the same samples, each a random motif of 16 tokens repeated, so that the loss
    falls fast (the model fits the batch, its attention learning to copy) and the two runs' losses can
    part if either computes something else."""
    from hdp.trainer.engine import Batch

    gen = torch.Generator().manual_seed(21)
    tokens = []
    for n in spec["lengths"]:
        motif = torch.randint(0, spec["vocab"], (16,), generator=gen)
        tokens.append(motif.repeat(-(-n // 16))[:n])
    return [Batch(tokens=list(tokens)) for _ in range(spec["steps"])]


def _engine_worker(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """One-rank job: `HdpEngine.build` on ``spec["device"]``, a few steps, their losses, memory and times."""
    import torch.distributed as dist

    from hdp.trainer.bench.train import _init_param
    from hdp.trainer.config import EngineConfig, ParallelConfig, PlanningConfig
    from hdp.trainer.engine import HdpEngine, nll_loss
    from hdp.trainer.model import ModelConfig, OptimConfig

    cfg = EngineConfig(
        model=ModelConfig(num_layers=spec["layers"], hidden_size=spec["hidden"], num_attention_heads=spec["heads"],
                          vocab_size=spec["vocab"], max_sequence_length=max(4096, max(spec["lengths"])),
                          params_dtype=spec["dtype"]),
        optim=OptimConfig(lr=spec["lr"]),
        planning=PlanningConfig(max_tokens_per_rank=spec["budget"]),
        parallel=ParallelConfig(tp=1, pp=1),
        device=spec["device"],
    )
    engine = HdpEngine.build(cfg, dist.group.WORLD, init_fn=_init_param)
    dev = engine.device
    steps = []
    try:
        for batch in _engine_batches(spec):
            _device.synchronize(dev)
            t0 = time.perf_counter()
            m = engine.train_step(batch, nll_loss)
            _device.synchronize(dev)
            steps.append({"loss": float(m["loss"]), "wall_s": time.perf_counter() - t0,
                          "step_time_s": float(m["perf/step_time"]), "rounds": float(m.get("hdp/rounds", 0)),
                          "memory_predicted_gb": m.get("hdp/memory_predicted_gb"),
                          "memory_peak_gb": m.get("hdp/memory_peak_gb")})
        kernel = get_kernel(dev).name.value
        peak = _device.memory_stats(dev)["peak_bytes"] if dev.type != "cpu" else None
    finally:
        engine.close()
    return {"device": str(dev), "dtype": spec["dtype"], "kernel": kernel, "steps": steps,
            "allocator_peak_bytes": peak}


def _engine_spec(ctx: _Ctx, device: str, dtype: str) -> dict[str, Any]:
    sh = ctx.shapes
    return {"device": device, "dtype": dtype, "layers": sh.engine_layers, "hidden": sh.engine_hidden,
            "heads": sh.engine_heads, "vocab": sh.engine_vocab, "lengths": list(sh.engine_lengths),
            "budget": sh.engine_budget, "steps": sh.engine_steps, "lr": 3e-3}


def _row_engine_pp1(ctx: _Ctx) -> dict[str, Any]:
    from hdp.trainer.launch import spawn

    import importlib.util

    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        raise _Skip("megatron-core is not installed here; carry its wheel (tools/device_wheels.py)")
    left = lambda: max(60.0, ctx.deadline - time.monotonic())  # noqa: E731
    dev = str(ctx.device)
    run = spawn(_engine_worker, 1, _engine_spec(ctx, dev, "bfloat16"), backend=_device.backend_for(ctx.device),
                threads=ctx.shapes.cpu_threads, timeout=left())[0]
    ref = spawn(_engine_worker, 1, _engine_spec(ctx, "cpu", "float32"), backend="gloo",
                threads=ctx.shapes.cpu_threads, timeout=left())[0]
    losses = [s["loss"] for s in run["steps"]]
    ref_losses = [s["loss"] for s in ref["steps"]]
    rel = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses)]
    timed = run["steps"][1:] or run["steps"]
    pred = [s["memory_predicted_gb"] for s in run["steps"] if s["memory_predicted_gb"]]
    meas = [s["memory_peak_gb"] for s in run["steps"] if s["memory_peak_gb"]]
    ratio = max(m / p for m, p in zip(meas, pred)) if pred and meas else None
    drop = (ref_losses[0] - ref_losses[-1]) / ref_losses[0]
    ok = max(rel) <= ENGINE_LOSS_RTOL and drop >= ENGINE_MIN_DROP
    summary = (f"{len(losses)} steps bf16 on {run['device']} ({run['kernel']}) vs fp32 CPU: loss "
               f"{ref_losses[0]:.2f} -> {ref_losses[-1]:.2f}, rel diff {max(rel):.1e} (tol {ENGINE_LOSS_RTOL:g}); step "
               f"{statistics.median(s['wall_s'] for s in timed) * 1e3:.0f} ms"
               + (f"; measured/predicted peak {ratio:.2f}" if ratio is not None else ""))
    why = None if ok else (f"loss rel diff {max(rel):.3g} > {ENGINE_LOSS_RTOL:g}" if max(rel) > ENGINE_LOSS_RTOL else
                           f"the CPU run's loss fell by {drop:.0%} only (< {ENGINE_MIN_DROP:.0%}): uninformative")
    return {"status": "ok" if ok else "fail", "summary": summary, **({"reason": why} if why else {}),
            "figures": {"device_run": run, "cpu_fp32_run": ref, "loss_rel_diff": rel, "loss_rtol": ENGINE_LOSS_RTOL,
                        "loss_drop_fraction": drop, "min_drop": ENGINE_MIN_DROP,
                        "median_step_s": statistics.median(s["wall_s"] for s in timed),
                        "peak_measured_over_predicted": ratio}}


def _row_train_job(ctx: _Ctx) -> dict[str, Any]:
    """`hdp bench train` on this machine's devices: one rank per device (two gloo ranks for the dry run)."""
    import importlib.util

    from hdp.trainer.bench.train import TrainBenchSpec, bench_train

    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        raise _Skip("megatron-core is not installed here; carry its wheel (tools/device_wheels.py)")
    kind = ctx.device.type
    ranks = 2 if kind == "cpu" else max(1, min(8, getattr(torch, kind).device_count()))
    sh = ctx.shapes
    spec = TrainBenchSpec(ranks=ranks, device=kind, dtype="bfloat16", num_layers=sh.engine_layers,
                          hidden_size=sh.engine_hidden, num_attention_heads=sh.engine_heads, vocab_size=sh.engine_vocab,
                          max_tokens_per_rank=sh.engine_budget, samples=12 if ctx.dry else 40,
                          steps=3 if ctx.dry else 9)
    result = bench_train(spec)
    res = result["results"]
    pair = result["paired"]["hdp_vs_static-cp"]["wall"]
    ok = bool(result["loss_match"] and all(r["tokens_per_s"] > 0 and r["peak_memory_gb"] > 0 for r in res.values()))
    mfu = res["hdp"]["mfu"]
    summary = (f"{ranks} ranks on {kind}: hdp {res['hdp']['tokens_per_s']:.0f} tokens/s/device, static CP "
               f"{res['static-cp']['tokens_per_s']:.0f}; paired {pair['median']:.2f}x [{pair['ci95'][0]:.2f}, "
               f"{pair['ci95'][1]:.2f}]; MFU {'-' if mfu is None else f'{mfu:.1%}'}; peak "
               f"{res['hdp']['peak_memory_gb']:.3g} GB; losses equal: {result['loss_match']}")
    return {"status": "ok" if ok else "fail", "summary": summary,
            **({} if ok else {"reason": f"losses equal {result['loss_match']}; a policy measured no tokens/s or memory"}),
            "figures": {k: result[k] for k in ("results", "speedup", "paired", "loss_match", "loss_max_rel_diff",
                                              "plans_differ", "model", "environment")}}


def _row_engine_vpp(ctx: _Ctx) -> dict[str, Any]:
    from hdp.trainer.parallel import ParallelConfig

    try:
        ParallelConfig(tp=1, pp=1, virtual_pp=2)
    except ValueError as exc:
        raise _Skip(f"world size 1 cannot run virtual stages: {exc}; pp > 1 needs two ranks and one device "
                    "runs one (NCCL takes one rank per GPU)") from exc
    raise _Skip("world size 1 runs one pipeline stage")


_ROW_FNS: dict[str, Callable[[_Ctx], dict[str, Any]]] = {
    "kernel_exactness": _row_kernel_exactness, "kernel_speed": _row_kernel_speed, "cost_terms": _row_cost_terms,
    "logprobs": _row_logprobs, "engine_pp1": _row_engine_pp1, "train_job": _row_train_job,
    "engine_vpp": _row_engine_vpp,
}


# ---------------------------------------------------------------------------------------------- run


def _environment(device: torch.device) -> dict[str, Any]:
    from importlib import metadata

    from hdp.kernels import flash_attn as fa
    from hdp.kernels import torch_flash as tf

    def version(pkg: str) -> str | None:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    return {"python": platform.python_version(), "torch": torch.__version__, "device": str(device),
            "device_name": _device.device_name(device), "compute_capability": _device.compute_capability(device),
            "total_memory_bytes": _device.total_memory(device), "cpu_count": os.cpu_count(),
            "packages": {p: version(p) for p in ("hdp-engine", "megatron-core", "numba", "numpy", "einops", "psutil",
                                                 "flash-attn", "triton")},
            "kernel_selected": get_kernel(device).name.value,
            "flash_attn": "available" if fa.available() else "not importable",
            "torch_flash": tf.unavailable_reason(device) or "available",
            "torch_flash_lse_layout": tf.lse_layout()}


def bench_device(*, dry_run: bool = False, device: str | None = None, out_dir: str | os.PathLike[str] | None = None,
                 rows: Sequence[str] | None = None, budget_s: float = BUDGET_S,
                 on_row: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run the device check (module docstring) and return its JSON-ready result.

    ``dry_run``: every row on CPU with `DRY` shapes.  ``device``: as `hdp.device.select_device` (default the
    first accelerator).  ``out_dir``: where the cost-model file, the records and ``device.json`` (rewritten
    after every row, so a killed run keeps its finished rows) go; default a temporary folder.  ``rows``: a
    subset of `ROWS`.  ``budget_s``: rows that would start after it are skipped.  ``on_row``: called with
    each row's result as it finishes (the CLI's progress).
    """
    wanted = list(ROWS if rows is None else rows)
    unknown = [r for r in wanted if r not in ROWS]
    if unknown:
        raise ValueError(f"rows={unknown}: unknown; choose from {', '.join(ROWS)}")
    if budget_s <= 0:
        raise ValueError(f"budget_s={budget_s}: must be > 0 seconds")
    dev = torch.device("cpu") if dry_run else _device.select_device(device)
    out = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="hdp-device-"))
    if out.exists() and not out.is_dir():
        raise ValueError(f"out_dir={str(out)!r} is a file; pass a folder")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    ctx = _Ctx(device=dev, dry=dry_run, shapes=DRY if dry_run else FULL, out_dir=out, deadline=t0 + budget_s)
    result: dict[str, Any] = {
        "bench": "device", "dry_run": dry_run, "hardware": dev.type != "cpu" and not dry_run,
        "note": ("dry run on CPU with small shapes: not hardware figures" if dry_run else
                 "not run on hardware" if dev.type == "cpu" else f"measured on {_device.device_name(dev)}"),
        "environment": _environment(dev), "budget_s": budget_s, "rows": [],
        "shapes": dataclasses.asdict(ctx.shapes), "out_dir": str(out),
    }
    threads = torch.get_num_threads()
    if dry_run:  # one intra-op thread: a CPU shared with other work stalls a thread team's barriers
        torch.set_num_threads(1)
    try:
        for name in wanted:
            _run_row(name, ctx, result, t0, budget_s, on_row)
    finally:
        torch.set_num_threads(threads)
    return result


def _run_row(name: str, ctx: _Ctx, result: dict[str, Any], t0: float, budget_s: float,
             on_row: Callable[[dict[str, Any]], None] | None) -> None:
    """Run one row into ``result["rows"]`` and rewrite ``device.json``."""
    dev, dry_run, out = ctx.device, ctx.dry, ctx.out_dir
    r0 = time.monotonic()
    row: dict[str, Any] = {"row": name, "hardware": result["hardware"]}
    if not dry_run and dev.type == "cpu":
        row.update(status="skipped", reason="no accelerator here (hdp bench device measures a GPU; --dry-run "
                                            "runs every row on CPU)")
    elif time.monotonic() > ctx.deadline:
        row.update(status="skipped", reason=f"time budget of {budget_s:.0f} s spent")
    else:
        try:
            row.update(_ROW_FNS[name](ctx))
        except _Skip as exc:
            row.update(status="skipped", reason=str(exc))
        except Exception as exc:  # a row's failure is its result; the other rows still run
            logger.warning("bench device: row %s failed: %s", name, exc)
            row.update(status="error", reason=f"{type(exc).__name__}: {exc}",
                       traceback=traceback.format_exc(limit=8))
    _device.empty_cache(dev)  # the next row (or its spawned job) starts without this row's cached blocks
    row["seconds"] = time.monotonic() - r0
    result["rows"].append(row)
    result["wall_s"] = time.monotonic() - t0
    result["notes"] = list(ctx.notes)
    (out / "device.json").write_text(json.dumps(result, indent=1, default=_json_default) + "\n")
    if on_row is not None:
        on_row(row)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating,)):
        return float(obj)
    if isinstance(obj, (tuple, set)):
        return list(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def format_table(result: dict[str, Any]) -> str:
    """A short plain-text table of the rows (no rich: the device may lack it)."""
    lines = [f"hdp bench device: {result['note']} ({result['environment']['device_name']}, torch "
             f"{result['environment']['torch']}, {result.get('wall_s', 0.0):.1f} s)"]
    width = max(len(r) for r in ROWS)
    for row in result["rows"]:
        status = row["status"] if row["status"] in ("ok", "fail") else f"{row['status']}: {row.get('reason', '')}"
        text = row.get("summary", "") if row["status"] in ("ok", "fail") else ""
        if row["status"] == "fail" and row.get("reason"):
            text += f" ({row['reason']})"
        lines.append(f"  {row['row']:<{width}}  {status:<6}  {row['seconds']:6.1f} s  {text}".rstrip())
    for note in result.get("notes", []):
        lines.append(f"  note: {note}")
    lines.append(f"  files: {result['out_dir']}")
    return "\n".join(lines)
