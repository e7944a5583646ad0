"""Named hardware profiles and model presets, and how they become a `CostModel`.

A hardware profile holds physical parameters (achieved attention throughput, CP link bandwidth
and latency, per-step overheads, the per-token work of ring attention); a model preset holds the
model's shape (linear coefficient a, layers, attention and K/V widths).  `cost_model()` turns a
pair into token² units:

* one unit = ``6 * n_layers * d_attn`` FLOPs (forward + backward attention of one token pair row),
  so ``unit_time_s = 6 * n_layers * d_attn / (attn_tflops * 1e12)``;
* a ring step moves the K/V block of L/k tokens in the forward pass and K/V plus dK/dV in the
  backward pass: ``3 * kv_elems * dtype_bytes * n_layers`` bytes per token per ring step;
* the per-step latency and fixed overhead are paid once per layer and pass (forward, backward);
* the per-token ring work (output/LSE merge, dQ/dK/dV accumulation) is memory-bound work on the
  query-width tensors: ``ring_merge_ps_per_elem * d_attn * n_layers`` picoseconds per local token
  per ring step after the first (`CostModel.merge_per_token`), and likewise
  ``cp_split_ps_per_elem`` once per local token of a split sample (`CostModel.cp_per_token`).

**Where the numbers come from.**  ``h100-nvlink`` is derived from one public measurement,
ring-flash-attention's varlen benchmark (`RING_FLASH_ATTENTION_VARLEN`, README of
github.com/zhuzilin/ring-flash-attention, ``benchmark/benchmark_varlen_kvpacked_func.py``):
8 x H800 (the H100 SXM die: same 989 TFLOP/s bf16; NVLink cut to 400 GB/s), Llama-3-8B attention
(32 query heads, 8 K/V heads, head dim 128, bf16, causal), 8,192 tokens per GPU packed as four
cycled layouts, forward + backward: flash_attn_varlen on one GPU ran 225.4 iterations/s,
zigzag_ring_flash_attn_varlen on 8 GPUs (every sequence 8x longer, so every GPU does exactly 8x the
attention work) 21.4 iterations/s, i.e. **0.759** of the single-GPU speed ("theoretic" 225.4 / 8).
From it: the single-GPU time per unit gives ``attn_tflops`` (~247 TFLOP/s in the 6 FLOPs/pair
convention); in the ring the K/V transfer (100 MB per step at 200 GB/s: 0.5 ms) hides behind
2.2-6.7 ms of attention per step, so the 11.2 ms per iteration the ring loses is per-step work:
an assumed 10 us launch/sync cost per step and pass, and the rest, 193 ns per local token per
step (47.2 ps per query-width element, ~158 bytes per element at the H800's 3.35 TB/s HBM), is
``ring_merge_ps_per_elem``.  The same repository's batch-API benchmark (one 64K sequence, no
varlen index work) reached 0.902; we model the varlen path because packed training is varlen.
`tests/unit/packing/test_cost_model.py` checks that ``h100-nvlink`` reproduces 0.76 on the benchmark's layouts.

``ascend-910b-hccs`` has no public ring-attention measurement we know of: its per-token ring work
is the H800 figure scaled by HBM bandwidth (the merge is memory-bound: 3.35 / 1.6 TB/s), the rest
are spec sheets and stated assumptions.  Replace both with ``hdp calibrate`` on your own records.

**Between nodes** every profile has a second link (``node_link_gbps``, ``node_link_latency_us``,
``node_source``): a ring that crosses a node boundary runs each step at the slower one
(`CostModel.node_step_latency`, `CostModel.node_comm_per_token`).  ``h100-nvlink`` (H100/H200 DGX):
NDR InfiniBand, 400 Gb/s per GPU, against NVLink's 450 GB/s one way (9x less); ``ascend-910b-hccs``:
200 GbE RoCE per NPU against HCCS's 56 GB/s per peer; ``cpu-gloo``: what the two-node CPU emulation
adds (`CPU_NODE_LINK_US` per ring exchange).
"""

from __future__ import annotations

from dataclasses import dataclass

from hdp.packing.cost import CostModel

__all__ = [
    "HardwareProfile", "ModelPreset", "PROFILES", "MODELS", "get_profile", "get_model", "cost_model",
    "RING_FLASH_ATTENTION_VARLEN", "CPU_NODE_LINK_US", "DEFAULT_MODEL", "DEFAULT_PROFILE", "DEFAULT_PRESET",
]

DEFAULT_MODEL = "deepseek-v3"
"""The planner's model preset when nothing names one (`hdp plan`, `PlannerConfig`): the benchmark suite's
reference case.  The engines default to their own model (``cost_model="auto"``)."""
DEFAULT_PROFILE = "h100-nvlink"
"""The planner's hardware profile when nothing names one."""
DEFAULT_PRESET = f"{DEFAULT_MODEL}@{DEFAULT_PROFILE}"
"""``MODEL@PROFILE`` of the planner's default cost model (what `cost_model` builds with no arguments)."""

