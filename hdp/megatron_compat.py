"""The one compat module for Megatron-core: private imports and the scoped CPU shim.

Every private (or version-sensitive) Megatron-core name that hdp uses is imported here and nowhere
else, and :func:`apply_cpu_shim` holds every patch hdp applies to Megatron-core.  The shim is the
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
it can go; re-check the list when upgrading (``tests/test_megatron_model.py`` and
``tests/test_parallel*.py`` fail loudly when a new hard-coded CUDA call is hit).

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
* **Distributed checkpointing**: ``dist_checkpointing`` (re-exported here) runs on CPU through the
  two proxied ``dist_checkpointing.strategies`` modules below; its torch_dist writer also needs
  ``psutil`` and starts a ``multiprocessing`` Manager and forked writers, so the calling process
  must not be daemonic.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import importlib
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

# --- Megatron-core names hdp uses (public and private), imported in this module only ------------
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator, _p2p_ops
from megatron.core.pipeline_parallel.schedules import (
    forward_backward_no_pipelining,
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
)
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

from hdp import device as _device

__all__ = [
    "MEGATRON_CORE_VERSION",
    "TESTED_VERSIONS",
    "CpuShim",
    "MegatronRuntime",
    "apply_cpu_shim",
    "cpu_shim_applied",
    "initialize_megatron",
    "megatron_groups",
    "destroy_megatron",
    "stop_checkpoint_writer",
    "release_ddp",
    "manual_seed",
    "dist_checkpointing",
    "parallel_state",
    "tensor_parallel",
    "DistributedDataParallel",
    "DistributedDataParallelConfig",
    "finalize_model_grads",
    "GPTModel",
    "get_gpt_layer_local_spec",
    "OptimizerConfig",
    "get_megatron_optimizer",
    "PackedSeqParams",
    "P2PCommunicator",
    "HdpP2PCommunicator",
    "ProcessGroupCollection",
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_with_interleaving",
    "forward_backward_pipelining_without_interleaving",
    "TransformerConfig",
    "AttnMaskType",
    "MegatronModule",
    "ModuleSpec",
    "TransformerBlockSubmodules",
    "get_num_layers_to_build",
]

logger = logging.getLogger(__name__)

try:
    from megatron.core.package_info import __version__ as MEGATRON_CORE_VERSION
except ImportError:  # very old releases had no package_info
    MEGATRON_CORE_VERSION = "unknown"

TESTED_VERSIONS: tuple[str, ...] = ("0.16.1",)
"""megatron-core versions the CPU shim was run against."""

_CUDA = "cuda"

# Megatron modules whose global ``torch`` gets the CPU proxy, with the CUDA calls each one makes
# on the paths hdp runs (megatron-core 0.16.1).  Each entry can go when megatron-core takes the
# device from its inputs there (none of them does as of 0.16.1).
_PROXIED_MODULES: dict[str, str] = {
    # RotaryEmbedding.get_emb moves inv_freq to torch.cuda.current_device() on the first forward
    # (hit with position_embedding_type="rope"; hdp's own model uses "none").
    "megatron.core.models.common.embeddings.rotary_pos_embedding": "RoPE inv_freq device",
    # _ParamAndGradBuffer: param/grad buffers allocated on torch.cuda.current_device() (hit by DDP).
    "megatron.core.distributed.param_and_grad_buffer": "DDP buffers and streams",
    # MixedPrecisionOptimizer.__init__: found_inf / _dummy_overflow_buf / _scale_one created with
    # device='cuda' (hit by get_megatron_optimizer).
    "megatron.core.optimizer.optimizer": "optimizer device literals",
    # DistributedOptimizer: load_state_dict of an optimizer without state allocates its dummy
    # shards, and the gather-based checkpoint formats their buffers, on torch.cuda.current_device()
    # (hdp's engine allocates the state before loading and saves 'dp_reshardable', so neither is hit).
    "megatron.core.optimizer.distrib_optimizer": "distributed optimizer checkpoint buffers",
    # get_grad_norm_fp32: device='cuda' literals (hit by step()).
    "megatron.core.optimizer.clip_grads": "grad-norm device literals",
    # utils.local_multi_tensor_l2_norm, the no-Apex grad-norm fallback get_grad_norm_fp32 calls:
    # result tensor created with device="cuda" (hit by step()); GlobalMemoryBuffer.get_tensor
    # allocates on torch.cuda.current_device() (sequence-parallel all-gathers in the TP linears).
    "megatron.core.utils": "grad-norm fallback and global memory buffer device",
    # TopKRouter.gating moves weight/bias to torch.cuda.current_device() (hit by every MoE forward).
    "megatron.core.transformer.moe.router": "MoE router device",
    # MoEAlltoAllTokenDispatcher: class-level torch.cuda.Stream() and current_stream()/stream()
    # around the device-to-host copy of the split sizes (hit by every alltoall dispatch).
    "megatron.core.transformer.moe.token_dispatcher": "MoE split sizes stream",
    # mappings: gather / all-to-all / reduce-scatter outputs on torch.cuda.current_device() (the
    # alltoall dispatcher's split sizes and token all-to-all; TP / sequence-parallel collectives).
    "megatron.core.tensor_parallel.mappings": "TP collectives and EP all-to-all buffers",
    # tensor_parallel.layers: LinearWithGradAccumulationAndAsyncCommunication allocates the
    # sequence-parallel all-gather buffer through get_global_memory_buffer and reads
    # torch.cuda.current_device() for the weight-gradient path (hit by every TP linear).
    "megatron.core.tensor_parallel.layers": "TP linear device",
    # transformer.utils.get_default_causal_mask: torch.ones(sq, sq, device="cuda"), used by
    # Megatron's local DotProductAttention (hdp's tests use it as the reference).
    "megatron.core.transformer.utils": "local attention causal-mask device literal",
    # forward_backward_no_pipelining / _with(out)_interleaving: total_num_tokens = torch.zeros(...,
    # device="cuda") (hit by every schedule call).
    "megatron.core.pipeline_parallel.schedules": "schedule token-count device literal",
    # P2PCommunicator: the shape tensors (variable_seq_lengths) and receive buffers are created on
    # torch.cuda.current_device(), and torch.cuda.synchronize() follows batched sends (hit by every
    # pipeline-parallel send/receive).
    "megatron.core.pipeline_parallel.p2p_communication": "pipeline send/receive buffers",
    # finalize_model_grads and its helpers: no CUDA call on hdp's paths today (embedding and
    # layer-norm all-reduces take the device of the gradients); proxied so a future one fails over
    # to CPU instead of raising.
    "megatron.core.distributed.finalize_model_grads": "gradient finalisation",
    # FileSystemWriterAsync.preload_tensors: torch.cuda.synchronize() after staging the tensors to
    # host memory (hit by every dist_checkpointing.save with the torch_dist backend).
    "megatron.core.dist_checkpointing.strategies.filesystem_async": "checkpoint writer synchronize",
    # verify_global_md_reuse: all_results with device='cuda'; save_state_dict_async_finalize:
    # failures_occurred on torch.cuda.current_device() (hit by every dist_checkpointing.save).
    "megatron.core.dist_checkpointing.strategies.state_dict_saver": "checkpoint save flags device",
}
# Not proxied (megatron-core 0.16.1 paths hdp does not take): DDP's torch.cuda.Stream (only with
# num_distributed_optimizer_instances > 1), moe_utils' aux-loss logging tracker (device="cuda",
# only with load-balancing losses tracked), the legacy GroupedMLP expert weights (moe_grouped_gemm).

_FACTORIES = (
    "tensor",
    "as_tensor",
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "rand",
    "randn",
    "randint",
)


# --- the CPU stand-in for torch.cuda ------------------------------------------------------------


class _NullStream:
    """A CUDA stream stand-in: on CPU all work is synchronous, so every method is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> Any:
        return _device.new_event(torch.device("cpu"))

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _NullStream)

    def __hash__(self) -> int:
        return 0


