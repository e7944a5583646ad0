"""Named hardware profiles and model presets, and how they become a `CostModel`.

A hardware profile holds physical parameters (achieved attention throughput, CP link bandwidth
and latency, per-step overheads); a model preset holds the model's shape (linear coefficient a,
layers, attention and K/V widths).  `cost_model()` turns a pair into token² units:

* one unit = ``6 * n_layers * d_attn`` FLOPs (forward + backward attention of one token pair row),
  so ``unit_time_s = 6 * n_layers * d_attn / (attn_tflops * 1e12)``;
* a ring step moves the K/V block of L/k tokens in the forward pass and K/V plus dK/dV in the
  backward pass: ``3 * kv_elems * dtype_bytes * n_layers`` bytes per token per ring step;
* the per-step latency and fixed overhead are paid once per layer and pass (forward, backward).

Numbers are public figures or deliberate, documented assumptions; `calibrate()` replaces them with
values fitted from measured runs on your hardware.
"""

from __future__ import annotations

from dataclasses import dataclass

from hdp.packing.cost import CostModel

__all__ = ["HardwareProfile", "ModelPreset", "PROFILES", "MODELS", "get_profile", "get_model", "cost_model"]


@dataclass(frozen=True, kw_only=True)
class HardwareProfile:
    """Physical parameters of one accelerator and its context-parallel link."""

    name: str
    """Preset name used on the command line."""
    attn_tflops: float
    """Achieved (not peak) attention throughput per rank, TFLOP/s."""
    link_gbps: float
    """Unidirectional bandwidth of one ring hop, GB/s."""
    link_latency_us: float
    """Latency of one point-to-point ring transfer, microseconds (hidden behind compute)."""
    step_overhead_us: float
    """Un-hidable fixed cost per ring step per layer and pass: launches, sync, small kernels."""
    round_overhead_ms: float
    """beta: fixed cost of one round (micro-batch): launches, grad accumulation, bubbles."""
    source: str
    """Where the figures come from."""


@dataclass(frozen=True, kw_only=True)
class ModelPreset:
    """Shape of a model as the cost model needs it."""

    name: str
    """Preset name used on the command line."""
    linear_coef: float
    """a ~ N_active_params / (n_layers * d_attn)."""
    n_layers: int
    """Transformer layers."""
    attn_dim: int
    """Query heads x query/key head dim (attention FLOPs per token pair are 4 * attn_dim)."""
    kv_elems: int
    """K plus V elements per token per layer that a ring step moves."""
    dtype_bytes: int = 2
    """Bytes per element on the wire (bf16)."""
    source: str = ""
    """Where the figures come from."""


PROFILES: dict[str, HardwareProfile] = {
    p.name: p
    for p in (
        HardwareProfile(
            name="ascend-910b-hccs",
            attn_tflops=120.0,
            link_gbps=56.0,
            link_latency_us=20.0,
            step_overhead_us=25.0,
            round_overhead_ms=15.0,
            source=(
                "Ascend 910B: ~313 TFLOP/s bf16 peak, ~40% achieved in attention (assumption); "
                "HCCS full mesh inside a node, 56 GB/s per peer link (Huawei 910B spec sheets); "
                "HCCL P2P latency and per-step launch costs are assumptions to be calibrated"
            ),
        ),
        HardwareProfile(
            name="h100-nvlink",
            attn_tflops=450.0,
            link_gbps=450.0,
            link_latency_us=8.0,
            step_overhead_us=10.0,
            round_overhead_ms=5.0,
            source=(
                "H100 SXM: 989 TFLOP/s bf16 dense peak, FlashAttention-3 reaches ~45% in bwd+fwd; "
                "NVLink 4: 900 GB/s bidirectional per GPU (NVIDIA datasheet); NCCL P2P latency "
                "~8 us (nccl-tests); launch cost an assumption to be calibrated"
            ),
        ),
        HardwareProfile(
            name="cpu-gloo",
            attn_tflops=0.03,
            link_gbps=2.0,
            link_latency_us=150.0,
            step_overhead_us=300.0,
            round_overhead_ms=20.0,
            source=(
                "2-core x86 CPU, one intra-op thread per process, torch fp32 blocked attention "
                "(~30 GFLOP/s measured order of magnitude); gloo over loopback TCP; replace with "
                "`calibrate()` on records from `hdp bench train`"
            ),
        ),
    )
}