RING_FLASH_ATTENTION_VARLEN: dict = {
    "source": (
        "github.com/zhuzilin/ring-flash-attention README (varlen api, fwd + bwd, 8xH800) and "
        "benchmark/benchmark_varlen_kvpacked_func.py"
    ),
    "ranks": 8,
    "tokens_per_rank": 8192,
    "local_layouts": ((8192,), (256, 7392, 544), (4096, 4096), (3104, 3200, 1600, 160, 128)),
    "num_heads": 32,
    "num_kv_heads": 8,
    "head_dim": 128,
    "single_gpu_iter_per_s": 225.4,
    "ring_iter_per_s": 21.4,
    "hbm_tb_per_s": 3.35,
}
"""The measurement ``h100-nvlink`` is derived from: per-GPU local layouts (every ring sequence is
``ranks`` times the local length), cycled one per iteration; iterations per second of one GPU
running the local layouts with flash-attn and of the 8-GPU zigzag ring (efficiency 21.4 / (225.4 / 8))."""


def _from_ring_flash_attention(step_overhead_us: float) -> tuple[float, float]:
    """(attention TFLOP/s, ring merge ps per query-width element) from `RING_FLASH_ATTENTION_VARLEN`.

    One GPU: sum over layouts of sum l**2 units (causal fwd+bwd, ``6 * d_attn`` FLOPs each) in
    len(layouts) / single_gpu_iter_per_s seconds.  Ring: the same units times ``ranks`` per GPU
    plus, per layout, (ranks - 1) ring steps, each paying ``step_overhead_us`` in the forward and in
    the backward pass and the merge of every local token.
    """
    m = RING_FLASH_ATTENTION_VARLEN
    d_attn = m["num_heads"] * m["head_dim"]
    n_layouts = len(m["local_layouts"])
    units = sum(sum(x * x for x in layout) for layout in m["local_layouts"])
    t_single = n_layouts / m["single_gpu_iter_per_s"]
    unit_s = t_single / units
    tflops = 6.0 * d_attn / unit_s / 1e12
    lost = n_layouts / m["ring_iter_per_s"] - m["ranks"] * t_single  # seconds over all layouts
    steps = n_layouts * (m["ranks"] - 1)
    per_token = (lost / steps - 2.0 * step_overhead_us * 1e-6) / m["tokens_per_rank"]
    return tflops, per_token / d_attn * 1e12


_H100_STEP_US = 10.0
_H100_TFLOPS, _H100_MERGE_PS = _from_ring_flash_attention(_H100_STEP_US)
_ASCEND_HBM_TB_PER_S = 1.6
CPU_NODE_LINK_US = 2000.0
"""Microseconds the CPU emulation of two nodes (`benchmarks.nodes`, outside the wheel) waits on every ring
exchange between ranks of different emulated nodes; ``cpu-gloo``'s inter-node latency is gloo's plus this."""


