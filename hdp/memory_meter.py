"""Per-round peak memory of a rank: the device allocator on CUDA/NPU, counted tensors on CPU.

On an accelerator the allocator knows every byte: `MemoryMeter` resets its peak when a round's
forward starts and reads it when the next round's forward starts (or the step ends), so a round's
peak is the most the device held while that round was the newest one in flight (under 1F1B the
older rounds' activations are still held; `hdp.packing.memory` models that window).

On CPU there is no allocator to ask (the process RSS never shrinks), so the meter *counts*:

* the bytes autograd saves for backward — every distinct storage handed to a saved-tensor hook
  (``torch.autograd.graph.saved_tensors_hooks``), counted once however many ops save it, from the
  moment it is saved until the last saving node has released it; parameter storages are excluded
  (they are static);
* the buffers hdp's CP attention allocates for the ring or the all-gather (received K/V, the fp32
  output and log-sum-exp accumulators, the travelling dK/dV), registered with `track` and counted
  while they are alive;
* not counted: temporaries inside an op, gradients in flight during backward, the optimizer step,
  and tensors without a plain storage (subclasses, nested tensors).

A round's measured peak is then ``static + the most of those bytes alive at once`` while it was the
newest round; ``static`` (parameters, fp32 gradient buffers, the distributed optimizer's shard) is
counted by the engine from the tensors it holds.

Only one meter is active per process (`MemoryMeter.activate`); `track` is a no-op without one.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterable, Iterator

import torch

from hdp import device as _device

__all__ = ["MemoryMeter", "track"]

_ACTIVE: list["MemoryMeter"] = []  # the meter of this process while one is active (at most one)


def track(*tensors: torch.Tensor | None) -> None:
    """Count ``tensors`` (CP buffers) as held while they live, when a CPU meter is active (else nothing)."""
    if not _ACTIVE:
        return
    meter = _ACTIVE[-1]
    for t in tensors:
        if t is not None:
            meter._hold(t)


class _Saved:
    """A saved tensor and the meter entry it keeps alive; releasing it uncounts the storage."""

    __slots__ = ("tensor", "key", "meter", "__weakref__")

    def __init__(self, tensor: torch.Tensor, key: int, meter: "MemoryMeter") -> None:
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self) -> None:
        self.meter._release(self.key)


class MemoryMeter:
    """Measures the peak bytes of each round (see the module docstring)."""

    def __init__(self, device: torch.device, exclude: Iterable[torch.Tensor] = ()) -> None:
        self.device = torch.device(device)
        self.counting = self.device.type == "cpu"
        """Whether bytes are counted (CPU) rather than read from the device allocator."""
        self._exclude = {int(t.untyped_storage().data_ptr()) for t in exclude}
        self._saved: dict[int, list[int]] = {}  # storage pointer -> [references, bytes]
        self.live = 0
        """Counted bytes alive now (CPU)."""
        self._peak = 0
        self._round: int | None = None
        self.peaks: dict[int, int] = {}
        """Round -> the most dynamic bytes alive while it was the newest round in flight."""

    # -- counting (CPU) --

    def _add(self, nbytes: int) -> None:
        self.live += nbytes
        if self.live > self._peak:
            self._peak = self.live

    def _pack(self, t: torch.Tensor) -> Any:
        try:
            storage = t.untyped_storage()
            key = int(storage.data_ptr())
        except (RuntimeError, NotImplementedError):  # no plain storage (a tensor subclass, nested, meta)
            return t
        if key == 0 or key in self._exclude:
            return t
        entry = self._saved.get(key)
        if entry is None:
            self._saved[key] = [1, int(storage.nbytes())]
            self._add(int(storage.nbytes()))
        else:
            entry[0] += 1
        # detached (the same storage, no grad_fn): holding the tensor itself would tie a saved output to
        # the node that saves it, a cycle through the C++ graph that outlives a backward that failed
        return _Saved(t.detach(), key, self)

    @staticmethod
    def _unpack(obj: Any) -> torch.Tensor:
        return obj.tensor if isinstance(obj, _Saved) else obj

    def _release(self, key: int) -> None:
        entry = self._saved.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self._saved[key]
            self.live -= entry[1]

    def _hold(self, t: torch.Tensor) -> None:
        try:
            nbytes = int(t.untyped_storage().nbytes())
        except (RuntimeError, NotImplementedError):
            return
        self._add(nbytes)
        weakref.finalize(t, self._drop, nbytes)

    def _drop(self, nbytes: int) -> None:
        self.live -= nbytes

    # -- rounds --

    def _close_round(self) -> None:
        if self._round is None:
            return
        if self.counting:
            peak = self._peak
        else:
            peak = _device.memory_stats(self.device)["peak_bytes"]
        self.peaks[self._round] = max(self.peaks.get(self._round, 0), int(peak))

    def begin_round(self, index: int) -> None:
        """Round ``index``'s forward starts: close the previous round's peak and start this one's."""
        if index == self._round:
            return
        self._close_round()
        self._round = index
        if self.counting:
            self._peak = self.live
        else:
            _device.reset_peak_memory(self.device)

    def finish(self) -> dict[int, int]:
        """Close the last round; returns `peaks` (CPU: dynamic bytes; accelerators: allocator peaks)."""
        self._close_round()
        self._round = None
        return dict(self.peaks)

    @contextlib.contextmanager
    def activate(self) -> Iterator["MemoryMeter"]:
        """Count saved tensors and tracked buffers (CPU) for the duration of the block."""
        if not self.counting:
            yield self
            return
        if _ACTIVE:
            raise RuntimeError("a MemoryMeter is already active in this process; finish it first")
        _ACTIVE.append(self)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self
        finally:
            _ACTIVE.remove(self)
