"""The one module of hdp that knows about accelerators (CPU, CUDA, Ascend NPU).

Everything else takes its device from input tensors or explicit arguments; no other module names
a device type or calls the per-backend ``torch.<backend>`` namespaces.  Stream and event helpers
are no-ops on CPU so callers can write one code path.
"""

from __future__ import annotations

import functools
import logging
import resource
import sys
from typing import Any

import torch

__all__ = [
    "DEVICE_KINDS",
    "select_device",
    "backend_for",
    "current_stream",
    "new_event",
    "synchronize",
    "memory_stats",
    "npu_available",
    "cuda_available",
    "is_cuda",
    "is_npu",
]

logger = logging.getLogger(__name__)

_CUDA = "cuda"
_NPU = "npu"
_CPU = "cpu"

@functools.lru_cache(maxsize=1)
def _torch_npu_importable() -> bool:
    """Import ``torch_npu`` once, guarded: on machines without CANN its import raises anything."""
    try:
        import torch_npu  # noqa: F401  (registers the "npu" device type)
    except Exception as exc:  # any failure (missing CANN libs, ABI mismatch) means "no NPU"
        logger.debug("torch_npu not usable: %s", exc)
        return False
    return True


DEVICE_KINDS: tuple[str, ...] = ("cpu", "cuda", "npu")
"""Device kinds hdp runs on (the part of a device string before ``:``)."""

def cuda_available() -> bool:
    """Whether a CUDA device is usable."""
    return bool(torch.cuda.is_available())


def npu_available() -> bool:
    """Whether an Ascend NPU is usable (``torch_npu`` imports and reports a device)."""
    if not _torch_npu_importable():
        return False
    npu = getattr(torch, _NPU, None)
    return bool(npu is not None and npu.is_available())


def select_device(prefer: str | None = None) -> torch.device:
    """Return the device to run on.

    ``prefer`` is ``"cpu"``, ``"cuda"``, ``"npu"`` (optionally with an index, ``"cuda:1"``) or
    ``None`` for the first available of cuda, npu, cpu.  Asking for an unavailable accelerator
    raises ``ValueError``.
    """
    if prefer is None:
        if cuda_available():
            return torch.device(_CUDA, torch.cuda.current_device())
        if npu_available():
            return torch.device(_NPU, getattr(torch, _NPU).current_device())
        return torch.device(_CPU)
    kind = prefer.split(":", 1)[0]
    if kind == _CPU:
        return torch.device(prefer)
    if kind == _CUDA:
        if not cuda_available():
            raise ValueError(f"device={prefer!r}: CUDA is not available here; use 'cpu' or None")
        return torch.device(prefer)
    if kind == _NPU:
        if not npu_available():
            raise ValueError(f"device={prefer!r}: torch_npu/CANN is not available; use 'cpu' or None")
        return torch.device(prefer)
    raise ValueError(f"device={prefer!r}: expected 'cpu', 'cuda[:i]', 'npu[:i]' or None")


def is_cuda(device: torch.device) -> bool:
    """Whether ``device`` is a CUDA device (lets other modules avoid the literal)."""
    return torch.device(device).type == _CUDA


def is_npu(device: torch.device) -> bool:
    """Whether ``device`` is an Ascend NPU device."""
    return torch.device(device).type == _NPU


def backend_for(device: torch.device) -> str:
    """torch.distributed backend for ``device``: gloo (cpu), nccl (cuda), hccl (npu)."""
    kind = torch.device(device).type
    if kind == _CPU:
        return "gloo"
    if kind == _CUDA:
        return "nccl"
    if kind == _NPU:
        return "hccl"
    raise ValueError(f"device={device}: no torch.distributed backend known for type {kind!r}")


def _module_for(device: torch.device) -> Any | None:
    kind = torch.device(device).type
    if kind == _CUDA:
        return torch.cuda
    if kind == _NPU and _torch_npu_importable():
        return getattr(torch, _NPU)
    return None


def current_stream(device: torch.device) -> Any | None:
    """The current compute stream of ``device``; ``None`` on CPU."""
    mod = _module_for(device)
    return None if mod is None else mod.current_stream(torch.device(device))


class _NullEvent:
    """Event stand-in on CPU: work is synchronous, so record/wait/synchronize do nothing."""

    def record(self, stream: Any = None) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


def new_event(device: torch.device, enable_timing: bool = False) -> Any:
    """A new event on ``device`` (a no-op event on CPU)."""
    mod = _module_for(device)
    if mod is None:
        return _NullEvent()
    return mod.Event(enable_timing=enable_timing)


def synchronize(device: torch.device) -> None:
    """Wait for all work queued on ``device`` (no-op on CPU)."""
    mod = _module_for(device)
    if mod is not None:
        mod.synchronize(torch.device(device))


def memory_stats(device: torch.device) -> dict[str, int]:
    """``{"allocated_bytes", "peak_bytes"}`` of ``device``; on CPU the process RSS (current, peak)."""
    mod = _module_for(device)
    if mod is not None:
        dev = torch.device(device)
        return {
            "allocated_bytes": int(mod.memory_allocated(dev)),
            "peak_bytes": int(mod.max_memory_allocated(dev)),
        }
    # ru_maxrss is KiB on Linux, bytes on macOS
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    current = peak
    try:
        with open("/proc/self/statm") as fh:  # pages: size resident ...
            current = int(fh.read().split()[1]) * resource.getpagesize()
    except OSError:
        pass
    return {"allocated_bytes": int(current), "peak_bytes": int(max(peak, current))}