@dataclass(frozen=True, kw_only=True)
class HardwareProfile:
    """Physical parameters of one accelerator and its context-parallel link."""

    name: str
    """Preset name used on the command line."""
    attn_tflops: float
    """Achieved (not peak) attention throughput per rank, TFLOP/s (6 FLOPs per pair and attention element)."""
    link_gbps: float
    """Unidirectional bandwidth of one ring hop, GB/s."""
    link_latency_us: float
    """Latency of one point-to-point ring transfer, microseconds (hidden behind compute)."""
    step_overhead_us: float
    """Un-hidable fixed cost per ring step per layer and pass: launches, sync, small kernels."""
    round_overhead_ms: float
    """beta: fixed cost of one round (micro-batch): launches, grad accumulation, bubbles."""
    ring_merge_ps_per_elem: float = 0.0
    """Memory-bound ring work per local token per ring step after the first, per query-width element
    (heads x head dim) and layer, forward + backward, picoseconds: output/LSE merge, dQ/dK/dV
    accumulation, small-block kernel efficiency (becomes `CostModel.merge_per_token`)."""
    cp_split_ps_per_elem: float = 0.0
    """Work per local token of a split sample (k >= 2), per query-width element and layer, forward +
    backward, picoseconds: zigzag split/re-assembly, fp32 buffers (becomes `CostModel.cp_per_token`)."""
    source: str
    """Where the figures come from."""
    node_link_gbps: float = 0.0
    """Unidirectional bandwidth per rank of the inter-node link (InfiniBand, RoCE), GB/s: a ring step
    that crosses a node boundary runs at the slower link (`CostModel.node_comm_per_token`); 0: no
    inter-node link known (one level)."""
    node_link_latency_us: float = 0.0
    """Latency of one point-to-point transfer between nodes, microseconds (`CostModel.node_step_latency`)."""
    node_source: str = ""
    """Where the inter-node figures come from."""


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
            ring_merge_ps_per_elem=_H100_MERGE_PS * RING_FLASH_ATTENTION_VARLEN["hbm_tb_per_s"] / _ASCEND_HBM_TB_PER_S,
            source=(
                "Ascend 910B: ~313 TFLOP/s bf16 peak, ~40% achieved in attention (assumption); "
                "HCCS full mesh inside a node, 56 GB/s per peer link, 1.6 TB/s HBM (Huawei 910B spec "
                "sheets); per-token ring work: the ring-flash-attention H800 figure (memory-bound) scaled "
                "by HBM bandwidth 3.35/1.6; HCCL P2P latency and per-step launch costs are assumptions "
                "to be calibrated"
            ),
            node_link_gbps=25.0,
            node_link_latency_us=30.0,
            node_source=(
                "Atlas 800T A2: one 200 GbE RoCE v2 port per NPU (8 x 200GE per server, Huawei spec sheet): "
                "25 GB/s per rank one way; HCCL P2P latency over RoCE ~30 us an assumption to be calibrated"
            ),
        ),
        HardwareProfile(
            name="h100-nvlink",
            attn_tflops=_H100_TFLOPS,
            link_gbps=450.0,
            link_latency_us=8.0,
            step_overhead_us=_H100_STEP_US,
            round_overhead_ms=5.0,
            ring_merge_ps_per_elem=_H100_MERGE_PS,
            source=(
                "H100/H800 SXM: attention throughput (~247 TFLOP/s, flash-attn 2 varlen fwd+bwd) and "
                "per-token ring work (47.2 ps per query element per step) from ring-flash-attention's "
                "8xH800 varlen benchmark (RING_FLASH_ATTENTION_VARLEN; efficiency 0.759 at 8K tokens per "
                "GPU); NVLink 4: 900 GB/s bidirectional per GPU (NVIDIA datasheet); NCCL P2P latency "
                "~8 us (nccl-tests); 10 us launch cost per ring step an assumption to be calibrated"
            ),
            node_link_gbps=50.0,
            node_link_latency_us=15.0,
            node_source=(
                "DGX H100/H200: one ConnectX-7 NDR InfiniBand port per GPU, 400 Gb/s = 50 GB/s per rank one "
                "way (NVIDIA DGX H100 user guide); NCCL P2P latency across nodes ~15 us (nccl-tests order of "
                "magnitude) an assumption to be calibrated"
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
            node_link_gbps=2.0,
            node_link_latency_us=150.0 + CPU_NODE_LINK_US,
            node_source=(
                "the two-node CPU emulation (benchmarks/nodes.py): loopback gloo plus "
                "CPU_NODE_LINK_US of waiting on every ring exchange between emulated nodes"
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
    """Look up a model preset by name: `MODELS`, else the preset derived from a model shape of
    `hdp.packing.model_shape.SHAPES` (`ModelShape.cost_preset`), so that one ``--model`` name serves
    the cost and the memory model; raise ValueError naming the known ones."""
    if isinstance(name, ModelPreset):
        return name
    if name in MODELS:
        return MODELS[name]
    from hdp.packing.model_shape import SHAPES

    if name in SHAPES:
        return SHAPES[name].cost_preset()
    raise ValueError(
        f"model={name!r} is unknown; choose one of: {', '.join(sorted(set(MODELS) | set(SHAPES)))} "
        "(or pass a number as the linear coefficient)"
    )


def cost_model(
    model: str | ModelPreset | float = DEFAULT_MODEL,
    profile: str | HardwareProfile = DEFAULT_PROFILE,
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
    elems = spec.n_layers * spec.attn_dim  # query-width elements per token over all layers
    return CostModel(
        linear_coef=spec.linear_coef,
        round_cost=hw.round_overhead_ms * 1e-3 / unit_time_s,
        step_overhead=passes * spec.n_layers * hw.step_overhead_us * 1e-6 / unit_time_s,
        step_latency=passes * spec.n_layers * hw.link_latency_us * 1e-6 / unit_time_s,
        comm_per_token=bytes_per_token / (hw.link_gbps * 1e9) / unit_time_s,
        merge_per_token=elems * hw.ring_merge_ps_per_elem * 1e-12 / unit_time_s,
        cp_per_token=elems * hw.cp_split_ps_per_elem * 1e-12 / unit_time_s,
        node_step_latency=passes * spec.n_layers * hw.node_link_latency_us * 1e-6 / unit_time_s,
        node_comm_per_token=bytes_per_token / (hw.node_link_gbps * 1e9) / unit_time_s if hw.node_link_gbps > 0 else 0.0,
        unit_time_s=unit_time_s,
    )
