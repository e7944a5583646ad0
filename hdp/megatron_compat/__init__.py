"""The one compat layer for Megatron-core, split by job (this package re-exports every name):

* :mod:`~hdp.megatron_compat.names` — every private or version-sensitive Megatron-core name hdp uses;
* :mod:`~hdp.megatron_compat.cpu_shim` — the scoped CPU shim (patches applied only for a CPU device);
* :mod:`~hdp.megatron_compat.p2p` — pipeline send/receive of hdp's variable-length rounds;
* :mod:`~hdp.megatron_compat.runtime` — Megatron's parallel state: initialise, release;
* :mod:`~hdp.megatron_compat.grouped_experts` — ``TEGroupedMLP`` without TransformerEngine: a stand-in
  of TE's grouped linear (same ``weight{i}`` parameters, hdp's grouped GEMM), and the spec swap.
* :mod:`~hdp.megatron_compat.head` — one model's output layer returning its input (the fused log-prob path).

Every private (or version-sensitive) Megatron-core name that hdp uses is imported in
:mod:`~hdp.megatron_compat.names` and nowhere else, and :func:`apply_cpu_shim` holds every patch hdp
applies to Megatron-core's modules, classes and functions (the one other change, :func:`install_hidden_head`,
replaces the forward of one output-layer *instance* during one engine's rounds).  The shim is the
minimum that lets megatron-core run a GPT model with tensor, pipeline and expert parallelism, DDP
and the distributed optimizer on CPU with gloo.

The shim is a **scoped handle**: :func:`apply_cpu_shim` returns a :class:`CpuShim`; the first live
handle installs the patches (recording every attribute it replaces), and when the last live handle
is undone (:meth:`CpuShim.undo`, or leaving its ``with`` block) every replaced attribute is put
back, so Megatron is exactly as imported.  It is applied only for a CPU device: for CUDA or NPU
:func:`apply_cpu_shim` returns ``None`` and changes nothing, and :func:`initialize_megatron` /
:func:`hdp.trainer.model.build_gpt_model` take the device as a required argument, so a GPU run
never gets the CPU shim by omission.

Tested with megatron-core 0.16.1 (torch 2.13 CPU build).  Each patch says what it fixes and when
it can go; re-check the list when upgrading (``tests/distributed/trainer/test_megatron_model.py`` and
``tests/*/*/test_parallel*.py`` fail loudly when a new hard-coded CUDA call is hit).

How the patches work
--------------------
* **Module-scoped torch proxy** (:class:`_TorchProxy`): in the Megatron modules listed in
  :data:`_PROXIED_MODULES`, the module global ``torch`` is replaced by a proxy that forwards every
  attribute to the real ``torch`` except ``torch.cuda`` (a CPU stand-in: ``current_device()`` is
  ``"cpu"``, streams and events are no-ops) and the tensor factories (``torch.tensor``,
  ``torch.zeros``, ...), whose ``device="cuda"`` argument becomes ``"cpu"``.  The real ``torch``
  module is never modified, and code outside those modules is unaffected.
* **CPU RNG tracker** (:class:`_CpuRNGStatesTracker`): Megatron's ``CudaRNGStatesTracker`` keeps
  CUDA generator states; on CPU it tracks the CPU generator instead.
* **Type names without touching** ``torch.Tensor``: the distributed optimizer's constructor
  dispatches on ``param.type() == 'torch.cuda.FloatTensor'``; during that constructor only, each
  of *its own* CPU parameters carries an instance attribute ``type`` answering the CUDA name (removed
  afterwards).  ``torch.Tensor.type`` itself is never replaced, so nothing changes for any other
  tensor or thread, and nothing is swapped while the optimizer steps.  The grad-clipping helper
  that asserts the CUDA name is replaced by the same arithmetic without the assertion.
* **Grouped-GEMM experts**: Megatron's ``GroupedMLP`` calls the CUDA-only ``grouped_gemm`` package;
  on CPU its ``grouped_gemm_util`` module names are bound to :func:`hdp.kernels.grouped_gemm.gmm`
  (torch's ``grouped_mm``), and ``jit_fuser`` (``torch.compile``) is the identity in the experts module.
* **Distributed checkpointing**: ``dist_checkpointing`` (re-exported here) runs on CPU through the
  two proxied ``dist_checkpointing.strategies`` modules below; its torch_dist writer also needs
  ``psutil`` and starts a ``multiprocessing`` Manager and forked writers, so the calling process
  must not be daemonic.
"""

from hdp.megatron_compat.cpu_shim import (_PROXIED_MODULES, CpuShim, apply_cpu_shim, cpu_checkpoint_rng, cpu_shim_applied,
                                          cpu_shim_places)
from hdp.megatron_compat.head import HiddenHead, fused_head_problem, install_hidden_head
from hdp.megatron_compat.names import *  # noqa: F401,F403
from hdp.megatron_compat.names import __all__ as _names
from hdp.megatron_compat.p2p import HdpP2PCommunicator, interleaved_schedule
from hdp.megatron_compat.runtime import (
    MegatronRuntime,
    checkpoint_writers_die_with_parent,
    default_group,
    destroy_megatron,
    initialize_megatron,
    manual_seed,
    megatron_groups,
    release_ddp,
    stop_checkpoint_writer,
)

__all__ = [*_names, "CpuShim", "apply_cpu_shim", "cpu_checkpoint_rng", "cpu_shim_applied", "cpu_shim_places",
           "HdpP2PCommunicator",
           "interleaved_schedule", "MegatronRuntime", "checkpoint_writers_die_with_parent", "destroy_megatron",
           "initialize_megatron", "manual_seed", "default_group", "megatron_groups", "release_ddp", "stop_checkpoint_writer",
           "_PROXIED_MODULES", "HiddenHead", "fused_head_problem", "install_hidden_head"]
