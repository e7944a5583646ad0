"""``hdp bench moe``: saved-activation bytes and step time of one MoE layer, by recompute mode.

Runs one Megatron MoE layer (all-to-all dispatcher, SwiGLU ``SequentialMLP`` experts) on ``ep``
gloo ranks on CPU, and for each mode -- ``none`` (plain Megatron), ``level0``, ``level1``
(:mod:`hdp.moe`) and ``full_recompute`` (Megatron ``recompute_granularity='selective'``,
``recompute_modules=['moe']``) -- measures

* ``saved_bytes``: bytes of the unique storages autograd saves for backward during the layer's
  forward, counted with ``torch.autograd.graph.saved_tensors_hooks`` (parameters excluded;
  rank 0's figure), and
* ``step_time_s``: best-of-``iters`` forward + backward wall time of the layer (max over ranks per
  iteration; best-of because the machine may be shared), ``step_cpu_s``: median CPU time of the
  process (all its threads, gloo's included; insensitive to other load),
  and ``model_step_time_s``: the same for a whole 2-layer MoE GPT (``hdp.trainer.model``).

All modes use the same weights, input and routing, side by side in one run.
Usage: ``python -m hdp.trainer.bench_moe --ep 2 --json``.
"""

from __future__ import annotations

import argparse
import json as _json
import logging
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["MoEBenchConfig", "build_moe_layer", "moe_transformer_config", "bench_moe", "main"]

logger = logging.getLogger(__name__)

MODES = ("none", "level0", "level1", "full_recompute")


@dataclass(frozen=True, kw_only=True)
class MoEBenchConfig:
    """Shape and repetitions of the MoE benchmark."""

    ep: int = 2
    """Expert-parallel size (= gloo ranks)."""
    tokens: int = 2048
    """Tokens per rank."""
    hidden_size: int = 256
    """H."""
    ffn_hidden_size: int = 512
    """F: expert FFN width (fc1 is 2F wide: SwiGLU)."""
    num_experts: int = 8
    """Experts."""
    topk: int = 2
    """Experts per token."""
    iters: int = 8
    """Timed iterations per mode (after one warm-up)."""
    threads: int = 1
    """torch threads per rank."""
    model_step: bool = True
    """Also time a whole 2-layer MoE GPT forward + backward per mode (``model_step_time_s``)."""

    def __post_init__(self) -> None:
        if self.ep < 1 or self.num_experts % self.ep:
            raise ValueError(f"MoEBenchConfig.ep={self.ep}: must be >= 1 and divide num_experts={self.num_experts}")
        if not 1 <= self.topk <= self.num_experts:
            raise ValueError(f"MoEBenchConfig.topk={self.topk}: must be in [1, {self.num_experts}]")
        if self.tokens < 1 or self.iters < 1:
            raise ValueError("MoEBenchConfig.tokens and .iters: must be >= 1")


def moe_transformer_config(
    *,
    hidden_size: int,
    ffn_hidden_size: int,
    num_experts: int,
    topk: int,
    ep: int,
    gated: bool = True,
    full_recompute: bool = False,
) -> Any:
    """Megatron ``TransformerConfig`` of one MoE layer (SwiGLU when ``gated``), fp32, CPU."""
    import torch.nn.functional as F

    from hdp import megatron_compat as mc

    kwargs: dict[str, Any] = dict(
        num_layers=1,
        hidden_size=hidden_size,
        num_attention_heads=4,
        ffn_hidden_size=ffn_hidden_size,
        add_bias_linear=False,
        gated_linear_unit=gated,
        activation_func=F.silu if gated else F.gelu,
        bias_activation_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        expert_model_parallel_size=ep,
        num_moe_experts=num_experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=ffn_hidden_size,
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_router_dtype="fp32",
        gradient_accumulation_fusion=False,
        init_method_std=0.02,
    )
    if full_recompute:
        kwargs.update(recompute_granularity="selective", recompute_modules=["moe"])
    return mc.TransformerConfig(**kwargs)


