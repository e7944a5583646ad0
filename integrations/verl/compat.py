"""The one module that reads verl's private parts (0.9.0 and 0.9.1), and the engine-side imports of verl's heavy
modules.

Other modules of :mod:`hdp.integrations.verl` import verl's public API directly (``verl.utils.tensordict_utils``,
``verl.workers.config``, the loss functions, the trainer's config helpers); what is not public lives here, so a verl
upgrade is checked in one place.  Patches — code of verl's (or Hydra's, Megatron's) replaced, for good or for one
call — are not here but in :mod:`hdp.integrations.verl.patches`, each a row of its table.  Importing this module
refuses an unsupported verl (:func:`hdp.integrations.verl.check_verl_version`: ``ImportError`` naming the installed
version, the supported range and the fix), so hdp's engine and config classes never run on one.  Private upstream
state used here, and why:

* ``EngineRegistry._engines`` — read only, to make registration idempotent: verl's
  ``EngineRegistry.register`` asserts on a duplicate key (verl/workers/engine/base.py:389), and the
  entry point may be loaded twice (``import verl`` in the driver and again in a Ray worker that
  imports this module directly).  Can go when verl offers ``is_registered``.
* :func:`without_megatron_strategy_assert` — ``McoreEngineConfig.__post_init__`` asserts
  ``strategy == "megatron"`` (verl/workers/config/engine.py:217); hdp's engine config subclasses it
  and keeps the rest of its validation by running it with the strategy set to ``"megatron"`` for the
  duration of the call (hdp's own config instance; verl's code is unchanged).  Can go when verl drops the
  assert or accepts registered strategies.
* :func:`dispatch_dp_size` — a worker group's cached dispatch info (``_dispatch_info``), reported with stock's DP
  size while verl's trainer balances the batch (the ``_balance_batch`` patch).
* :func:`initialize_model_parallel` — the arguments verl's ``MegatronEngine._init_device_mesh`` passes to
  Megatron's ``initialize_model_parallel``, plus hdp's timeout (the engine builds the groups first; verl's
  ``_init_device_mesh`` then finds them built).
* :func:`mkdir_lock_path` — the lock file verl's ``local_mkdir_safe`` leaves in the temporary directory
  (``verl/utils/fs.py``), removed after a save.  Can go when verl removes its lock files.
* :func:`checkpoint_content_metadata` / :func:`model_sharded_state_dict` — ``MegatronCheckpointManager``'s
  ``_load_content_metadata`` and ``_build_model_sharded_state_dict``, read only: what verl's own load composes
  its sharded state dicts with, so that hdp checks a checkpoint against exactly what verl would load
  (:mod:`hdp.integrations.verl.checkpoint`).  Can go when verl checks a checkpoint before loading it.
* :func:`expose_rope_theta` — ``hf_config.rope_theta`` set from transformers 5's ``rope_parameters`` (verl's
  ``get_hf_rope_theta``) before mbridge's bridge is built, as verl's ``make_megatron_module`` sets it a step later:
  mbridge 0.15's DeepSeek-V3 bridge reads it already in ``_build_config`` (verl's ``_build_tf_config``).  Can go
  when mbridge reads ``rope_parameters``, or verl sets the attribute before building the bridge.
* :class:`MLAConfigNames` / :func:`mbridge_deepseek_v3` — mbridge 0.15's DeepSeek-V3 bridge passes MLA's YaRN
  pretraining length as ``max_position_embeddings``, which megatron-core 0.16's ``MLATransformerConfig`` calls
  ``original_max_position_embeddings`` (``TypeError`` when the bridge builds its config).  The mixin renames the
  keyword; :func:`mbridge_deepseek_v3` registers mbridge's bridge with it under "deepseek_v3" (mbridge's public
  ``register_model``) when mbridge's own class is the one registered.  Can go when mbridge passes the new name.
* :func:`megatron_sees_overrides` — ``McoreEngineConfig.override_transformer_config`` replaced for the duration
  of verl's ``_build_tf_config`` (verl's ``BaseConfig`` freezes set fields): the overrides hdp's fusion flags leave
  for Megatron (:mod:`hdp.integrations.verl.fusions`).  Can go when verl lets an engine filter them.
* :func:`hf_weights` — mbridge's ``_weight_name_mapping_mcore_local_to_global`` and ``_weight_to_hf_format``
  (name and shape mapping, on meta tensors): the Hugging Face names, shapes and dtypes mbridge writes and reads
  for this rank's weights.  Can go with the same verl change, or when mbridge exposes its mapping.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from typing import Any, Iterator

from hdp.integrations.verl import check_verl_version

check_verl_version()  # before any other verl import: an unsupported verl fails here, naming the fix

from verl.trainer.config import CheckpointConfig  # noqa: E402
from verl.workers.config import (  # noqa: E402
    EngineConfig,
    McoreActorConfig,
    McoreCheckpointConfig,
    McoreCriticConfig,
    McoreEngineConfig,
    McoreOptimizerConfig,
    OptimizerConfig,
)

__all__ = [
    "CheckpointConfig",
    "EngineConfig",
    "McoreActorConfig",
    "McoreCheckpointConfig",
    "McoreCriticConfig",
    "McoreEngineConfig",
    "McoreOptimizerConfig",
    "OptimizerConfig",
    "registered_keys",
    "without_megatron_strategy_assert",
    "megatron_sees_overrides",
    "FP32_NAMES",
    "megatron_lm_engine",
    "mindspeed_lm_engine",
    "engine_registry",
    "tensordict_utils",
    "maybe_fix_3d_position_ids",
    "initialize_model_parallel",
    "mkdir_lock_path",
    "dispatch_dp_size",
    "checkpoint_manager",
    "checkpoint_content_metadata",
    "model_sharded_state_dict",
    "hf_weights",
    "expose_rope_theta",
    "MLAConfigNames",
    "mbridge_deepseek_v3",
    "mpu",
    "unwrap_model",
    "causal_mask_type",
    "as_nested",
    "nested_from_flat",
    "tensordict_of",
    "policy_losses_wrapped",
]

logger = logging.getLogger(__name__)


def registered_keys(registry: Any, model_type: str, backend: str) -> set[Any]:
    """Device keys (``"cuda"`` or ``("cuda", vendor)``) already registered for (model_type, backend).

    ``registry``: verl's ``EngineRegistry`` (passed in so that this never imports verl's engines).
    """
    return set(registry._engines.get(model_type, {}).get(backend, {}))


@contextlib.contextmanager
def without_megatron_strategy_assert(config: McoreEngineConfig) -> Iterator[None]:
    """Run ``McoreEngineConfig.__post_init__`` on a config whose strategy is not "megatron".

    Sets ``strategy`` to "megatron" for the duration and restores it after (``object.__setattr__``
    because verl's ``BaseConfig`` freezes set fields).  The same for ``dtype="float32"``, which
    the hdp engine accepts and verl's assert (bf16/fp16 only, verl/workers/config/engine.py:218)
    would reject: it reads as "bfloat16" during the call.
    """
    strategy, dtype = config.strategy, config.dtype
    object.__setattr__(config, "strategy", "megatron")
    if dtype in FP32_NAMES:
        object.__setattr__(config, "dtype", "bfloat16")
    try:
        yield
    finally:
        object.__setattr__(config, "strategy", strategy)
        object.__setattr__(config, "dtype", dtype)


@contextlib.contextmanager
def megatron_sees_overrides(config: McoreEngineConfig, overrides: dict[str, Any]) -> Iterator[None]:
    """``config.override_transformer_config`` reads ``overrides`` for the duration (``object.__setattr__``: verl's
    ``BaseConfig`` freezes set fields); the user's dict comes back after."""
    orig = config.override_transformer_config
    object.__setattr__(config, "override_transformer_config", overrides)
    try:
        yield
    finally:
        object.__setattr__(config, "override_transformer_config", orig)


FP32_NAMES = ("float32", "fp32")
"""``engine.dtype`` spellings of float32 (verl's ``PrecisionType.to_dtype`` reads both)."""


# ---- engine-side imports (heavy: Megatron; only the engine module calls these) --------------------


def megatron_lm_engine() -> type:
    """verl's ``MegatronEngineWithLMHead`` (verl/workers/engine/megatron/transformer_impl.py:1172).

    Imported through the ``verl.workers.engine`` package so that MindSpeed's patches (imported
    there before Megatron's engine, verl/workers/engine/__init__.py:54) keep their order on NPUs.
    """
    import verl.workers.engine as engines

    if engines.MegatronEngineWithLMHead is None:
        raise ImportError("verl's Megatron engine is unavailable (see verl's 'megatron engine is not available' warning)")
    return engines.MegatronEngineWithLMHead


def mindspeed_lm_engine() -> type | None:
    """verl's ``MindspeedEngineWithLMHead`` (NPU), or None when MindSpeed is not installed."""
    import verl.workers.engine as engines

    return engines.MindspeedEngineWithLMHead


def engine_registry() -> Any:
    """``verl.workers.engine.EngineRegistry``."""
    from verl.workers.engine import EngineRegistry

    return EngineRegistry


def tensordict_utils() -> Any:
    """``verl.utils.tensordict_utils`` (non-tensor fields of verl's TensorDict batches)."""
    from verl.utils import tensordict_utils

    return tensordict_utils


def maybe_fix_3d_position_ids(data: Any) -> None:
    """verl's fix of 3-D (multimodal) position ids on a batch, as its engines' ``train_batch`` calls it."""
    from verl.utils.tensordict_utils import maybe_fix_3d_position_ids as fix

    fix(data)


def mpu() -> Any:
    """``megatron.core.parallel_state`` (verl's Megatron engine initialises it)."""
    from megatron.core import parallel_state

    return parallel_state


def initialize_model_parallel(engine_config: Any, timeout_s: float) -> None:
    """Build Megatron's parallel groups as verl's ``MegatronEngine._init_device_mesh`` does
    (``workers/engine/megatron/transformer_impl.py``, verl 0.9.0 and 0.9.1: TP, PP, virtual PP, CP, EP and expert TP
    from ``engine_config``, no SHARP, no NCCL communicator config), each group with ``timeout_s`` seconds instead of
    torch's default 30 minutes: then Megatron's and hdp's collectives of the verl engine (the gradient reduce,
    pipeline sends, the domain's exchanges) give up after ``hdp.collective_timeout_s`` like the library engine's.
    verl's ``_init_device_mesh`` afterwards finds the groups built and keeps them.  Dynamic CP (verl's
    ``extra_args``) is refused by hdp's engine config, so it is never passed."""
    mpu().initialize_model_parallel(
        tensor_model_parallel_size=engine_config.tensor_model_parallel_size,
        pipeline_model_parallel_size=engine_config.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=engine_config.virtual_pipeline_model_parallel_size,
        use_sharp=False,
        context_parallel_size=engine_config.context_parallel_size,
        expert_model_parallel_size=engine_config.expert_model_parallel_size,
        expert_tensor_parallel_size=engine_config.expert_tensor_parallel_size,
        nccl_communicator_config_path=None,
        distributed_timeout_minutes=float(timeout_s) / 60.0,
    )


@contextlib.contextmanager
def dispatch_dp_size(worker_group: Any, mesh: str, dp_size: int) -> Iterator[None]:
    """While active, ``worker_group`` reports ``dp_size`` data-parallel ranks for ``mesh`` to code that
    reads verl's cached dispatch info (``_dispatch_info[mesh]``: the DP rank of every worker; verl's DP
    size is its maximum + 1).  The real mapping is queried first if verl has not cached it yet and is
    restored on exit, so verl's dispatch is unchanged."""
    info = worker_group._dispatch_info
    if mesh not in info:
        info[mesh] = worker_group._query_dispatch_info(mesh)
    real = info[mesh]
    info[mesh] = list(range(dp_size))
    try:
        yield
    finally:
        info[mesh] = real


@contextlib.contextmanager
def policy_losses_wrapped(wrap: Any) -> Iterator[None]:
    """:func:`hdp.integrations.verl.patches.policy_losses_wrapped` (the patch lives there; hdp's loss adapter
    enters it through this name)."""
    from hdp.integrations.verl import patches

    with patches.policy_losses_wrapped(wrap):
        yield


def unwrap_model(chunk: Any) -> Any:
    """The bare GPTModel inside verl's DDP/Float16 wrappers (``verl.utils.megatron_utils.unwrap_model``)."""
    from verl.utils.megatron_utils import unwrap_model as _unwrap

    return _unwrap(chunk)


def causal_mask_type() -> Any:
    """Megatron's ``AttnMaskType.causal``."""
    from megatron.core.transformer.enums import AttnMaskType

    return AttnMaskType.causal


def as_nested(tensors: list[Any]) -> Any:
    """A jagged nested tensor of per-sample tensors (verl's no-padding layout); keeps autograd."""
    import torch

    return torch.nested.as_nested_tensor(tensors, layout=torch.jagged)


def nested_from_flat(values: Any, lengths: Any) -> Any:
    """The jagged nested tensor of samples stored one after another in ``values`` [Σ L_i, ...] with
    ``lengths`` [S] (what `as_nested` makes of ``values.split(lengths)``, without the split and the
    copy); keeps autograd through ``values`` (and its ``values()`` then hands back ``values`` itself:
    `_FlatValues`).  Values that need no gradient (a batch's token ids, outputs
    handed back to verl) are wrapped by torch's jagged tensor class directly (`_jagged_class`): a third of
    the public constructor's time, which goes through the nested-tensor dispatch to record a view."""
    import torch

    lens = torch.as_tensor(lengths, dtype=torch.int64)  # [S]
    offsets = torch.zeros(len(lens) + 1, dtype=torch.int64)
    torch.cumsum(lens, 0, out=offsets[1:])
    # the shortest and longest sample cached, as as_nested_tensor does: TensorDict's to_padded_tensor pads
    # to the cached longest, and to the whole values' length without one
    short, long = (int(lens.min()), int(lens.max())) if len(lens) else (0, 0)
    values, offsets = values.contiguous(), offsets.to(values.device)
    direct = _jagged_class()
    if direct is not None and not values.requires_grad:
        cls, store = direct
        return cls(values, offsets, _metadata_cache={"min_seqlen": store(short), "max_seqlen": store(long)})
    nested = torch.nested.nested_tensor_from_jagged(values, offsets, min_seqlen=short, max_seqlen=long)
    if values.requires_grad:  # values() hands back the flat values themselves (`_FlatValues`)
        nested.values = _FlatValues(values)
    return nested


class _FlatValues:
    """``values()`` of a differentiable jagged tensor made by `nested_from_flat`: the flat values [Σ L_i, ...]
    it views, themselves.  verl's losses read a model output through ``values()`` (``no_padding_2_padding``);
    torch's ``values()`` is a view op of the nested tensor, whose backward runs through the nested-tensor
    dispatch (a quarter of verl's ``ppo_loss`` forward and backward on a few samples).  The same tensor
    without that view: the same data and storage, gradients flow to the same values, and any other op on
    the nested tensor still differentiates through it (both paths add up)."""

    __slots__ = ("flat",)

    def __init__(self, flat: Any) -> None:
        self.flat = flat

    def __call__(self) -> Any:
        return self.flat


@functools.lru_cache(maxsize=None)
def _jagged_class() -> tuple[Any, Any] | None:
    """(torch's jagged ``NestedTensor`` class, its helper storing a cached min/max length) — torch 2.13's
    ``torch.nested._internal.nested_tensor``, what ``nested_tensor_from_jagged`` builds in the end — or
    ``None`` where a torch version lacks them (then the public constructor is used)."""
    try:
        from torch.nested._internal.nested_tensor import NestedTensor, _store_val_in_tensor
    except ImportError:
        return None
    return NestedTensor, _store_val_in_tensor


def tensordict_of(source: dict[str, Any], n: int, device: Any) -> Any:
    """The TensorDict of batch size [n] on ``device`` holding ``source``, whose values are already of
    batch size [n] on that device (built from a batch's own fields): tensordict's ``_new_unsafe``, which
    skips the per-value checks of the constructor (a tenth of its time); the checked constructor where a
    tensordict version lacks it."""
    import torch
    from tensordict import TensorDict

    build = getattr(TensorDict, "_new_unsafe", None) or TensorDict
    return build(source, batch_size=torch.Size([n]), device=device)


def mkdir_lock_path(path: str) -> str:
    """The lock file verl's ``local_mkdir_safe(path)`` (``verl/utils/fs.py``, used once per save by
    ``MegatronCheckpointManager.save_checkpoint`` on its ``local_path``) leaves in the temporary directory and
    never deletes: ``ckpt_<hash of the absolute path>.lock`` (a relative path joined to the working directory, as
    verl does; the hash is this process's)."""
    import tempfile

    path = str(path)
    if not os.path.isabs(path):
        path = os.path.join(os.getcwd(), path)
    return os.path.join(tempfile.gettempdir(), f"ckpt_{hash(path) & 0xFFFFFFFF:08x}.lock")


def checkpoint_manager(engine: Any) -> Any | None:
    """verl's ``MegatronCheckpointManager`` of a Megatron engine (verl 0.9.1 spells the attribute
    ``checkpoint_mananager``); ``None`` for a forward-only engine, for which verl builds none."""
    return getattr(engine, "checkpoint_mananager", None)


def checkpoint_content_metadata(manager: Any, directory: str) -> dict[str, Any]:
    """The content metadata verl's load composes its sharded state dicts with (``_load_content_metadata``: the
    dist checkpoint's own in ``directory``, else verl's default for this engine)."""
    return manager._load_content_metadata(directory)


def model_sharded_state_dict(manager: Any, metadata: dict[str, Any]) -> dict[str, Any]:
    """verl's sharded state dict of the model, every virtual stage keyed as verl saves it
    (``_build_model_sharded_state_dict``; a new dict each call)."""
    return manager._build_model_sharded_state_dict(metadata)


def expose_rope_theta(hf_config: Any) -> None:
    """``hf_config.rope_theta`` from its ``rope_parameters`` (verl's ``get_hf_rope_theta``; module docstring); a
    config with no RoPE base is left as it is (verl's own rule)."""
    from verl.utils.megatron_utils import get_hf_rope_theta

    if hf_config is None or getattr(hf_config, "rope_theta", None) is not None:
        return
    try:
        hf_config.rope_theta = get_hf_rope_theta(hf_config)
    except AttributeError:  # NoPE / hybrid-SSM configs carry no RoPE: verl skips them too
        pass


class MLAConfigNames:
    """Mixin for an mbridge bridge: ``max_position_embeddings`` passed to a config class without that field
    (megatron-core 0.16's ``MLATransformerConfig``) goes under its new name (module docstring)."""

    def _build_base_config(self, text_config_key: Any = None, **kwargs: Any) -> Any:
        import dataclasses

        names = {f.name for f in dataclasses.fields(self.TransformerConfigClass)}  # type: ignore[attr-defined]
        if "max_position_embeddings" in kwargs and "max_position_embeddings" not in names:
            kwargs["original_max_position_embeddings"] = kwargs.pop("max_position_embeddings")
        return super()._build_base_config(text_config_key, **kwargs)  # type: ignore[misc]


def mbridge_deepseek_v3() -> None:
    """Register mbridge's DeepSeek-V3 bridge with :class:`MLAConfigNames` when mbridge's own class is registered
    (not a subclass someone registered, such as the CPU scaffolding's); idempotent."""
    from mbridge.core.bridge import _MODEL_REGISTRY, register_model
    from mbridge.models.deepseek_v3 import DeepseekV3Bridge

    if _MODEL_REGISTRY.get("deepseek_v3") is DeepseekV3Bridge:
        register_model("deepseek_v3")(type("DeepseekV3Bridge", (MLAConfigNames, DeepseekV3Bridge), {}))


def hf_weights(bridge: Any, chunks: Any, tp_size: int, etp_size: int) -> dict[str, tuple[tuple[int, ...], Any]] | None:
    """Hugging Face name -> (shape, dtype) of the weights of this rank's model ``chunks``, as vanilla mbridge writes
    them (``save_weights``: TP shards joined, EP experts by their global index, the vocabulary unpadded, fused QKV
    and gate/up split) and reads them (``load_weights``: the names of every state-dict entry).  Computed on meta
    tensors: no data moves, no collective.  ``None`` when ``bridge`` is not vanilla mbridge (Megatron-Bridge)."""
    import torch

    if not (hasattr(bridge, "_weight_name_mapping_mcore_local_to_global") and hasattr(bridge, "_weight_to_hf_format")):
        return None
    out: dict[str, tuple[tuple[int, ...], Any]] = {}
    for chunk in chunks:
        model = unwrap_model(chunk)
        params = dict(model.named_parameters())
        state = model.state_dict()
        for local, name in bridge._weight_name_mapping_mcore_local_to_global(model).items():
            param = params.get(local)
            tensor = param if param is not None else state[local]
            shape = list(tensor.shape)
            if param is not None and getattr(param, "tensor_model_parallel", False):
                shape[param.partition_dim] *= etp_size if ".mlp.experts." in local else tp_size
            whole = torch.empty(shape, dtype=tensor.dtype, device="meta")
            try:
                names, tensors = bridge._weight_to_hf_format(name, whole)
            except AssertionError:  # a value head under a padded vocabulary: mbridge writes it as it is
                names, tensors = bridge._weight_name_mapping_mcore_to_hf(name)[:1], [whole]
            for hf_name, t in zip(names, tensors):
                out[hf_name] = (tuple(int(n) for n in t.shape), t.dtype)
    return out