_NULL_STREAM = _NullStream()


class _CpuCudaNamespace:
    """What ``torch.cuda`` means inside a proxied Megatron module on CPU.

    ``current_device()`` returns ``"cpu"`` (Megatron passes it as a ``device=`` argument),
    streams/events/synchronisation are no-ops, ``is_available()`` is False; every other attribute
    is the real ``torch.cuda`` one (so unexpected CUDA calls still fail loudly).
    """

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def is_available() -> bool:
        return False

    Stream = _NullStream

    @staticmethod
    def Event(*args: Any, **kwargs: Any) -> Any:  # noqa: N802 (mirrors torch.cuda.Event)
        return _device.new_event(torch.device("cpu"), enable_timing=bool(kwargs.get("enable_timing", False)))

    @staticmethod
    def stream(stream: Any = None) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    @staticmethod
    def current_stream(device: Any = None) -> _NullStream:
        return _NULL_STREAM

    @staticmethod
    def default_stream(device: Any = None) -> _NullStream:
        return _NULL_STREAM

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


def _to_cpu_device(dev: Any) -> Any:
    if isinstance(dev, str) and dev.split(":", 1)[0] == _CUDA:
        return "cpu"
    if isinstance(dev, torch.device) and dev.type == _CUDA:
        return torch.device("cpu")
    if isinstance(dev, int):  # a CUDA ordinal, as torch.cuda.current_device() returns
        return "cpu"
    return dev


