"""A CPU platform for verl (laptop demos and tests), registered through verl's own ``PlatformRegistry``.

verl 0.9.1 ships CUDA, NPU and ROCm platforms and falls back to "nvidia" on a CPU-only machine
(``verl/plugin/platform/platform_manager.py``), so ``get_device_name()`` names the GPU and every
``get_torch_device()`` call reaches torch's GPU module.  ``PlatformCPU`` answers "cpu" and a small
``torch.cpu``-like module; select it with ``VERL_PLATFORM=cpu`` (set by :func:`hdp.integrations.verl.scaffolding.install`).
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Iterator, Optional

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

__all__ = ["PLATFORM", "PlatformCPU", "cpu_device_module"]

PLATFORM = "cpu"


def _zero(*args: Any, **kwargs: Any) -> int:
    return 0


def _none(*args: Any, **kwargs: Any) -> None:
    return None


def cpu_device_module() -> types.ModuleType:
    """What verl calls on ``get_torch_device()``, for CPU (memory figures are 0: no device memory)."""
    mod = types.ModuleType("hdp_verl_cpu_device")
    mod.current_device = lambda: "cpu"
    for name in ("max_memory_allocated", "max_memory_reserved", "memory_allocated", "memory_reserved"):
        setattr(mod, name, _zero)
    for name in ("empty_cache", "synchronize", "set_device", "reset_peak_memory_stats", "ipc_collect",
                 "manual_seed", "manual_seed_all"):
        setattr(mod, name, _none)
    mod.device_count = lambda: 1
    mod.get_device_name = lambda *a, **k: "CPU"
    mod.is_available = lambda: True
    mod.get_rng_state = torch.get_rng_state
    mod.set_rng_state = torch.set_rng_state
    mod.mem_get_info = lambda *a, **k: (0, 0)
    mod.memory_stats = lambda *a, **k: {}
    mod.Stream = torch.cpu.Stream
    mod.stream = torch.cpu.stream
    mod.current_stream = torch.cpu.current_stream
    mod.Event = torch.cpu.Event
    return mod


@PlatformRegistry.register(platform=PLATFORM)
class PlatformCPU(PlatformBase):
    """verl platform for CPU-only test runs: device "cpu", gloo collectives, no Ray accelerators."""

    _module = cpu_device_module()

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return self._module

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return False  # never auto-detected: only VERL_PLATFORM=cpu selects it

    def current_device(self) -> str:  # type: ignore[override]
        return "cpu"  # verl passes it to .to(...) / device=...; an int would mean cuda:0

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: Optional[int] = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[Optional[int], Optional[int]]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "VERL_CPU_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str) -> Iterator[None]:
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        # a *logical* Ray resource for one training rank: verl's resource check counts only "GPU"
        # or "NPU" (single_controller/ray/base.py _check_resource_available); the CPU main_ppo run
        # declares ray_init.resources={NPU: ranks}.  Nothing NPU-specific keys on this name.
        return "NPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None
