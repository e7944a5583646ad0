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
import time
from typing import Any

import torch

__all__ = [
    "DEVICE_KINDS",
    "select_device",
    "backend_for",
    "current_stream",
    "new_event",
    "RoundTimer",
    "synchronize",
    "memory_stats",
    "reset_peak_memory",
    "total_memory",
    "npu_available",
    "cuda_available",
    "is_cuda",
    "is_npu", "PROFILE_OF_DEVICE", "cost_profile", "abort_ends_collectives",
    "fused_flash_attention_built", "compute_capability", "device_name", "empty_cache"]

PROFILE_OF_DEVICE = {"cpu": "cpu-gloo", "cuda": "h100-nvlink", "npu": "ascend-910b-hccs"}
"""Hardware profile (`hdp.packing.profiles`) the engines' ``auto`` cost model takes for each device kind."""

logger = logging.getLogger(__name__)

_CUDA = "cuda"
_NPU = "npu"
_CPU = "cpu"


def cost_profile(kind: str) -> str:
    """The hardware profile of device kind ``kind`` (`PROFILE_OF_DEVICE`; another accelerator: the GPU's)."""
    return PROFILE_OF_DEVICE.get(kind, PROFILE_OF_DEVICE[_CUDA])


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


def fused_flash_attention_built() -> bool:
    """Whether this torch was built with its own CUDA flash-attention kernels (``aten::_flash_attention_*``)."""
    probe = getattr(torch.backends.cuda, "is_flash_attention_available", None)
    return bool(probe is not None and probe())


def compute_capability(device: torch.device | None = None) -> tuple[int, int] | None:
    """(major, minor) compute capability of CUDA ``device`` (the current one for ``None``); ``None`` elsewhere."""
    if device is not None and torch.device(device).type != _CUDA:
        return None
    if not cuda_available():
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return int(major), int(minor)


def device_name(device: torch.device) -> str:
    """A readable name of ``device``: the accelerator's product name, or ``cpu``."""
    dev = torch.device(device)
    if dev.type == _CUDA and cuda_available():
        return str(torch.cuda.get_device_name(dev))
    if dev.type == _NPU and npu_available():
        return str(getattr(torch, _NPU).get_device_name(dev))
    return dev.type


def empty_cache(device: torch.device) -> None:
    """Return the caching allocator's free blocks of ``device`` to the driver (no-op on CPU)."""
    mod = _module_for(device)
    if mod is not None:
        mod.empty_cache()


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


def abort_ends_collectives(group: Any) -> bool:
    """Whether ``group.abort()`` on a rank ends a collective that rank is blocked in on ``group``: NCCL
    yes (its communicator abort; not run on hardware); gloo no (torch 2.13, measured: only freeing the
    group does); HCCL not known here, taken as no."""
    import torch.distributed as dist

    return dist.get_backend(group) == "nccl"


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


class _HostEvent:
    """Event stand-in on CPU: work is synchronous, so ``record`` stamps the host clock.

    ``elapsed_time(end)`` is the milliseconds from this event's record to ``end``'s, as for CUDA
    events; wait/synchronize do nothing.
    """

    def __init__(self, enable_timing: bool = False) -> None:
        self._enable_timing = enable_timing
        self._t: float | None = None

    def record(self, stream: Any = None) -> None:
        self._t = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "_HostEvent") -> float:
        """Milliseconds from this event to ``end`` (both recorded, timing enabled)."""
        if not (self._enable_timing and end._enable_timing):
            raise ValueError("elapsed_time: both events need enable_timing=True")
        if self._t is None or end._t is None:
            raise ValueError("elapsed_time: record both events first")
        return (end._t - self._t) * 1e3


def new_event(device: torch.device, enable_timing: bool = False) -> Any:
    """A new event on ``device`` (a host-clock event on CPU); ``elapsed_time`` works on both."""
    mod = _module_for(device)
    if mod is None:
        return _HostEvent(enable_timing)
    return mod.Event(enable_timing=enable_timing)


class RoundTimer:
    """Per-round device time of one step without a host synchronisation per round.

    ``start(key)`` / ``stop(key)`` record timing events on the device's current stream (any number
    of start/stop pairs per key: their durations add up, e.g. a pipeline stage's forward and
    backward of one micro-batch); :meth:`seconds` synchronises once (call it once per step,
    after the step's work) and returns the summed seconds per key.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._spans: dict[Any, list[tuple[Any, Any]]] = {}
        self._open: dict[Any, Any] = {}

    def start(self, key: Any) -> None:
        """Open a span of ``key`` (an open span of the same key is an error)."""
        if key in self._open:
            raise ValueError(f"RoundTimer.start({key!r}): a span of this key is already open")
        ev = new_event(self.device, enable_timing=True)
        ev.record()
        self._open[key] = ev

    def open_keys(self) -> list[Any]:
        """Keys whose span is open now."""
        return list(self._open)

    def stop(self, key: Any) -> None:
        """Close the open span of ``key``."""
        begin = self._open.pop(key, None)
        if begin is None:
            raise ValueError(f"RoundTimer.stop({key!r}): no open span of this key")
        end = new_event(self.device, enable_timing=True)
        end.record()
        self._spans.setdefault(key, []).append((begin, end))

    def seconds(self, *, sync: bool = True) -> dict[Any, float]:
        """Summed seconds of the closed spans per key.

        ``sync``: wait for the device first (one synchronisation); pass ``False`` when the
        caller has just synchronised (e.g. read a reduced tensor back to the host) after the spans.
        """
        if self._open:
            raise ValueError(f"RoundTimer.seconds: spans still open for {sorted(map(str, self._open))}")
        if sync:
            synchronize(self.device)
        return {k: sum(b.elapsed_time(e) for b, e in spans) / 1e3 for k, spans in self._spans.items()}


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


def reset_peak_memory(device: torch.device) -> None:
    """Restart the allocator's peak of ``device`` at its current allocation (no-op on CPU)."""
    mod = _module_for(device)
    if mod is not None:
        mod.reset_peak_memory_stats(torch.device(device))


def total_memory(device: torch.device) -> int | None:
    """Bytes of memory of accelerator ``device`` (``None`` on CPU: no device memory to plan to)."""
    mod = _module_for(device)
    if mod is None:
        return None
    dev = torch.device(device)
    return int(mod.get_device_properties(dev.index if dev.index is not None else mod.current_device()).total_memory)
