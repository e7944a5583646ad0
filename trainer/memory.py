"""The engines' memory: the per-rank memory model of the job, what a step measured, and the records,
metrics and self-calibration built on them.

* **The model** (:func:`engine_memory_model`): `hdp.packing.memory.MemoryModel` of the engine's model
  shape on its layout (TP, PP, VPP, EP, expert TP, the domain, recompute mode, MoE zero-memory level,
  CP algorithm, dtypes).  The **limit** (:func:`resolve_memory_limit`): ``max_memory_gb`` bytes, or
  ``"auto"`` = the device's memory × `DEVICE_MEMORY_FRACTION` on an accelerator, none on CPU (a CPU
  has no device memory to plan to; plans then follow the token budget).
* **Measured** per round (:class:`~hdp.memory_meter.MemoryMeter`): on CUDA/NPU the allocator's peak
  while the round was the newest one in flight, and the bytes allocated when the step's rounds
  began as its static part; on CPU the meter's count (bytes autograd saved for backward + hdp's CP
  buffers) on top of the static bytes counted by :func:`static_bytes` (parameters, gradient buffers,
  optimizer state and master copies: every distinct storage the engine holds).
* **Calibrated** (:class:`MemoryCalibration`, driven by `hdp.trainer.planning.DomainPlanner`): every
  training step's per-round peaks travel with the round times in the planner's one all-gather; world
  rank 0 writes ``"kind": "memory"`` records (`hdp.packing.memory.fit_memory`'s schema) next to the
  timing records, and
  - **at once**, when planning to a limit: when a measured peak exceeds the prediction, the dynamic coefficients are scaled by
    the largest measured/predicted ratio of the step and `TIGHTEN_MARGIN` more (computed alike on
    every rank from the gathered table), so the next plans are tighter;
  - **every refit**: world rank 0 fits the window of records (`fit_memory`, ``cover=True``: no record
    in the window under-predicted) and the coefficients travel in the planner's decision broadcast.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from hdp import device as _device
from hdp.memory_meter import MemoryMeter
from hdp.packing import Plan
from hdp.packing.memory import (
    GB,
    MemoryBudget,
    MemoryCoefficients,
    MemoryLayout,
    MemoryModel,
    fit_memory,
    memory_features,
    rank_group_sizes,
    rerun_tokens,
    window_tokens,
)
from hdp.packing.model_shape import ModelShape
from hdp.trainer.optim_state import optimizers

__all__ = ["DEVICE_MEMORY_FRACTION", "AUTO", "engine_memory_model", "resolve_memory_limit", "check_max_memory_gb",
           "static_bytes", "MemoryCalibration", "COEF_NAMES", "check_static_fits",
           "start_measure", "measured_row"]

DEVICE_MEMORY_FRACTION = 0.9
"""Share of an accelerator's memory the ``auto`` limit plans to (the rest: the framework, the
communication libraries' buffers, fragmentation the fitted headroom does not see)."""

AUTO = "auto"
TIGHTEN_MARGIN = 0.02
"""When a measured peak exceeds the prediction, the dynamic coefficients grow to cover it and this
fraction more (a margin for the next batches' other shapes)."""
COEF_NAMES = ("activation", "expert", "cp", "logits", "headroom_bytes")


def check_max_memory_gb(value: Any, field_name: str) -> None:
    """ValueError naming ``field_name`` unless ``value`` is ``"auto"``, ``None`` or GB > 0."""
    if value is None or value == AUTO:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{field_name}={value!r}: pass GB per device > 0 (e.g. 64), 'auto' (the device's memory x "
                         f"{DEVICE_MEMORY_FRACTION}, none on CPU) or null (plan to the token budget only)")


def resolve_memory_limit(value: Any, device: torch.device) -> float | None:
    """Bytes per device the plans stay within: ``value`` GB, or for ``"auto"`` the accelerator's memory ×
    `DEVICE_MEMORY_FRACTION` (``None`` on CPU), or ``None``."""
    if value is None:
        return None
    if value == AUTO:
        total = _device.total_memory(device)
        return None if total is None else float(total) * DEVICE_MEMORY_FRACTION
    return float(value) * GB


def check_static_fits(model: MemoryModel, limit: float, field_name: str) -> None:
    """ValueError naming ``field_name``, the static memory and the fix when ``limit`` bytes do not hold
    the layout's static memory (parameters, gradients, optimizer shard) and the headroom."""
    MemoryBudget(model=model, limit_bytes=limit).check_static(field_name)