def _cpu_factory(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> torch.Tensor:
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    return wrapper


class _TorchProxy:
    """Stands in for the ``torch`` module inside one Megatron module (see the module docstring)."""

    _hdp_cpu_proxy = True

    def __init__(self) -> None:
        self.cuda = _CpuCudaNamespace()
        for name in _FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


# --- CPU RNG tracker ------------------------------------------------------------------------------


class _CpuRNGStatesTracker(tensor_parallel.random.CudaRNGStatesTracker):
    """Megatron's named RNG-state tracker over the CPU generator.

    Megatron 0.16.1 ``CudaRNGStatesTracker.add``/``fork`` read and write CUDA generator states
    (``torch.cuda.get_rng_state``), which raises on a CPU-only build; ``model_parallel_cuda_manual_seed``
    therefore fails on CPU.  Same semantics here, with ``torch.get_rng_state``/``set_rng_state``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["use_cudagraphable_rng"] = False
        super().__init__(*args, **kwargs)

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise ValueError(f"rng state {name} already exists")
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name: str = tensor_parallel.random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        if name not in self.states_:
            raise ValueError(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        orig_name = self._current_state_name
        if orig_name != "default-rng":
            self.states_[orig_name] = orig
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            if orig_name != "default-rng":
                orig = self.states_[orig_name]
            torch.set_rng_state(orig)
            self._current_state_name = orig_name


# --- CUDA type names for the distributed optimizer's own parameters ------------------------------


def _cuda_type_name(t: torch.Tensor) -> str:
    """``torch.cuda.<T>Tensor`` for a CPU tensor ``t`` (what Megatron's optimizer expects)."""
    name = torch.Tensor.type(t)
    return name.replace("torch.", "torch.cuda.", 1) if name.startswith("torch.") else name


@contextlib.contextmanager
def _params_report_cuda_type(params: Sequence[torch.Tensor]) -> Iterator[None]:
    """While active, each CPU tensor of ``params`` answers ``.type()`` with its CUDA type name.

    An instance attribute shadows the ``Tensor.type`` method for these objects only (``type`` is a
    non-data descriptor); ``torch.Tensor`` itself is not modified and the attributes are removed
    on exit.
    """
    marked = []
    try:
        for p in params:
            if p.device.type != "cpu" or "type" in vars(p):
                continue
            name = _cuda_type_name(p)

            def reported(dtype: Any = None, non_blocking: bool = False, _p: Any = p, _n: str = name, **kw: Any) -> Any:
                if dtype is None and not kw:
                    return _n
                return torch.Tensor.type(_p, dtype, non_blocking, **kw)

            p.type = reported  # type: ignore[method-assign]
            marked.append(p)
        yield
    finally:
        for p in marked:
            del p.type


def _dist_opt_init_with_type_names(orig: Callable[..., None]) -> Callable[..., None]:
    # megatron-core 0.16.1: DistributedOptimizer.__init__ (and _build_model_and_main_param_groups,
    # which it calls) raise TypeError unless param.type() is 'torch.cuda.{Float,Half,BFloat16}Tensor'.
    # Can go when Megatron dispatches on param.dtype instead.
    @functools.wraps(orig)
    def __init__(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        with _params_report_cuda_type(params):
            orig(self, optimizer, *args, **kwargs)

    return __init__


def _make_cpu_clip_grad_by_total_norm_fp32(orig: Callable[..., None]) -> Callable[..., None]:
    # megatron-core 0.16.1: clip_grad_by_total_norm_fp32 asserts grad.type() ==
    # 'torch.cuda.FloatTensor' and scales with multi_tensor_applier (no Apex on CPU: a Python
    # loop of dst.copy_(src * scale)).  The same product in place, without the assertion, for CPU
    # gradients; anything else goes to Megatron's own function.  Can go when the assertion checks
    # dtype instead of the CUDA type name.
    @functools.wraps(orig)
    def clip_grad_by_total_norm_fp32(parameters: Any, max_norm: Any, total_norm: float, use_decoupled_grad: bool = False) -> None:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        grads = [getattr(p, attr, None) for p in params]
        grads = [g.detach() for g in grads if g is not None]
        if any(g.device.type != "cpu" for g in grads):
            return orig(parameters, max_norm, total_norm, use_decoupled_grad)
        for g in grads:
            if g.dtype not in (torch.float32, torch.bfloat16):
                raise TypeError(f"clip_grad_by_total_norm_fp32: gradient dtype {g.dtype} (expected float32)")
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if clip_coeff < 1.0:
            for g in grads:
                g.copy_(g * clip_coeff)
        return None

    return clip_grad_by_total_norm_fp32


# --- the patch registry and the scoped handle ---------------------------------------------------------

_MISSING = object()


@dataclass
class _Patch:
    owner: Any
    name: str
    original: Any


@dataclass
class _ShimState:
    """The process's applied patches and how many live :class:`CpuShim` handles hold them."""

    holders: int = 0
    patches: list[_Patch] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def set(self, owner: Any, name: str, value: Any) -> None:
        self.patches.append(_Patch(owner, name, owner.__dict__.get(name, _MISSING) if isinstance(owner, type)
                                   else getattr(owner, name, _MISSING)))
        setattr(owner, name, value)

    def restore_all(self) -> None:
        for patch in reversed(self.patches):
            if patch.original is _MISSING:
                with contextlib.suppress(AttributeError):
                    delattr(patch.owner, patch.name)
            else:
                setattr(patch.owner, patch.name, patch.original)
        self.patches.clear()


_STATE = _ShimState()


class CpuShim:
    """A live hold on the CPU shim; :meth:`undo` releases it (idempotent).

    The patches are installed when the first handle is taken and every replaced attribute is
    restored when the last live handle is released.  Use as a context manager for a scope.
    """

    def __init__(self) -> None:
        self._live = True

    @property
    def live(self) -> bool:
        """Whether this handle still holds the shim."""
        return self._live

    def undo(self) -> None:
        """Release this hold; the last release restores every attribute the shim replaced."""
        with _STATE.lock:
            if not self._live:
                return
            self._live = False
            _STATE.holders -= 1
            if _STATE.holders == 0:
                _STATE.restore_all()
                logger.debug("megatron-core CPU shim undone")

    def __enter__(self) -> "CpuShim":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.undo()


def cpu_shim_applied() -> bool:
    """Whether some live :class:`CpuShim` handle holds the shim in this process."""
    return _STATE.holders > 0


def _install() -> None:
    """Install every patch (called with the lock held, by the first handle)."""
    if MEGATRON_CORE_VERSION not in TESTED_VERSIONS:
        logger.warning(
            "megatron-core %s: the hdp CPU shim was tested with %s only",
            MEGATRON_CORE_VERSION,
            ", ".join(TESTED_VERSIONS),
        )
    st = _STATE
    proxy = _TorchProxy()
    for modname in _PROXIED_MODULES:
        mod = importlib.import_module(modname)
        st.set(mod, "torch", proxy)

    # megatron-core 0.16.1: initialize_rng_tracker() instantiates the module-level name
    # CudaRNGStatesTracker, whose add/fork use CUDA generator states; the CPU subclass tracks the CPU
    # generator.  A tracker built before the shim is dropped so the next seeding builds a CPU one.
    # Can go when Megatron's tracker takes the generator's device as an argument.
    rnd = tensor_parallel.random
    st.set(rnd, "CudaRNGStatesTracker", _CpuRNGStatesTracker)
    st.set(rnd, "_CUDA_RNG_STATE_TRACKER", None)
    st.set(rnd, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", False)

    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    dopt = distrib_optimizer.DistributedOptimizer
    st.set(dopt, "__init__", _dist_opt_init_with_type_names(dopt.__init__))
    # optimizer.py imported clip_grad_by_total_norm_fp32 by name, so both bindings are replaced.
    cpu_clip = _make_cpu_clip_grad_by_total_norm_fp32(clip_grads.clip_grad_by_total_norm_fp32)
    st.set(clip_grads, "clip_grad_by_total_norm_fp32", cpu_clip)
    st.set(optimizer, "clip_grad_by_total_norm_fp32", cpu_clip)

    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    # megatron-core 0.16.1: moe_utils imports te_general_gemm inside a try block and never binds it
    # when TransformerEngine is missing, so RouterGatingLinearFunction raises NameError on
    # ``te_general_gemm is not None``.  Binding it to None selects the plain torch matmul path.
    # Can go when megatron-core binds the name in its except branch.
    if not hasattr(moe_utils, "te_general_gemm"):
        st.set(moe_utils, "te_general_gemm", None)

    # megatron-core 0.16.1: the alltoall dispatcher turns its split sizes into host numpy arrays
    # with maybe_move_tensor_to_cpu(t, as_numpy=True), which only converts *CUDA* tensors; on CPU
    # they stay tensors and all_to_all_single rejects them.  On CPU only the numpy conversion is
    # needed.  token_dispatcher imported the function by name: both bindings are replaced.  Can go
    # when the helper converts host tensors too.
    orig_move = moe_utils.maybe_move_tensor_to_cpu

    @functools.wraps(orig_move)
    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy() if as_numpy else tensor
        return orig_move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    st.set(moe_utils, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)
    st.set(token_dispatcher, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)
    logger.debug("megatron-core %s CPU shim applied (%d patches)", MEGATRON_CORE_VERSION, len(st.patches))


def apply_cpu_shim(device: torch.device | str) -> CpuShim | None:
    """Take a hold on the CPU shim for ``device``; ``None`` (and no change) for CUDA or NPU.

    Returns a :class:`CpuShim` handle; call its :meth:`~CpuShim.undo` (or use it as a context
    manager) when Megatron no longer runs on CPU in this process.  Take it before building any
    Megatron model, DDP wrapper or optimizer.
    """
    if torch.device(device).type != "cpu":
        return None
    with _STATE.lock:
        if _STATE.holders == 0:
            _install()
        _STATE.holders += 1
    return CpuShim()


# --- pipeline communication of variable-length micro-batches ------------------------------------------


class HdpP2PCommunicator(P2PCommunicator):
    """Megatron's pipeline communicator whose shape exchange pairs messages like its data exchange.

    Why: with ``variable_seq_lengths`` megatron-core 0.16.1 sends each micro-batch's shape first,
    always through ``batch_isend_irecv`` in the order [send_prev, recv_prev, send_next, recv_next].
    With two stages the previous and the next stage are the same rank, and a call that moves both
    directions (the interleaved schedule's ``send_forward_backward_recv_forward_backward``) then pairs
    the forward shape with the backward one: the stages receive each other's shapes swapped (seen
    on gloo; NCCL orders point-to-point messages per peer the same way).  Megatron's non-batched data
    path (``_p2p_ops``, used with ``batch_p2p_comm=False``) avoids that for two stages by sending one
    direction over another group; this communicator exchanges the shapes the same way.  Any device:
    the shape tensors live on ``device``.  Can go when megatron-core's ``_communicate_shapes`` takes
    the ``_p2p_ops`` path (or distinct tags) for two stages.  :meth:`expect_shapes` skips the
    exchange altogether when the caller knows every micro-batch's shape (1F1B), and
    :meth:`expect_interleaved_shapes` for the interleaved schedule.
    """

    def __init__(self, pp_group: Any, config: Any, device: torch.device | str) -> None:
        super().__init__(pp_group=pp_group, config=config)
        self.device = torch.device(device)
        self._known: tuple[collections.deque, collections.deque] | None = None

    def expect_shapes(self, shapes: Sequence[Sequence[int]] | None, *, forward_only: bool = False) -> None:
        """Shapes every stage sends, one per micro-batch in schedule order (``None``: exchange them).

        With the non-interleaved 1F1B schedule a stage receives its forward inputs, and its output
        gradients, each in micro-batch order; when every stage knows every micro-batch's shape (hdp's
        plan fixes them), the receiver takes them from here and no shape message is sent.
        """
        if shapes is None:
            self._known = None
            return
        first, last = self.pp_group.rank() == 0, self.pp_group.rank() == self.pp_group.size() - 1
        self._known = (collections.deque([] if first else shapes),
                       collections.deque([] if last or forward_only else shapes))

    def expect_interleaved_shapes(self, shapes: Sequence[Sequence[int]], num_chunks: int, group_size: int, *,
                                  forward_only: bool = False) -> None:
        """Shapes of the interleaved schedule's messages, from each micro-batch's shape (``None`` exchange).

        ``shapes[i]`` is what every stage sends for micro-batch i (all model chunks alike);
        ``num_chunks`` the virtual stages per rank, ``group_size`` Megatron's
        ``microbatch_group_size_per_vp_stage``.  The interleaved schedule runs virtual micro-batch k
        (forward and backward alike) as micro-batch ``table[k]`` of chunk ``chunks[k]`` (reversed in
        backward), and a stage sends, in k order, every forward output except the last chunk's on
        the last stage and every input gradient except the first chunk's on the first stage; the
        receiver takes them in the same order (P2P messages are ordered per peer).  So each stage
        knows what it will receive without a shape message.  ``forward_only``: no gradients move.
        """
        pp, rank = self.pp_group.size(), self.pp_group.rank()
        table = interleaved_schedule(len(shapes), num_chunks, group_size)
        src_fwd, src_bwd = (rank - 1) % pp, (rank + 1) % pp
        fwd = [shapes[mb] for mb, c in table if not (src_fwd == pp - 1 and c == num_chunks - 1)]
        bwd = [] if forward_only else [shapes[mb] for mb, c in table if not (src_bwd == 0 and num_chunks - 1 - c == 0)]
        self._known = (collections.deque(fwd), collections.deque(bwd))

    def unused_shapes(self) -> int:
        """Expected messages not received (0 after a complete schedule, on every stage)."""
        return 0 if self._known is None else len(self._known[0]) + len(self._known[1])

    def _communicate_shapes(self, tensor_send_next: Any, tensor_send_prev: Any, recv_prev: bool,
                            recv_next: bool) -> tuple[list[int], list[int]]:
        if self._known is not None:
            fwd, bwd = self._known
            if (recv_prev and not fwd) or (recv_next and not bwd):
                raise RuntimeError("HdpP2PCommunicator: more receives than expected micro-batch shapes")
            prev = list(fwd.popleft()) if recv_prev else [0, 0, 0]
            nxt = list(bwd.popleft()) if recv_next else [0, 0, 0]
            return prev, nxt

        def shape_of(t: Any) -> torch.Tensor | None:
            return None if t is None else torch.tensor(t.size(), device=self.device, dtype=torch.int64)

        recv_prev_t = torch.empty((3,), device=self.device, dtype=torch.int64) if recv_prev else None
        recv_next_t = torch.empty((3,), device=self.device, dtype=torch.int64) if recv_next else None
        reqs = _p2p_ops(
            tensor_send_prev=shape_of(tensor_send_prev),
            tensor_recv_prev=recv_prev_t,
            tensor_send_next=shape_of(tensor_send_next),
            tensor_recv_next=recv_next_t,
            group=self.pp_group,
            prev_pipeline_rank=self.prev_rank,
            next_pipeline_rank=self.next_rank,
        )
        for req in reqs.values():
            req.wait()
        prev_shape = recv_prev_t.tolist() if recv_prev_t is not None else [0, 0, 0]
        next_shape = recv_next_t.tolist() if recv_next_t is not None else [0, 0, 0]
        return prev_shape, next_shape


def interleaved_schedule(num_microbatches: int, num_chunks: int, group_size: int) -> list[tuple[int, int]]:
    """(micro-batch, model chunk) of every virtual micro-batch of Megatron's interleaved schedule.

    Megatron's ``get_schedule_table``: micro-batches go in groups of ``group_size``; each group runs
    chunk 0 over its micro-batches, then chunk 1, ...; the last group takes the remainder.
    """
    out: list[tuple[int, int]] = []
    for lo in range(0, num_microbatches, group_size):
        hi = num_microbatches if lo + group_size >= num_microbatches else lo + group_size
        out.extend((mb, c) for c in range(num_chunks) for mb in range(lo, hi))
    return out


# --- Megatron's parallel state ---------------------------------------------------------------------


_GENERATION = [0]  # bumped by every initialize_megatron; a runtime tears down only its own state


@dataclass(eq=False)
class MegatronRuntime:
    """What :func:`initialize_megatron` set up: the explicit process groups and the CPU shim hold.

    :meth:`close` releases the shim hold and, if no later :func:`initialize_megatron` replaced
    this one, destroys Megatron's parallel state.
    """

    groups: ProcessGroupCollection
    """Megatron's process groups of this rank, named explicitly (pass them down; never ``None``)."""
    shim: CpuShim | None
    """The CPU shim hold (``None`` on an accelerator)."""
    generation: int
    """Which initialisation this is (internal)."""

    def close(self) -> None:
        """Release the CPU shim hold and this initialisation's Megatron state (idempotent)."""
        if self.generation == _GENERATION[0] and parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
            _forget_parallel_state_groups()
        if self.shim is not None:
            self.shim.undo()


def _forget_parallel_state_groups() -> None:
    """Drop the process groups ``destroy_model_parallel`` leaves in Megatron's module globals.

    megatron-core 0.16.1's ``destroy_model_parallel`` does not reset
    ``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP`` and its gloo twin, so those groups (and their
    transport threads) outlive the parallel state.  Every module-level global of ``parallel_state``
    that still holds a process group is set to ``None``.  Can go when Megatron resets them itself.
    """
    for name, value in list(vars(parallel_state).items()):
        if name.startswith("_") and name.isupper() and isinstance(value, torch.distributed.ProcessGroup):
            setattr(parallel_state, name, None)


def initialize_megatron(
    *,
    device: torch.device | str,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int = 1,
    seed: int = 1234,
    collective_timeout_s: float | None = None,
) -> MegatronRuntime:
    """Initialise Megatron's parallel state over the world: TP × PP × DP, CP = 1.

    hdp supplies context parallelism itself, so Megatron sees data parallelism over the domain
    (the DP×CP ranks of one TP rank and PP stage), plus expert parallelism carved from the
    TP × DP ranks of each stage.  ``torch.distributed`` must be initialised.  ``device`` is
    required: the CPU shim is taken for ``cpu`` only.  Seeds Megatron's RNG tracker.  Returns the
    :class:`MegatronRuntime` (explicit groups, shim hold).  ``collective_timeout_s`` bounds every
    op on the groups Megatron creates (its ``distributed_timeout_minutes``; default 30 min).
    """
    if not torch.distributed.is_initialized():
        raise ValueError("initialize_megatron: torch.distributed is not initialised; call init_process_group first")
    world = torch.distributed.get_world_size()
    tp, pp, ep = tensor_model_parallel_size, pipeline_model_parallel_size, expert_model_parallel_size
    for name, value in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp),
                        ("expert_model_parallel_size", ep), ("expert_tensor_parallel_size", expert_tensor_parallel_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"initialize_megatron: {name}={value!r}: pass a positive integer")
    if world % (tp * pp):
        raise ValueError(f"initialize_megatron: TP {tp} x PP {pp} must divide the world size {world}")
    if (world // pp) % (ep * expert_tensor_parallel_size):
        raise ValueError(
            f"initialize_megatron: expert_model_parallel_size={ep} x expert_tensor_parallel_size="
            f"{expert_tensor_parallel_size} must divide the {world // pp} ranks of a pipeline stage"
        )
    shim = apply_cpu_shim(device)
    try:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
            context_parallel_size=1,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=expert_tensor_parallel_size,
            **({} if collective_timeout_s is None else {"distributed_timeout_minutes": collective_timeout_s / 60.0}),
        )
        manual_seed(seed)
        groups = ProcessGroupCollection.use_mpu_process_groups()
    except BaseException:
        if shim is not None:
            shim.undo()
        raise
    _GENERATION[0] += 1
    return MegatronRuntime(groups=groups, shim=shim, generation=_GENERATION[0])


def checkpoint_writers_die_with_parent() -> None:
    """Make the helper process of Megatron's checkpoint writer die with this rank (Linux).

    megatron-core 0.16.1's ``FileSystemWriterAsync`` collects write results through a queue of a
    ``multiprocessing`` Manager it *spawns* on first use and keeps for the life of the process; a
    rank killed during a save leaves that server behind as an orphan.  This starts the manager
    first, with :func:`hdp.procs.die_with_parent` as its initializer, and hands its queue to
    Megatron (its module-level ``_results_queue``).  The forked write workers are covered by
    ``hdp.trainer.checkpoint.writers_die_with_parent``.  Idempotent.
    """
    import multiprocessing as mp
    import os
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from hdp.procs import die_with_parent

    if getattr(filesystem_async, "_results_queue", None) is not None:
        return
    manager = SyncManager(ctx=mp.get_context("spawn"))
    manager.start(initializer=die_with_parent, initargs=(os.getpid(),))
    filesystem_async._results_queue = manager.Queue()
    _WRITER_MANAGER.append(manager)  # keep it alive with the process


_WRITER_MANAGER: list[Any] = []


def release_ddp(ddp: Any) -> None:
    """Let a Megatron DDP wrapper be freed: drop the gradient-accumulator nodes it keeps.

    megatron-core 0.16.1 ``DistributedDataParallel`` registers its backward hook on each
    parameter's ``AccumulateGrad`` node and keeps the node in ``grad_accs``: node -> hook -> DDP ->
    node is a cycle through C++ that Python's garbage collector cannot see, so a DDP wrapper (its
    model, its process groups and their transport threads) lives as long as the process.  Dropping
    the list frees the nodes (parameters hold them weakly) and with them the cycle.  The wrapper
    no longer reduces gradients afterwards: call it only when its engine closes.
    """
    accs = getattr(ddp, "grad_accs", None)
    if isinstance(accs, list):
        accs.clear()


def stop_checkpoint_writer() -> None:
    """Stop the helper process :func:`checkpoint_writers_die_with_parent` started (idempotent); the
    next dist save starts a new one."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    while _WRITER_MANAGER:
        manager = _WRITER_MANAGER.pop()
        filesystem_async._results_queue = None
        manager.shutdown()


def megatron_groups() -> ProcessGroupCollection:
    """Megatron's process groups of this rank, read once from its parallel state.

    For callers whose Megatron was initialised elsewhere (verl's Megatron engine, Megatron-Bridge):
    hdp's builders take the groups explicitly, never ``None``.
    """
    if not parallel_state.model_parallel_is_initialized():
        raise ValueError("megatron_groups: Megatron's parallel state is not initialised (initialize_megatron)")
    return ProcessGroupCollection.use_mpu_process_groups()


def manual_seed(seed: int) -> None:
    """Seed torch and Megatron's named RNG states (data-, tensor- and expert-parallel)."""
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_megatron() -> None:
    """Tear down Megatron's parallel state (before ``destroy_process_group``); CPU shim holds are
    released separately (:meth:`MegatronRuntime.close`, :meth:`CpuShim.undo`)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()


# --- MoE names for hdp.moe (appended for the zero-memory MoE layer) -------------------------------
# hdp.moe.ZeroMemoryMoELayer subclasses Megatron's MoELayer (same parameters and state-dict names,
# only the expert path's forward/backward differ) and its tests/bench build standalone MoE layers
# from the local spec with build_module.  Private module paths, so they live here.
from megatron.core.transformer.moe.moe_layer import MoELayer  # noqa: E402
from megatron.core.transformer.spec_utils import build_module  # noqa: E402

__all__ += ["MoELayer", "build_module", "cpu_checkpoint_rng"]


@contextlib.contextmanager
def cpu_checkpoint_rng() -> Iterator[None]:
    """While active, Megatron's activation checkpointing (``tensor_parallel.checkpoint``) runs on CPU.

    Why: megatron-core 0.16.1 ``CheckpointFunction`` saves and restores the CUDA RNG state through
    ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state``, which call
    ``torch.cuda.random.get_rng_state`` and raise on a CPU-only build.  On CPU there is no CUDA RNG
    to restore (the CPU generator and Megatron's tracker states are restored separately by
    ``_get_all_rng_states``), so inside this context the two functions take/return an empty state.
    Used by ``hdp.trainer.bench_moe`` for Megatron's full ``moe`` recompute baseline.  Scoped (the
    originals come back on exit), and a no-op when CUDA is available.  Re-check when upgrading.
    """
    rnd = tensor_parallel.random
    if _device.cuda_available():
        yield
        return
    orig_get, orig_set = rnd._get_cuda_rng_state, rnd._set_cuda_rng_state
    rnd._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    rnd._set_cuda_rng_state = lambda *args, **kwargs: None
    try:
        yield
    finally:
        rnd._get_cuda_rng_state, rnd._set_cuda_rng_state = orig_get, orig_set
