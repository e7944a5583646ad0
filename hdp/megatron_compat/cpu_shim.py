"""The scoped CPU shim: every patch hdp applies to Megatron-core so it runs on CPU with gloo.

See :mod:`hdp.megatron_compat` for how the patches work.  Applied only for a CPU device
(:func:`apply_cpu_shim`); the first live handle installs the patches, the last one undone puts
every replaced attribute back.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from hdp import device as _device
from hdp.megatron_compat.names import MEGATRON_CORE_VERSION, TESTED_VERSIONS, tensor_parallel

__all__ = ["CpuShim", "apply_cpu_shim", "cpu_shim_applied", "cpu_shim_places", "cpu_checkpoint_rng"]

logger = logging.getLogger(__name__)

_CUDA = "cuda"

# Megatron modules whose global ``torch`` gets the CPU proxy, with the CUDA calls each one makes
# on the paths hdp runs (megatron-core 0.16.1).  Each entry can go when megatron-core takes the
# device from its inputs there (none of them does as of 0.16.1).
_PROXIED_MODULES: dict[str, str] = {
    # RotaryEmbedding.get_emb moves inv_freq to torch.cuda.current_device() on the first forward
    # (hit with position_embedding_type="rope"; hdp's own model uses "none").
    "megatron.core.models.common.embeddings.rotary_pos_embedding": "RoPE inv_freq device",
    # YarnRotaryEmbedding.__init__ builds its inv_freq on torch.cuda.current_device() (hit by every MLA layer
    # with rope_type="yarn"; hdp replaces the module after building, see hdp.core.mla).
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding": "MLA YaRN inv_freq device",
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
    # DotProductAttention.__init__: the softmax_offset of softmax_type off-by-one / learnable is created on
    # torch.cuda.current_device() (hdp's tests use the local attention as the reference for sinks).
    "megatron.core.transformer.dot_product_attention": "local attention's softmax_offset device",
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
# only with load-balancing losses tracked).

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


def _no_fuser(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Megatron's ``jit_fuser`` decorator as the identity (see :func:`_install`)."""
    return fn


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


def cpu_shim_places() -> list[tuple[Any, str]]:
    """``(owner, attribute)`` of every attribute the shim has replaced in this process (none when not applied):
    what a scan for other patches (the verl integration's, ``hdp.integrations.verl.patches.installed``) leaves out."""
    with _STATE.lock:
        return [(p.owner, p.name) for p in _STATE.patches]


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

    from megatron.core.transformer.moe import grouped_gemm_util

    from hdp.kernels.grouped_gemm import GmmNamespace

    # megatron-core 0.16.1: GroupedMLP (moe_grouped_gemm=True on the local spec) asserts that the
    # grouped_gemm package imports and calls its ops.gmm, a CUDA-only extension.  On CPU torch's
    # grouped_mm serves those calls: grouped_gemm_util's module names are bound to
    # hdp.kernels.grouped_gemm's gmm (same signature, differentiable), only when the package is
    # absent.  Can go when Megatron's GroupedMLP calls torch's grouped_mm itself.
    if getattr(grouped_gemm_util, "grouped_gemm", None) is None:
        st.set(grouped_gemm_util, "grouped_gemm", GmmNamespace)
        st.set(grouped_gemm_util, "ops", GmmNamespace.ops)

    from megatron.core.transformer.moe import experts

    # megatron-core 0.16.1: GroupedMLP wraps its activation in jit_fuser, i.e. torch.compile; on CPU
    # that compiles with inductor's C++ backend at the first call (32 s measured for a 4-expert layer)
    # and again for every new row count (3 s each), for an elementwise function, and the fused kernel
    # rounds bfloat16 differently from eager.  In the experts module only, jit_fuser is the identity:
    # eager runs the same math.  Can go when Megatron lets the caller switch the fuser off per device.
    st.set(experts, "jit_fuser", _no_fuser)

    from megatron.core.extensions import transformer_engine as te_extension
    from megatron.core.transformer import multi_latent_attention

    # megatron-core 0.16.1: multi_latent_attention sets HAVE_TE from an import of
    # megatron.core.extensions.transformer_engine, which succeeds without TransformerEngine (it builds its classes
    # on a MagicMock then), so MultiLatentAttention.__init__ calls isinstance(self.linear_proj, TELinear) with a
    # mock and raises TypeError.  Without TransformerEngine HAVE_TE is False there too (the fp8 branch it guards
    # needs TransformerEngine).  Can go when multi_latent_attention reads the extension's own HAVE_TE.
    if multi_latent_attention.HAVE_TE and not te_extension.HAVE_TE:
        st.set(multi_latent_attention, "HAVE_TE", False)
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



@contextlib.contextmanager
def cpu_checkpoint_rng() -> Iterator[None]:
    """While active, Megatron's activation checkpointing (``tensor_parallel.checkpoint``) runs on CPU.

    Why: megatron-core 0.16.1 ``CheckpointFunction`` saves and restores the CUDA RNG state through
    ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state``, which call
    ``torch.cuda.random.get_rng_state`` and raise on a CPU-only build.  On CPU there is no CUDA RNG
    to restore (the CPU generator and Megatron's tracker states are restored separately by
    ``_get_all_rng_states``), so inside this context the two functions take/return an empty state.
    Every CPU step of both engines runs inside it (the round core, :class:`hdp.core.rounds.RoundCore`, enters
    it around Megatron's schedule: recompute and MoE zero-memory checkpoint there), and ``python -m benchmarks moe``'s full
    ``moe`` recompute baseline.  Scoped (the originals come back on exit), and a no-op when CUDA is available.  Re-check when upgrading.
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