def engine_memory_model(shape: ModelShape, *, tp: int, pp: int, vpp: int, ep: int, etp: int, domain: int,
                        recompute: str, zero_memory: str, cp_algorithm: str, param_bytes: int,
                        coef: MemoryCoefficients | None = None, fused_logprobs: bool = False) -> MemoryModel:
    """The memory model of an engine's layout (activations in the parameters' dtype; ``fused_logprobs``: the
    last stage's logits term is the fused log-prob path's bytes)."""
    layout = MemoryLayout(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp, domain=domain, recompute=recompute,
                          zero_memory=zero_memory, cp_algorithm=cp_algorithm, param_bytes=param_bytes,
                          activation_bytes=param_bytes, fused_logprobs=bool(fused_logprobs))
    return MemoryModel(shape=shape, layout=layout, coef=coef or MemoryCoefficients())


def _tensors(obj: Any, out: list[torch.Tensor], depth: int = 0) -> None:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif depth < 4 and isinstance(obj, dict):
        for v in obj.values():
            _tensors(v, out, depth + 1)
    elif depth < 4 and isinstance(obj, (list, tuple)):
        for v in obj:
            _tensors(v, out, depth + 1)


def static_bytes(chunks: Sequence[Any], optimizers: Iterable[Any]) -> int:
    """Bytes of every distinct storage the engine holds whatever it computes: the model chunks'
    parameters and buffers, DDP's contiguous parameter and gradient buffers (``main_grad``), and each
    optimizer's state (Adam moments; before the first step, the two moments it will allocate) and
    parameters (fp32 master shards)."""
    tensors: list[torch.Tensor] = []
    for chunk in chunks:
        tensors.extend(chunk.parameters())
        tensors.extend(torch.nn.Module.buffers(chunk))
        for name in ("buffers", "expert_parallel_buffers"):  # Megatron DDP's contiguous param/grad buffers
            bufs = getattr(chunk, name, None)
            for buf in bufs if isinstance(bufs, (list, tuple)) else ():
                for attr in ("param_data", "grad_data"):
                    t = getattr(buf, attr, None)
                    if isinstance(t, torch.Tensor):
                        tensors.append(t)
        for p in chunk.parameters():
            g = getattr(p, "main_grad", None)
            if isinstance(g, torch.Tensor):
                tensors.append(g)
    pending = 0  # Adam moments the first optimizer step will allocate (2 per parameter, its dtype)
    for opt in optimizers:
        inner = getattr(opt, "optimizer", opt)
        state = getattr(inner, "state", {})
        for group in getattr(inner, "param_groups", []):
            for p in group.get("params", []):
                tensors.append(p)
                if not state.get(p):
                    pending += 2 * p.numel() * p.element_size()
        _tensors(dict(state), tensors)
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        ptr = int(st.data_ptr())
        if ptr:
            seen[ptr] = int(st.nbytes())
    return int(sum(seen.values())) + pending


def start_measure(device: torch.device, chunks: Sequence[Any], optimizer: Any, enabled: bool = True
                  ) -> tuple[MemoryMeter | None, int]:
    """A meter for one step's rounds and the static bytes its peaks add to (CPU: `static_bytes` of the
    engine's tensors; accelerators: allocated when the rounds begin), or ``(None, 0)`` when not measuring."""
    if not enabled:
        return None, 0
    device = torch.device(device)
    if device.type == "cpu":
        params = [p for chunk in chunks for p in chunk.parameters()]
        return MemoryMeter(device, exclude=params), static_bytes(chunks, optimizers(optimizer) if optimizer else [])
    return MemoryMeter(device), _device.memory_stats(device)["allocated_bytes"]


def measured_row(plan: Plan, meter: MemoryMeter | None, static: int) -> list[float] | None:
    """This rank's measured peak bytes per round and its static bytes (`MemoryCalibration.row`), after the
    step's rounds; ``None`` without a meter."""
    if meter is None:
        return None
    peaks = meter.finish()
    if meter.counting:  # CPU: the meter counted what the step added on top of the static bytes
        peaks = {r: static + v for r, v in peaks.items()}
    return MemoryCalibration.row(plan, peaks, static)