MODELS: dict[str, ModelPreset] = {
    m.name: m
    for m in (
        ModelPreset(
            name="qwen3-235b-a22b",
            linear_coef=28_600.0,
            n_layers=94,
            attn_dim=64 * 128,
            kv_elems=2 * 4 * 128,
            source="Qwen3-235B-A22B config: 94 layers, 64 Q heads, 4 KV heads, head dim 128, 22B active",
        ),
        ModelPreset(
            name="deepseek-v3",
            linear_coef=24_700.0,
            n_layers=61,
            attn_dim=128 * 192,
            kv_elems=128 * (192 + 128),
            source=(
                "DeepSeek-V3 config: 61 layers, 128 heads, MLA qk head dim 192 (128+64 rope), "
                "v head dim 128, 37B active; ring CP moves decompressed K/V"
            ),
        ),
        ModelPreset(
            name="dense-8b",
            linear_coef=53_000.0,
            n_layers=32,
            attn_dim=32 * 128,
            kv_elems=2 * 8 * 128,
            source="Llama-3-8B config: 32 layers, 32 Q heads, 8 KV heads, head dim 128",
        ),
        ModelPreset(
            name="cpu-tiny",
            linear_coef=2_000.0,
            n_layers=2,
            attn_dim=4 * 64,
            kv_elems=2 * 4 * 64,
            dtype_bytes=4,
            source="the CPU demo GPT (hidden 256, 4 heads of 64, 2 layers, fp32); a is fitted by calibrate",
        ),
    )
}


def get_profile(name: str | HardwareProfile) -> HardwareProfile:
    """Look up a hardware profile by name; raise ValueError naming the known ones."""
    if isinstance(name, HardwareProfile):
        return name
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(
            f"profile={name!r} is unknown; choose one of: {', '.join(sorted(PROFILES))}"
        ) from None


def get_model(name: str | ModelPreset) -> ModelPreset:
    """Look up a model preset by name; raise ValueError naming the known ones."""
    if isinstance(name, ModelPreset):
        return name
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(
            f"model={name!r} is unknown; choose one of: {', '.join(sorted(MODELS))} "
            "(or pass a number as the linear coefficient)"
        ) from None


def cost_model(
    model: str | ModelPreset | float = "deepseek-v3",
    profile: str | HardwareProfile = "h100-nvlink",
) -> CostModel:
    """Build a `CostModel` (token² units) from a model preset (or a bare coefficient) and a profile.

    With a bare number for ``model`` the shape of ``dense-8b`` is used for the conversion of
    communication costs, and the number replaces its linear coefficient.
    """
    hw = get_profile(profile)
    if isinstance(model, (int, float)) and not isinstance(model, bool):
        if model < 0:
            raise ValueError(f"linear_coef={model}: must be >= 0")
        base = MODELS["dense-8b"]
        spec = ModelPreset(
            name=f"a={model:g}", linear_coef=float(model), n_layers=base.n_layers,
            attn_dim=base.attn_dim, kv_elems=base.kv_elems, dtype_bytes=base.dtype_bytes,
        )
    else:
        spec = get_model(model)
    unit_time_s = 6.0 * spec.n_layers * spec.attn_dim / (hw.attn_tflops * 1e12)
    passes = 2.0  # one ring pass in forward, one in backward, per layer
    bytes_per_token = 3.0 * spec.kv_elems * spec.dtype_bytes * spec.n_layers
    return CostModel(
        linear_coef=spec.linear_coef,
        round_cost=hw.round_overhead_ms * 1e-3 / unit_time_s,
        step_overhead=passes * spec.n_layers * hw.step_overhead_us * 1e-6 / unit_time_s,
        step_latency=passes * spec.n_layers * hw.link_latency_us * 1e-6 / unit_time_s,
        comm_per_token=bytes_per_token / (hw.link_gbps * 1e9) / unit_time_s,
        unit_time_s=unit_time_s,
    )
