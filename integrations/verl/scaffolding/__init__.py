"""Scaffolding for the laptop demo (``hdp demo --verl``) and the tests: verl on a machine without an
accelerator.  Not a CPU backend of hdp's engine (which runs on CPU as it is): it monkeypatches verl,
mbridge, Megatron and ``torch.nn.Module.cuda`` so that verl's own worker and ``main_ppo`` build and run
an hdp engine on CPU ranks, and holds what the tests and the demo share (a tiny HF model, verl batches,
verl's worker from its Hydra config, an HF rollout on CPU).  GPU/NPU runs never import it.

Call :func:`install` first (the demo and the tests do; every Ray process of a ``main_ppo`` run through
:mod:`~hdp.integrations.verl.scaffolding.autoload`).  Needs the ``verl`` extra (verl, mbridge).  It exists
because verl 0.9.1 and mbridge assume an accelerator and TransformerEngine; what :func:`install` applies:

* ``VERL_PLATFORM=cpu`` and the :class:`~hdp.integrations.verl.scaffolding.platform.PlatformCPU`
  registration (verl's ``get_device_name()`` is then "cpu", so ``EngineRegistry`` finds hdp's "cpu" key);
* hdp's Megatron CPU shim (:func:`hdp.megatron_compat.apply_cpu_shim`, public API);
* verl 0.9.0's padding helpers without flash-attn (:mod:`~hdp.integrations.verl.scaffolding.padding`: verl 0.9.1's
  own torch fallbacks);
* mbridge on the local layer spec (:mod:`~hdp.integrations.verl.scaffolding.mbridge_local`), and its
  ``get_model`` without the ``module.cuda()`` it calls on every chunk (``mbridge/core/util.py``).

The rest: :mod:`~.tiny` (a tiny HF checkpoint), :mod:`~.batches` (verl's batches of samples),
:mod:`~.worker` (verl's ``ActorRolloutRefWorker`` from ``ppo_trainer`` + ``model_engine=hdp``),
:mod:`~.hf_rollout` (the ``hf_cpu`` rollout).  Idempotent.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from typing import Any, Iterator

import torch

__all__ = ["install"]

_installed = False


@contextlib.contextmanager
def _module_cuda_is_noop() -> Iterator[None]:
    orig = torch.nn.Module.cuda
    torch.nn.Module.cuda = lambda self, device=None: self  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.nn.Module.cuda = orig  # type: ignore[method-assign]


def _without_pinning(fn: Any) -> Any:
    """``fn`` with ``torch.Tensor.pin_memory`` an identity for the duration of each call (CPU copies only)."""
    if getattr(fn, "_hdp_unpinned", False):
        return fn

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        orig = torch.Tensor.pin_memory
        torch.Tensor.pin_memory = lambda self, *a, **k: self  # type: ignore[method-assign,assignment]
        try:
            return fn(*args, **kwargs)
        finally:
            torch.Tensor.pin_memory = orig  # type: ignore[method-assign]

    call._hdp_unpinned = True  # type: ignore[attr-defined]
    return call


class _TorchWithCpuCurrentDevice:
    """``torch`` for one module: the accelerator namespace's ``current_device()`` is "cpu", ``synchronize()`` a no-op."""

    class cuda:  # noqa: N801 (the attribute name the shimmed module reads)
        @staticmethod
        def current_device() -> str:
            return "cpu"

        @staticmethod
        def synchronize(*args: Any, **kwargs: Any) -> None:
            return None

    @staticmethod
    def empty(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        return torch.empty(*args, **kwargs)  # no pinned host memory without an accelerator

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _patch_mbridge_get_model() -> None:
    import mbridge.core.bridge as bridge_mod
    import mbridge.core.util as util_mod

    util_mod.torch = _TorchWithCpuCurrentDevice()  # get_model moves each module to the accelerator's current device

    orig = bridge_mod.get_model
    if getattr(orig, "_hdp_cpu", False):
        return

    @functools.wraps(orig)
    def get_model(*args: Any, **kwargs: Any) -> Any:
        with _module_cuda_is_noop():
            return orig(*args, **kwargs)

    get_model._hdp_cpu = True  # type: ignore[attr-defined]
    bridge_mod.get_model = get_model


def _patch_process_group_backend() -> None:
    """Ray workers: verl initialises torch.distributed with "cpu:gloo,<device>:<backend>" (here
    "cpu:gloo,cpu:gloo", which torch rejects as a duplicate device); on CPU it is plain "gloo".
    Patched before ``verl.workers.engine_workers`` imports the function by name."""
    import verl.utils.distributed as vdist

    orig = vdist.initialize_global_process_group_ray
    if getattr(orig, "_hdp_cpu", False):
        return

    @functools.wraps(orig)
    def initialize_global_process_group_ray(timeout_second: Any = None, backend: Any = None) -> Any:
        return orig(timeout_second=timeout_second, backend=backend or "gloo")

    initialize_global_process_group_ray._hdp_cpu = True  # type: ignore[attr-defined]
    vdist.initialize_global_process_group_ray = initialize_global_process_group_ray
    engine_workers = sys.modules.get("verl.workers.engine_workers")
    if engine_workers is not None:
        engine_workers.initialize_global_process_group_ray = initialize_global_process_group_ray


def install() -> None:
    """Make verl + Megatron + mbridge run on CPU in this process (see the module docstring)."""
    global _installed
    if _installed:
        return
    os.environ["VERL_PLATFORM"] = "cpu"
    from hdp.integrations.verl.scaffolding import mbridge_local, padding, platform  # noqa: F401  (registers the platform)

    from hdp import megatron_compat

    megatron_compat.apply_cpu_shim("cpu")
    padding.install()  # verl 0.9.0 unpads through flash-attn only
    mbridge_local.register()
    _patch_mbridge_get_model()
    # verl's checkpoint load (dist_checkpointing with the fully-parallel load strategy) calls
    # the GPU module's synchronize() (megatron-core 0.16.1 fully_parallel.py:272), a path hdp's shim does not cover
    import megatron.core.dist_checkpointing.strategies.fully_parallel as fully_parallel

    fully_parallel.torch = _TorchWithCpuCurrentDevice()
    # verl's parameter offload allocates its host copies with pin_memory=True
    # (verl/utils/megatron_utils.py offload_megatron_model_to_cpu), which needs an accelerator
    import verl.utils.megatron_utils as megatron_utils

    megatron_utils.torch = _TorchWithCpuCurrentDevice()
    # verl's detached workers (separate-/fully-async) copy the model to pinned host memory between policies
    # (copy_megatron_model_to_cpu: tensor.pin_memory(), which needs an accelerator); on CPU the copy is the copy
    megatron_utils.copy_megatron_model_to_cpu = _without_pinning(megatron_utils.copy_megatron_model_to_cpu)
    _patch_process_group_backend()
    _installed = True