class MemoryCalibration:
    """The memory side of a `DomainPlanner`: records of measured peaks, immediate tightening and refits.

    ``window``: how many records the refit sees (the newest); ``min_records``: fewest for a refit.
    """

    def __init__(self, window: int = 256, min_records: int = 8) -> None:
        self.records: collections.deque[dict[str, Any]] = collections.deque(maxlen=window)
        self.min_records = min_records
        self.version = 0
        self.last_ratio = math.nan

    @staticmethod
    def row(plan: Plan, peaks: dict[int, int] | None, static: float) -> list[float]:
        """This rank's part of the planner's all-gather: [peak of each round (NaN: not measured), static]."""
        vals = [math.nan] * plan.num_rounds
        for r, v in (peaks or {}).items():
            if 0 <= r < plan.num_rounds:
                vals[r] = float(v)
        return vals + [float(static) if peaks else math.nan]

    def records_of(self, plan: Plan, model: MemoryModel, peaks: np.ndarray, static: np.ndarray, dom: np.ndarray,
                   stage: np.ndarray, step: int) -> list[dict[str, Any]]:
        """``"kind": "memory"`` records of one step: per round and pipeline stage, the rank that peaked
        highest; ``peaks`` [W, R], ``static`` [W] (NaN where not measured), ``dom``/``stage`` [W]."""
        tokens = plan.stats.tokens_per_rank if plan.stats is not None else plan.tokens_per_rank()  # [R, N]
        sizes = rank_group_sizes(plan)  # [R, N]
        out: list[dict[str, Any]] = []
        windows: dict[tuple[int, int], np.ndarray] = {}
        for r in range(plan.num_rounds):
            for s in np.unique(stage):
                rows = np.flatnonzero((stage == s) & np.isfinite(peaks[:, r]) & np.isfinite(static))
                if rows.size == 0:
                    continue
                w = int(rows[np.argmax(peaks[rows, r])])
                d, st = int(dom[w]), int(s)
                if (d, st) not in windows:
                    windows[d, st] = (window_tokens(tokens[:, d], model, st), rerun_tokens(tokens[:, d], model, st))
                t, k = float(tokens[r, d]), int(sizes[r, d])
                win, wmax = float(windows[d, st][0][r]), float(windows[d, st][1][r])
                if not peaks[w, r] > static[w]:
                    continue  # nothing held beyond the static bytes (an idle pipeline slot)
                out.append({"kind": "memory", "features": memory_features(model, t, k, st, win, wmax),
                            "static_bytes": float(static[w]), "peak_bytes": float(peaks[w, r]), "tokens": t,
                            "group_size": k, "stage": st, "window_tokens": win, "rerun_tokens": wmax,
                            "step": step, "round": r,
                            "domain_rank": d, "world_row": w, "policy": plan.policy})
        return out

    @staticmethod
    def predicted(model: MemoryModel, rec: dict[str, Any]) -> float:
        """The model's peak for a record (its static bytes as measured)."""
        c = model.coef
        return rec["static_bytes"] + c.headroom_bytes + sum(
            getattr(c, n) * x for n, x in zip(COEF_NAMES[:4], rec["features"]))

    def tighten(self, model: MemoryModel, recs: Sequence[dict[str, Any]]) -> MemoryModel | None:
        """A model whose dynamic part covers every record of this step (scaled by the largest
        measured/predicted ratio of the bytes beyond the static, and `TIGHTEN_MARGIN` more), or ``None``
        when none exceeds it."""
        ratio = 0.0
        for rec in recs:
            dyn_pred = self.predicted(model, rec) - rec["static_bytes"]
            dyn_meas = rec["peak_bytes"] - rec["static_bytes"]
            if dyn_pred > 0:
                ratio = max(ratio, dyn_meas / dyn_pred)
        self.last_ratio = ratio if recs else math.nan
        if ratio <= 1.0:
            return None
        c = model.coef
        scale = ratio * (1.0 + TIGHTEN_MARGIN)
        scaled = MemoryCoefficients(**{n: getattr(c, n) * scale for n in COEF_NAMES})
        self.version += 1
        return dataclasses.replace(model, coef=scaled)

    def refit(self, model: MemoryModel) -> np.ndarray:
        """World rank 0: [ok, 5 coefficients] of a fit to the window (``ok`` 0 when there are too few
        records or the fit failed: the model stays)."""
        vec = np.zeros(1 + len(COEF_NAMES))
        if len(self.records) < self.min_records:
            return vec
        try:
            coef, _ = fit_memory(list(self.records), base=model.coef, cover=True)
        except ValueError:
            return vec
        vec[0] = 1.0
        vec[1:] = [getattr(coef, n) for n in COEF_NAMES]
        return vec

    def adopt(self, model: MemoryModel, vec: np.ndarray) -> MemoryModel | None:
        """The model with the broadcast refit's coefficients (``None`` when there was none or nothing changed)."""
        if vec[0] <= 0 or not np.all(np.isfinite(vec[1:])) or np.any(vec[1:] < 0):
            return None
        coef = MemoryCoefficients(**{n: float(v) for n, v in zip(COEF_NAMES, vec[1:])})
        if coef == model.coef:
            return None
        self.version += 1
        return dataclasses.replace(model, coef=coef)
