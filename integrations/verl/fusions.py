"""The fusion flags of verl's ``megatron.override_transformer_config`` (Megatron's and MindSpeed's) on the hdp engine.

verl hands ``override_transformer_config`` to Megatron's ``TransformerConfig`` (vanilla mbridge:
``TransformerConfig(**kwargs)``) and, on Ascend, to MindSpeed's ``repatch`` (MindSpeed's fused kernels are
patches of Megatron's modules).  hdp replaces two of the modules those kernels patch — Megatron's RoPE (hdp's
core attention rotates at the sample positions) and, under zero-memory, the experts' activation — so a fusion
flag would not reach them.  :data:`FLAGS` classifies each fusion flag once (a recipe flag is honoured, or a
documented no-op where its device kernel does not exist, never silently dropped), and :func:`resolve` applies it
to one role's overrides:

* ``hdp kernel``: hdp's own RoPE / SwiGLU take the device's fused kernel (:mod:`hdp.kernels.fusions`:
  ``torch_npu.npu_rotary_mul`` / ``npu_swiglu`` on NPU, flash-attn's rotary on CUDA — not run on hardware) and
  the plain form where there is none (CPU: a no-op, same math);
* ``megatron``: Megatron's or MindSpeed's modules that hdp leaves in place fuse it themselves (MindSpeed's keys:
  on NPU, through MindSpeed's patches; on a machine without MindSpeed — CPU, CUDA — they are not fields of
  Megatron's ``TransformerConfig``, which would refuse them, so they are taken out of what Megatron sees and
  logged as a no-op here, naming the device path).

``apply_rope_fusion`` is always taken out of Megatron's config: Megatron's RoPE does not run under hdp, and
Megatron refuses the field without TransformerEngine (megatron-core 0.16.1 ``TransformerConfig.__post_init__``).
Megatron-LM's command-line name ``bias_swiglu_fusion`` is refused, naming megatron-core's field.  Keys not listed
here go to Megatron (and MindSpeed) as verl passes them.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from hdp.kernels import fusions as kernels

__all__ = ["Handling", "FusionFlag", "FLAGS", "ALIASES", "Fusions", "resolve", "describe"]

logger = logging.getLogger(__name__)


class Handling(enum.Enum):
    """What the hdp engine does with one fusion flag (module docstring)."""

    HDP_KERNEL = "hdp kernel"
    """hdp's own RoPE / SwiGLU take the device's fused kernel; the plain form where there is none."""
    MEGATRON = "megatron"
    """Megatron's / MindSpeed's modules, which hdp leaves in place, fuse it themselves."""


@dataclass(frozen=True)
class FusionFlag:
    """One fusion flag of ``override_transformer_config``."""

    mindspeed: bool
    """A MindSpeed argument (not a field of megatron-core's ``TransformerConfig``)."""
    handling: Handling
    """Who honours it under hdp."""
    fusion: kernels.Fusion | None
    """The fusion of hdp's own math it asks for (``hdp kernel``)."""
    does: str
    """What it fuses, and where that runs under hdp."""
    device_path: str
    """The kernel it takes on a device that has one (never run on hardware by hdp's tests)."""


FLAGS: dict[str, FusionFlag] = {
    "apply_rope_fusion": FusionFlag(
        False, Handling.HDP_KERNEL, kernels.Fusion.ROTARY,
        "fused RoPE: hdp's core attention applies RoPE (Megatron's does not run under hdp; taken out of Megatron's "
        "config)", "torch_npu.npu_rotary_mul on NPU, flash-attn's apply_rotary_emb on CUDA"),
    "use_fused_rotary_pos_emb": FusionFlag(
        True, Handling.HDP_KERNEL, kernels.Fusion.ROTARY,
        "MindSpeed's fused RoPE: its patch targets Megatron's RoPE, which does not run under hdp; hdp's RoPE takes "
        "the kernel", "torch_npu.npu_rotary_mul on NPU"),
    "bias_activation_fusion": FusionFlag(
        False, Handling.HDP_KERNEL, kernels.Fusion.SWIGLU,
        "fused SwiGLU: the zero-memory experts' SwiGLU is hdp's; Megatron's MLPs (dense layers, shared experts, "
        "experts without zero-memory) fuse theirs (megatron.core.fusions.fused_bias_swiglu)",
        "torch_npu.npu_swiglu on NPU (zero-memory experts); none on CUDA (the plain form)"),
    "use_fused_swiglu": FusionFlag(
        True, Handling.HDP_KERNEL, kernels.Fusion.SWIGLU,
        "MindSpeed's fused SwiGLU: it patches Megatron's SwiGLU (Megatron's MLPs); the zero-memory experts' SwiGLU "
        "is hdp's, which takes the kernel", "torch_npu.npu_swiglu on NPU"),
    "use_fused_rmsnorm": FusionFlag(
        True, Handling.MEGATRON, None,
        "MindSpeed's fused RMSNorm: its patch of Megatron's RMSNorm (hdp leaves the norms to Megatron)",
        "torch_npu.npu_rms_norm on NPU (MindSpeed)"),
}
"""Every fusion flag of the recipe (docs/verl.md, "The recipe's flags"), classified."""

ALIASES: dict[str, str] = {
    "bias_swiglu_fusion": "bias_activation_fusion",
    "bias_gelu_fusion": "bias_activation_fusion",
}
"""Megatron-LM's command-line names that are not ``TransformerConfig`` fields: refused, naming megatron-core's."""


@dataclass(frozen=True)
class Fusions:
    """One role's fusion flags, resolved (:func:`resolve`)."""

    rope: bool = False
    """hdp's RoPE takes the device's fused kernel."""
    swiglu: bool = False
    """The zero-memory experts' SwiGLU takes the device's fused kernel."""
    megatron_overrides: dict[str, Any] = field(default_factory=dict)
    """``override_transformer_config`` as Megatron (and MindSpeed) should see it."""
    flags: tuple[str, ...] = ()
    """The flags of :data:`FLAGS` set to true, in the overrides' order."""
    dropped: tuple[str, ...] = ()
    """MindSpeed's flags taken out because MindSpeed is not in this process (a no-op here)."""


def _true(value: Any) -> bool:
    return value is True or (isinstance(value, str) and value.strip().lower() == "true") or value == 1


def resolve(overrides: Mapping[str, Any] | None, *, mindspeed: bool, key: str) -> Fusions:
    """The fusion flags of one role's ``override_transformer_config`` (``key`` names it in errors): what hdp's
    kernels take, and the overrides Megatron should see (``mindspeed``: MindSpeed runs in this process and takes its
    own keys).  ``ValueError`` for Megatron-LM's names of :data:`ALIASES`."""
    src = dict(overrides or {})
    for name, field_name in ALIASES.items():
        if name in src:
            raise ValueError(f"{key}.{name}={src[name]!r}: {name} is Megatron-LM's command-line name, not a field of "
                             f"megatron-core's TransformerConfig; set {key}.{field_name} instead")
    out = dict(src)
    rope = swiglu = False
    flags, dropped = [], []
    for name, value in src.items():
        flag = FLAGS.get(name)
        if flag is None:
            continue
        if name == "apply_rope_fusion" or (flag.mindspeed and not mindspeed):
            out.pop(name)
            if flag.mindspeed and not mindspeed and _true(value) and flag.handling is Handling.MEGATRON:
                dropped.append(name)
        if not _true(value):
            continue
        flags.append(name)
        rope |= flag.fusion is kernels.Fusion.ROTARY
        swiglu |= flag.fusion is kernels.Fusion.SWIGLU
    return Fusions(rope=rope, swiglu=swiglu, megatron_overrides=out, flags=tuple(flags), dropped=tuple(dropped))


def describe(resolved: Fusions, device: torch.device, key: str) -> list[str]:
    """One line per flag set: what runs for it on ``device`` (the engine logs them at build)."""
    lines = []
    for name in resolved.flags:
        flag = FLAGS[name]
        if flag.handling is Handling.HDP_KERNEL:
            assert flag.fusion is not None
            kernel, why = kernels.kernel_for(flag.fusion, device)
            here = f"runs {kernel.name}" if kernel is not None else f"the plain form here ({why}; same math)"
        elif name in resolved.dropped:
            here = f"a no-op here: MindSpeed is not installed (on {torch.device(device).type})"
        else:
            here = "passed to MindSpeed"
        lines.append(f"{key}.{name}=True: {flag.does}; {here}; device path: {flag.device_path}")
    return lines