def build_moe_layer(config: Any, level: Any = "none") -> Any:
    """A standalone ``ZeroMemoryMoELayer`` (Megatron local spec's MoE submodules) at ``level``."""
    from hdp import megatron_compat as mc
    from hdp.moe import ZeroMemoryMoELayer

    spec = mc.get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    mlp = spec.submodules.mlp
    return ZeroMemoryMoELayer(config=config, submodules=mlp.submodules, zero_memory_level=level)


def _saved_bytes(layer: torch.nn.Module, x: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Unique-storage bytes saved for backward by ``layer(x)`` (parameters excluded); and the output."""
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in params and st.nbytes() > 0:
            seen[ptr] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _ = layer(x)
    return sum(seen.values()), out


def _run(rank: int, world: int, cfg: MoEBenchConfig) -> dict[str, Any]:
    import torch.distributed as dist

    from hdp import megatron_compat as mc
    from hdp.moe import ZeroMemoryLevel

    mc.initialize_megatron(expert_model_parallel_size=cfg.ep, seed=1234)
    shape = dict(hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
                 num_experts=cfg.num_experts, topk=cfg.topk, ep=cfg.ep)
    torch.manual_seed(0)
    layer = build_moe_layer(moe_transformer_config(**shape))
    torch.manual_seed(0)
    full = build_moe_layer(moe_transformer_config(**shape, full_recompute=True))
    full.load_state_dict(layer.state_dict())
    g = torch.Generator().manual_seed(100 + rank)
    x0 = torch.randn(cfg.tokens, 1, cfg.hidden_size, generator=g)  # [s, b, H]
    dy = torch.randn(cfg.tokens, 1, cfg.hidden_size, generator=g)

    def step(mode: str) -> tuple[int, float]:
        mod = full if mode == "full_recompute" else layer
        if mode != "full_recompute":
            layer.set_zero_memory_level(ZeroMemoryLevel(mode))
        for p in mod.parameters():
            p.grad = None
        x = x0.clone().requires_grad_(True)
        dist.barrier(group=dist.group.WORLD)
        t0, c0 = time.perf_counter(), time.process_time()
        nbytes, out = _saved_bytes(mod, x)
        out.backward(dy)
        return nbytes, (time.perf_counter() - t0, time.process_time() - c0)

    saved: dict[str, int] = {}
    times: dict[str, list[float]] = {m: [] for m in MODES}
    cpu: dict[str, list[float]] = {m: [] for m in MODES}
    with mc.cpu_checkpoint_rng():
        for m in MODES:  # warm-up
            saved[m], _ = step(m)
        for _ in range(cfg.iters):
            for m in MODES:  # interleaved so load noise hits every mode alike
                _, (wall, proc) = step(m)
                t = torch.tensor([wall, proc], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=dist.group.WORLD)
                times[m].append(float(t[0]))
                cpu[m].append(float(t[1]))
    model_times = _model_step_times(cfg) if cfg.model_step else None
    mc.destroy_megatron()
    return {"saved_bytes": saved, "times": times, "cpu_times": cpu, "model_times": model_times}


def _model_step_times(cfg: MoEBenchConfig) -> dict[str, list[float]]:
    """Forward + backward time of a 2-layer MoE GPT (``hdp.trainer.model``, gelu experts) per mode.

    Each rank holds ``cfg.tokens`` tokens packed as 4 equal samples (hdp attention); Megatron must be
    initialised with EP = ``cfg.ep``.  Max over ranks per iteration.
    """
    import dataclasses

    import torch.distributed as dist

    from hdp import megatron_compat as mc
    from hdp.moe import apply_zero_memory
    from hdp.trainer.attention_spec import packed_seq_params
    from hdp.trainer.model import ModelConfig, layer_spec, packed_logits, token_logprobs, transformer_config

    vocab = 256
    mcfg = ModelConfig(vocab_size=vocab, hidden_size=cfg.hidden_size, num_layers=2, num_attention_heads=4,
                       num_moe_experts=cfg.num_experts, moe_router_topk=cfg.topk,
                       moe_ffn_hidden_size=cfg.ffn_hidden_size, expert_model_parallel_size=cfg.ep,
                       max_sequence_length=max(cfg.tokens, 16))
    models = {}
    for mode in MODES:
        tcfg = transformer_config(mcfg)
        if mode == "full_recompute":
            tcfg = dataclasses.replace(tcfg, recompute_granularity="selective", recompute_modules=["moe"])
        torch.manual_seed(0)
        model = mc.GPTModel(config=tcfg, transformer_layer_spec=layer_spec(mcfg), vocab_size=vocab,
                            max_sequence_length=mcfg.max_sequence_length, pre_process=True, post_process=True,
                            parallel_output=True, share_embeddings_and_output_weights=False,
                            position_embedding_type="none")
        if mode in ("level0", "level1"):
            apply_zero_memory(model, mode)
        models[mode] = model
    g = torch.Generator().manual_seed(200 + dist.get_rank())
    lengths = [cfg.tokens // 4] * 3 + [cfg.tokens - 3 * (cfg.tokens // 4)]
    tokens = torch.randint(0, vocab, (cfg.tokens,), generator=g)
    targets = torch.roll(tokens, -1)
    psp = packed_seq_params(lengths, torch.device("cpu"))
    times: dict[str, list[float]] = {m: [] for m in MODES}
    with mc.cpu_checkpoint_rng():
        for it in range(cfg.iters + 1):  # the first round is a warm-up
            for mode, model in models.items():
                model.zero_grad(set_to_none=True)
                dist.barrier(group=dist.group.WORLD)
                t0 = time.perf_counter()
                loss = -token_logprobs(packed_logits(model, tokens, psp), targets).mean()
                loss.backward()
                t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=dist.group.WORLD)
                if it > 0:
                    times[mode].append(float(t))
    return times


def _rank_main(rank: int, world: int, port: int, cfg: MoEBenchConfig, results: Any) -> None:
    import datetime
    import traceback

    import torch.distributed as dist

    try:
        torch.set_num_threads(cfg.threads)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=datetime.timedelta(seconds=600))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        out = _run(rank, world, cfg)
        results.put((rank, out, None))
        dist.destroy_process_group()
    except BaseException:
        results.put((rank, None, traceback.format_exc()))
        raise SystemExit(1)


def _spawn(cfg: MoEBenchConfig, timeout: float) -> dict[str, Any]:
    """Run :func:`_run` on ``cfg.ep`` spawned gloo ranks; rank 0's result."""
    import multiprocessing as mp
    import queue

    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, cfg.ep + 1, is_master=True, wait_for_workers=False)
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, cfg.ep, store.port, cfg, results), daemon=True)
             for r in range(cfg.ep)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < cfg.ep:
            try:
                rank, out, err = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty as exc:
                raise TimeoutError(f"bench_moe: ranks did not finish within {timeout:.0f} s") from exc
            if err is not None:
                raise RuntimeError(f"bench_moe rank {rank} failed:\n{err}")
            got[rank] = out
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return got[0]


