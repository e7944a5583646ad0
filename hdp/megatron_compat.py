"""The one compat module for Megatron-core: private imports and the CPU shim.

Every private (or version-sensitive) Megatron-core name that hdp uses is imported here and nowhere
else, and :func:`apply_cpu_shim` holds every patch hdp applies to Megatron-core.  The shim is the
minimum that lets megatron-core run a GPT model, DDP and the distributed optimizer on CPU with gloo;
it is applied only when the run's device is CPU (:func:`apply_cpu_shim` is a no-op for any other device),
so nothing changes on CUDA or NPU.

Tested with megatron-core 0.16.1 (torch 2.13 CPU build).  Each patch says what it fixes and the
versions it was checked against; re-check the list when upgrading (``tests/test_megatron_model.py``
fails loudly when a new hard-coded CUDA call is hit).

How the patches work
--------------------
* **Module-scoped torch proxy** (:class:`_TorchProxy`): in the handful of Megatron modules listed in
  :data:`_PROXIED_MODULES`, the module global ``torch`` is replaced by a proxy that forwards every
  attribute to the real ``torch`` except ``torch.cuda`` (a CPU stand-in: ``current_device()`` is
  ``"cpu"``, streams and events are no-ops) and the tensor factories (``torch.tensor``,
  ``torch.zeros``, ...), whose ``device="cuda"`` argument becomes ``"cpu"``.  The real ``torch``
  module is never modified, and code outside those modules is unaffected.
* **CPU RNG tracker** (:class:`_CpuRNGStatesTracker`): Megatron's ``CudaRNGStatesTracker`` keeps
  CUDA generator states; on CPU it tracks the CPU generator instead.
* **Distributed checkpointing**: ``dist_checkpointing`` (re-exported here) runs on CPU through the
  two proxied ``dist_checkpointing.strategies`` modules below; its torch_dist writer also needs
  ``psutil`` and starts a ``multiprocessing`` Manager and forked writers, so the calling process
  must not be daemonic.
* **``Tensor.type()`` names**: the distributed optimizer and grad clipping dispatch on
  ``param.type() == 'torch.cuda.FloatTensor'``; during those calls only, CPU tensors report the
  ``torch.cuda.*`` name of the same dtype.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
from typing import Any, Callable, Iterator

import torch

# --- Megatron-core names hdp uses (public and private), imported in this module only ------------
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec

from hdp import device as _device

__all__ = [
    "MEGATRON_CORE_VERSION",
    "TESTED_VERSIONS",
    "apply_cpu_shim",
    "cpu_shim_applied",
    "initialize_megatron",
    "destroy_megatron",
    "manual_seed",
    "dist_checkpointing",
    "parallel_state",
    "tensor_parallel",
    "DistributedDataParallel",
    "DistributedDataParallelConfig",
    "GPTModel",
    "get_gpt_layer_local_spec",
    "OptimizerConfig",
    "get_megatron_optimizer",
    "PackedSeqParams",
    "TransformerConfig",
    "AttnMaskType",
    "MegatronModule",
    "ModuleSpec",
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
# on the paths hdp runs (megatron-core 0.16.1).
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
    # get_grad_norm_fp32 / clip_grad_by_total_norm_fp32: device='cuda' literals (hit by step()).
    "megatron.core.optimizer.clip_grads": "grad-norm device literals",
    # utils.local_multi_tensor_l2_norm, the no-Apex grad-norm fallback get_grad_norm_fp32 calls:
    # result tensor created with device="cuda" (hit by step()).
    "megatron.core.utils": "grad-norm fallback device literal",
    # TopKRouter.gating moves weight/bias to torch.cuda.current_device() (hit by every MoE forward).
    "megatron.core.transformer.moe.router": "MoE router device",
    # MoEAlltoAllTokenDispatcher: class-level torch.cuda.Stream() and current_stream()/stream()
    # around the device-to-host copy of the split sizes (hit by every alltoall dispatch).
    "megatron.core.transformer.moe.token_dispatcher": "MoE split sizes stream",
    # mappings: gather / all-to-all outputs on torch.cuda.current_device(); the alltoall dispatcher
    # gathers tokens-per-expert (split sizes) over the EP group and all-to-alls tokens with them.
    "megatron.core.tensor_parallel.mappings": "MoE split-size gathers and EP all-to-all buffers",
    # transformer.utils.get_default_causal_mask: torch.ones(sq, sq, device="cuda"), used by
    # Megatron's local DotProductAttention (hdp's tests use it as the reference).
    "megatron.core.transformer.utils": "local attention causal-mask device literal",
    # forward_backward_no_pipelining / _with_interleaving: total_num_tokens = torch.zeros(...,
    # device="cuda") (hit by every get_forward_backward_func() call; hdp's verl engine runs it).
    "megatron.core.pipeline_parallel.schedules": "schedule token-count device literal",
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

_shim_applied = False


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


def _install_cpu_rng_tracker() -> None:
    # megatron-core 0.16.1: initialize_rng_tracker() instantiates the module-level name
    # CudaRNGStatesTracker; pointing that name at the CPU subclass covers force_reset too.
    rnd = tensor_parallel.random
    rnd.CudaRNGStatesTracker = _CpuRNGStatesTracker
    if rnd._CUDA_RNG_STATE_TRACKER is not None and not isinstance(rnd._CUDA_RNG_STATE_TRACKER, _CpuRNGStatesTracker):
        rnd.initialize_rng_tracker(force_reset=True)


# --- Tensor.type() names ----------------------------------------------------------------------------

_ORIG_TENSOR_TYPE = torch.Tensor.type


def _cuda_named_type(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
    if dtype is None and not kwargs and self.device.type == "cpu":
        name = _ORIG_TENSOR_TYPE(self)
        return name.replace("torch.", "torch.cuda.", 1) if name.startswith("torch.") else name
    return _ORIG_TENSOR_TYPE(self, dtype, non_blocking, **kwargs)


@contextlib.contextmanager
def _cuda_type_names() -> Iterator[None]:
    """While active, CPU tensors report ``torch.cuda.<T>Tensor`` from ``.type()``."""
    prev = torch.Tensor.type
    torch.Tensor.type = _cuda_named_type  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.type = prev  # type: ignore[method-assign]


def _with_cuda_type_names(fn: Callable[..., Any]) -> Callable[..., Any]:
    if getattr(fn, "_hdp_cpu_wrapped", False):
        return fn

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _cuda_type_names():
            return fn(*args, **kwargs)

    wrapper._hdp_cpu_wrapped = True  # type: ignore[attr-defined]
    return wrapper


def _patch_type_checks() -> None:
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    # megatron-core 0.16.1: DistributedOptimizer.__init__ and _build_model_and_main_param_groups
    # raise TypeError unless param.type() is 'torch.cuda.{Float,Half,BFloat16}Tensor'.
    dopt = distrib_optimizer.DistributedOptimizer
    dopt.__init__ = _with_cuda_type_names(dopt.__init__)
    # megatron-core 0.16.1: clip_grad_by_total_norm_fp32 asserts grad.type() == 'torch.cuda.FloatTensor';
    # optimizer.py imported it by name, so both bindings are wrapped.
    clip_grads.clip_grad_by_total_norm_fp32 = _with_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    optimizer.clip_grad_by_total_norm_fp32 = clip_grads.clip_grad_by_total_norm_fp32


# --- MoE router without TransformerEngine ------------------------------------------------------------


def _patch_moe_router_gemm() -> None:
    from megatron.core.transformer.moe import moe_utils

    # megatron-core 0.16.1: moe_utils imports te_general_gemm inside a try block and never binds it
    # when TransformerEngine is missing, so RouterGatingLinearFunction raises NameError on
    # ``te_general_gemm is not None``.  Binding it to None selects the plain torch matmul path.
    # (Affects any install without TE; hdp only patches it on CPU, where TE never exists.)
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _patch_moe_split_sizes() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    # megatron-core 0.16.1: the alltoall dispatcher turns its split sizes (input_splits,
    # output_splits) into host numpy arrays with maybe_move_tensor_to_cpu(t, as_numpy=True), which
    # only converts *CUDA* tensors; on CPU they stay tensors and all_to_all_single rejects them
    # ("incompatible function arguments").  On CPU the data is already on the host, so only the
    # numpy conversion is needed.  token_dispatcher imported the function by name: patch both.
    orig = moe_utils.maybe_move_tensor_to_cpu
    if getattr(orig, "_hdp_cpu_wrapped", False):
        return

    @functools.wraps(orig)
    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy() if as_numpy else tensor
        return orig(tensor, as_numpy=as_numpy, record_stream=record_stream)

    maybe_move_tensor_to_cpu._hdp_cpu_wrapped = True  # type: ignore[attr-defined]
    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


# --- entry points -------------------------------------------------------------------------------------


def cpu_shim_applied() -> bool:
    """Whether :func:`apply_cpu_shim` has run in this process."""
    return _shim_applied


def apply_cpu_shim(device: torch.device | str = "cpu") -> bool:
    """Make megatron-core run on CPU; idempotent.  Returns whether the shim is active.

    Does nothing (returns False) for a CUDA or NPU ``device``: the shim must never change
    behaviour there.  Call it before building any Megatron model, DDP wrapper or optimizer.
    """
    global _shim_applied
    if torch.device(device).type != "cpu":
        return False
    if _shim_applied:
        return True
    if MEGATRON_CORE_VERSION not in TESTED_VERSIONS:
        logger.warning(
            "megatron-core %s: the hdp CPU shim was tested with %s only",
            MEGATRON_CORE_VERSION,
            ", ".join(TESTED_VERSIONS),
        )
    proxy = _TorchProxy()
    for modname in _PROXIED_MODULES:
        mod = importlib.import_module(modname)
        if getattr(getattr(mod, "torch", None), "_hdp_cpu_proxy", False):
            continue
        mod.torch = proxy  # type: ignore[attr-defined]
    _install_cpu_rng_tracker()
    _patch_type_checks()
    _patch_moe_router_gemm()
    _patch_moe_split_sizes()
    _shim_applied = True
    logger.debug("megatron-core %s CPU shim applied", MEGATRON_CORE_VERSION)
    return True


def initialize_megatron(
    *,
    expert_model_parallel_size: int = 1,
    seed: int = 1234,
    device: torch.device | str = "cpu",
) -> None:
    """Initialise Megatron's parallel state over the default (domain) group: TP = PP = CP = 1.

    hdp supplies context parallelism itself, so Megatron sees pure data parallelism (plus expert
    parallelism of ``expert_model_parallel_size``).  ``torch.distributed`` must be initialised.
    Applies the CPU shim when ``device`` is CPU, then seeds Megatron's RNG tracker.
    """
    if not torch.distributed.is_initialized():
        raise ValueError("initialize_megatron: torch.distributed is not initialised; call init_process_group first")
    world = torch.distributed.get_world_size()
    if expert_model_parallel_size < 1 or world % expert_model_parallel_size:
        raise ValueError(
            f"expert_model_parallel_size={expert_model_parallel_size}: must divide the world size {world}"
        )
    apply_cpu_shim(device)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        context_parallel_size=1,
        expert_model_parallel_size=expert_model_parallel_size,
    )
    manual_seed(seed)


def manual_seed(seed: int) -> None:
    """Seed torch and Megatron's named RNG states (data-, tensor- and expert-parallel)."""
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_megatron() -> None:
    """Tear down Megatron's parallel state (before ``destroy_process_group``)."""
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