def bench_moe(
    ep: int = 2,
    *,
    tokens: int = 2048,
    hidden_size: int = 256,
    ffn_hidden_size: int = 512,
    num_experts: int = 8,
    topk: int = 2,
    iters: int = 8,
    threads: int = 1,
    model_step: bool = True,
    json: bool = False,
    timeout: float = 600.0,
) -> dict[str, Any]:
    """Run the benchmark on ``ep`` gloo ranks; return (and with ``json`` print) the result dict.

    Keys: ``saved_bytes`` and ``step_time_s`` ({none, level0, level1, full_recompute}),
    ``freed_fraction_of_full`` ({level0, level1}: (none − level) / (none − full_recompute)),
    ``overhead_vs_none`` ({level0, level1, full_recompute}: time / time(none) − 1), ``step_cpu_s`` and
    ``overhead_cpu_vs_none`` (the same from process CPU time), ``targets``
    (the issue's pass/fail checks, on the layer figures), ``model_step_time_s`` (whole 2-layer MoE
    GPT forward + backward per mode, ``None`` without ``model_step``), ``model_overhead_vs_none``
    and ``config``.
    """
    cfg = MoEBenchConfig(ep=ep, tokens=tokens, hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size,
                         num_experts=num_experts, topk=topk, iters=iters, threads=threads,
                         model_step=model_step)
    raw = _spawn(cfg, timeout)
    saved = raw["saved_bytes"]
    step = {m: min(v) for m, v in raw["times"].items()}  # best of: the machine may be shared
    step_cpu = {m: statistics.median(v) for m, v in raw["cpu_times"].items()}
    full_freed = saved["none"] - saved["full_recompute"]
    freed = {m: (saved["none"] - saved[m]) / full_freed if full_freed > 0 else float("nan")
             for m in ("level0", "level1")}
    costly = ("level0", "level1", "full_recompute")
    overhead = {m: step[m] / step["none"] - 1.0 for m in costly}
    model_step = {m: min(v) for m, v in raw["model_times"].items()} if raw["model_times"] else None
    result: dict[str, Any] = {
        "saved_bytes": saved,
        "step_time_s": step,
        "step_cpu_s": step_cpu,
        "overhead_cpu_vs_none": {m: step_cpu[m] / step_cpu["none"] - 1.0 for m in costly},
        "model_step_time_s": model_step,
        "model_overhead_vs_none": (
            {m: model_step[m] / model_step["none"] - 1.0 for m in ("level0", "level1", "full_recompute")}
            if model_step else None
        ),
        "freed_fraction_of_full": freed,
        "overhead_vs_none": overhead,
        "targets": {
            "level0_frees_ge_60pct_of_full": freed["level0"] >= 0.60,
            "level1_frees_ge_90pct_of_full": freed["level1"] >= 0.90,
            "level0_overhead_le_10pct": overhead["level0"] <= 0.10,
            "level1_overhead_le_10pct": overhead["level1"] <= 0.10,
            "level0_faster_than_full": step["level0"] < step["full_recompute"],
            "level1_faster_than_full": step["level1"] < step["full_recompute"],
        },
        "config": {**cfg.__dict__, "dtype": "float32", "activation": "swiglu", "device": "cpu"},
    }
    if json:
        print(_json.dumps(result))
    return result


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m hdp.trainer.bench_moe [--ep 2] [--json] ...``."""
    p = argparse.ArgumentParser(prog="hdp bench moe", description=__doc__.split("\n\n")[0])
    p.add_argument("--ep", type=int, default=2, help="expert-parallel size (gloo ranks)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--ffn-hidden-size", type=int, default=512)
    p.add_argument("--num-experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--no-model-step", action="store_true", help="skip the whole-model step timing")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    a = p.parse_args(argv)
    res = bench_moe(a.ep, tokens=a.tokens, hidden_size=a.hidden_size, ffn_hidden_size=a.ffn_hidden_size,
                    num_experts=a.num_experts, topk=a.topk, iters=a.iters, threads=a.threads,
                    model_step=not a.no_model_step, json=a.json)
    if not a.json:
        for m in MODES:
            print(f"{m:15s} saved {res['saved_bytes'][m]:>12,d} B   step {res['step_time_s'][m] * 1e3:8.1f} ms")
        print("freed / full-recompute freed:", {k: round(v, 3) for k, v in res["freed_fraction_of_full"].items()})
        print("overhead vs none:", {k: round(v, 3) for k, v in res["overhead_vs_none"].items()})
        if res["model_step_time_s"]:
            print("model step (s):", {k: round(v, 4) for k, v in res["model_step_time_s"].items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
