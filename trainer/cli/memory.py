"""The memory options of ``hdp plan`` and ``hdp simulate``: plan to a per-device memory limit with the
per-rank memory model (`hdp.packing.memory`), and the what-if report of ``hdp plan`` (each round's
predicted peak per rank, and the plan against static CP at the smallest CP size that fits).

``--memory-gb G`` is in GiB (2^30 bytes, `hdp.packing.memory.GB`); ``--shape`` names the model shape
(`hdp.packing.model_shape.SHAPES`; ``--model``, the cost preset, defaults to the preset of that name);
``--layout tp1,pp8,ep16`` its layout, whose domain is ``-N`` and whose PP is the plan's pipeline stages.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hdp.trainer.cli.common import CliError

__all__ = ["add_memory_args", "memory_requested", "MemorySetup", "memory_setup", "derive_budget", "whatif",
           "print_whatif", "round_peaks", "gib", "layout_text"]

MAX_MEMORY_GB = 1 << 20
"""Largest --memory-gb accepted (a device of a PiB is a typo)."""
_FLAGS = {"memory_gb": "--memory-gb", "shape": "--shape", "layout": "--layout", "zero_memory": "--zero-memory",
          "recompute": "--recompute", "cp_algorithm": "--cp-algorithm", "memory_coefficients": "--memory-coefficients",
          "logprobs": "--logprobs"}


def add_memory_args(p: argparse.ArgumentParser) -> None:
    """The memory options (``plan`` and ``simulate``)."""
    from hdp.packing.memory import RECOMPUTE

    from hdp.packing.model_shape import SHAPES

    g = p.add_argument_group("memory (hdp.packing.memory; needs --shape NAME)")
    g.add_argument("--shape", default=None, metavar="NAME",
                   help=f"the model shape whose memory is priced (hdp.packing.model_shape.SHAPES: {', '.join(SHAPES)}); "
                        "--model, the cost preset, defaults to the preset of the same name")
    g.add_argument("--memory-gb", type=float, default=None, metavar="G", dest="memory_gb",
                   help="per-device memory limit in GiB: every round's predicted per-rank peak stays within it and "
                        "B is derived from it (-B then caps the derived budget)")
    g.add_argument("--layout", default=None, metavar="SPEC",
                   help="the model's layout, e.g. tp1,pp8,ep16 (keys tp, pp, vpp, ep, etp; the domain is -N); its PP "
                        "is the plan's pipeline stages; alone (no --memory-gb) plans to -B and reports the peaks")
    g.add_argument("--zero-memory", default=None, choices=("none", "level0", "level1"), dest="zero_memory",
                   help="MoE zero-memory level of the job (default none): the memory model prices it; hdp simulate "
                        "with a given -B and no other memory option also plans with the larger B the level frees")
    g.add_argument("--recompute", default=None, choices=RECOMPUTE,
                   help="activation recompute of the job (default none: the most memory)")
    g.add_argument("--cp-algorithm", default=None, choices=("ring", "allgather"), dest="cp_algorithm",
                   help="CP attention of the job (default ring)")
    g.add_argument("--logprobs", default=None, choices=("logits", "fused"),
                   help="the job's log-prob path (default logits: the most memory): logits — from Megatron's logits "
                        "and their gradient, [T, V/TP] each; fused — from the hidden states and the output weight "
                        "(hdp.fused_logprobs: the library engine's default, verl's use_fused_kernels=True)")
    g.add_argument("--memory-coefficients", default=None, metavar="FILE", dest="memory_coefficients",
                   help="a cost-model file whose memory section (hdp calibrate) holds the fitted coefficients; "
                        "default: the --cost-model file's memory section when it has one, else the formulas as written")


def memory_requested(args: argparse.Namespace, *, besides: tuple[str, ...] = ()) -> bool:
    """Whether any memory option was given (other than the ``besides`` dests)."""
    return any(getattr(args, name, None) is not None for name in _FLAGS if name not in besides)


@dataclass(frozen=True, kw_only=True)
class MemorySetup:
    """The memory model a plan is priced with, its limit and where its coefficients come from."""

    model: Any
    """The `hdp.packing.memory.MemoryModel` of --shape on --layout."""
    limit_bytes: float | None
    """--memory-gb in bytes; None: plan to -B and report the peaks."""
    coefficients_source: str
    """Where the coefficients come from (shown in the output)."""


def memory_setup(args: argparse.Namespace) -> MemorySetup | None:
    """The memory model of the options (None when none is given); sets ``args.pp`` to the layout's PP
    (or 1).  CliError naming the flag, the value and the fix on bad input."""
    if not memory_requested(args):
        args.pp = 1 if args.pp is None else args.pp
        return None
    from hdp.packing.memory import GB, MemoryLayout, MemoryModel
    from hdp.packing.model_shape import SHAPES

    if args.memory_gb is None and args.layout is None:
        given = " ".join(f for n, f in _FLAGS.items() if getattr(args, n, None) is not None)
        raise CliError(f"{given} describe(s) the job's memory but neither --memory-gb G (a per-device limit) nor "
                       "--layout SPEC (the model's layout) is given; add one, e.g. --memory-gb 64 --layout tp1,pp8,ep16")
    limit = None
    if args.memory_gb is not None:
        g = args.memory_gb
        if not math.isfinite(g) or not 0 < g <= MAX_MEMORY_GB:
            raise CliError(f"--memory-gb={g}: pass the per-device memory in GiB, a number in (0, {MAX_MEMORY_GB}] "
                           "(e.g. 64 or 80)")
        limit = g * GB
    shapes = ", ".join(sorted(SHAPES))
    if args.shape is None:
        if getattr(args, "model", None) in SHAPES:  # the shape's flag before 2026-12-04
            raise CliError(f"--memory-gb/--layout need --shape NAME, the model whose memory is priced: --model names "
                           f"the cost preset only since 2026-12-04 (it named the shape before; see CHANGES.md); pass "
                           f"--shape {args.model} instead of --model {args.model}")
        raise CliError(f"--memory-gb/--layout need --shape NAME, the model whose memory is priced: one of {shapes}")
    if args.shape not in SHAPES:
        raise CliError(f"--shape={args.shape!r} is not a model shape of the memory model "
                       f"(hdp.packing.model_shape.SHAPES); choose one of {shapes}")
    if args.ranks is None:
        raise CliError("--memory-gb/--layout need --ranks/-N, the domain the layout's data-parallel size is")
    spec = args.layout or "tp1,pp1"
    extra = {n: getattr(args, n) for n in ("recompute", "zero_memory", "cp_algorithm") if getattr(args, n) is not None}
    if args.logprobs is not None:
        extra["fused_logprobs"] = args.logprobs == "fused"
    try:
        layout = MemoryLayout.parse(spec, domain=args.ranks, **extra)
    except ValueError as exc:
        raise CliError(f"--layout={spec!r} (domain -N {args.ranks}): {exc}") from exc
    if args.pp is not None and args.pp != layout.pp:
        raise CliError(f"--pp={args.pp} but --layout={spec!r} has pp{layout.pp}: the layout sets the pipeline "
                       "stages; drop --pp")
    args.pp = layout.pp
    coef, source = _coefficients(args)
    try:
        model = MemoryModel(shape=SHAPES[args.shape], layout=layout, coef=coef)
    except ValueError as exc:
        raise CliError(f"--layout={spec!r} does not fit --shape={args.shape!r}: {exc}") from exc
    return MemorySetup(model=model, limit_bytes=limit, coefficients_source=source)


def _coefficients(args: argparse.Namespace) -> tuple[Any, str]:
    """The memory coefficients and their source: --memory-coefficients FILE, else the --cost-model file's
    memory section, else the formulas as written."""
    from hdp.packing.cost_file import load_memory_coefficients
    from hdp.packing.memory import MemoryCoefficients

    path = args.memory_coefficients
    if path is not None:
        try:
            coef = load_memory_coefficients(path)
        except ValueError as exc:
            raise CliError(f"--memory-coefficients: {exc}") from exc
        if coef is None:
            raise CliError(f"--memory-coefficients={path!r}: the cost-model file has no memory section; write one with "
                           "hdp calibrate --records R.jsonl --out COST.json from records holding memory records")
        return coef, f"{path} (--memory-coefficients)"
    spec = getattr(args, "cost_model", None)
    if spec and Path(spec).is_file():
        try:
            coef = load_memory_coefficients(spec)
        except ValueError as exc:
            raise CliError(f"--cost-model: {exc}") from exc
        if coef is not None:
            return coef, f"{spec} (the --cost-model file's memory section)"
    return MemoryCoefficients(), "not calibrated (the formulas as written)"


def derive_budget(setup: MemorySetup, lengths: np.ndarray, num_ranks: int, cap: int | None) -> int | None:
    """The token budget B the limit allows (at most ``cap``), or ``cap`` without a limit; CliError naming
    --memory-gb when the static memory or a sample does not fit."""
    if setup.limit_bytes is None:
        return cap
    from hdp.packing.memory import MemoryBudget

    try:
        b = MemoryBudget(model=setup.model, limit_bytes=setup.limit_bytes).check(num_ranks, lengths, "--memory-gb")
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    return b if cap is None else min(b, cap)


def round_peaks(plan: Any, model: Any) -> np.ndarray:
    """[R, N] predicted peak bytes of each domain rank in each round of ``plan``."""
    from hdp.packing.memory import plan_memory, rank_group_sizes

    return plan_memory(plan.stats.tokens_per_rank, rank_group_sizes(plan), model)


def layout_text(layout: Any) -> str:
    """``"tp1,pp8,ep16 (domain 16; recompute none, zero-memory none, CP ring, log-probs from logits)"``."""
    parts = [f"tp{layout.tp}", f"pp{layout.pp}"] + ([f"vpp{layout.vpp}"] if layout.vpp > 1 else []) + [f"ep{layout.ep}"]
    parts += [f"etp{layout.etp}"] if layout.etp > 1 else []
    return ",".join(parts) + f" (domain {layout.domain}; recompute {layout.recompute}, zero-memory {layout.zero_memory}, " \
                             f"CP {layout.cp_algorithm}, log-probs {'fused' if layout.fused_logprobs else 'from logits'})"


def whatif(lengths: np.ndarray, plan: Any, config: Any, setup: MemorySetup, static_cp: int | None) -> dict[str, Any]:
    """The what-if figures of a plan made with a memory model: each round's predicted peak per rank (worst
    and least rank) and group sizes, the longest sample's smallest group, and the plan against static CP at
    the smallest CP size that fits the budget (and the smallest power of two, when different), or at
    ``static_cp`` when given.  Bytes and seconds."""
    from hdp.packing import plan as make_plan
    from hdp.packing.cost import max_rank_tokens, min_group_size

    model, n, b = setup.model, plan.num_ranks, plan.max_tokens_per_rank
    peaks = round_peaks(plan, model)
    rounds = []
    for rnd in plan.rounds:
        sizes: dict[str, int] = {}
        for g in rnd.groups:
            sizes[str(g.size)] = sizes.get(str(g.size), 0) + 1
        rounds.append({"round": rnd.index, "groups": dict(sorted(sizes.items(), key=lambda kv: -int(kv[0]))),
                       "peak_bytes_max": float(peaks[rnd.index].max()), "peak_bytes_min": float(peaks[rnd.index].min())})
    longest = int(np.max(lengths))
    k_any = int(min_group_size(np.asarray([longest]), b, n)[0])
    k_pow2 = int(min_group_size(np.asarray([longest]), b, n, pow2=True)[0])
    per_rank = int(max_rank_tokens(np.asarray([longest]), min(k_any, n))[0])
    sizes_cp = [static_cp] if static_cp is not None else sorted({k_any} | ({k_pow2} if k_pow2 <= n else set()))
    static = []
    for k in sizes_cp:
        cfg = dataclasses.replace(config, policy="static-cp", static_cp_size=k, group_shape="any")
        sp = make_plan(lengths, cfg)
        static.append({
            "cp_size": k, "power_of_two": bool(k & (k - 1) == 0), "rounds": sp.num_rounds,
            "step_time": sp.stats.step_time_s, "time_ratio": sp.stats.step_time_s / plan.stats.step_time_s,
            "peak_bytes": sp.stats.memory["peak_bytes"], "within_limit": sp.stats.memory.get("within_limit"),
        })
    lay = model.layout
    return {
        "model": model.shape.name,
        "layout": layout_text(lay),
        "limit_bytes": setup.limit_bytes,
        "coefficients": model.coef.to_dict(),
        "coefficients_source": setup.coefficients_source,
        "static_bytes": model.worst_static(),
        "token_budget": b,
        "peak_bytes": float(peaks.max()) if peaks.size else model.worst_static(),
        "policy": plan.policy,
        "step_time": plan.stats.step_time_s,
        "longest": {"tokens": longest, "smallest_group": k_any, "smallest_pow2": k_pow2, "tokens_per_rank": per_rank,
                    "peak_bytes": model.peak_bytes(per_rank, k_any)},
        "rounds": rounds,
        "static_cp": static,
    }


def gib(x: float | None) -> str:
    """Bytes as ``"12.3 GiB"`` (``"-"`` for None)."""
    return "-" if x is None else f"{x / (1 << 30):.1f} GiB"


def print_whatif(con: Any, w: dict[str, Any], fmt_s: Any) -> None:
    """The what-if report as rich tables: the memory summary and the plan against static CP (the rounds'
    peaks are columns of ``hdp plan``'s rounds table)."""
    from rich.table import Table

    lim = w["limit_bytes"]
    t = Table(title=f"memory — {w['model']} on {w['layout']}", show_header=False)
    t.add_column("field", style="bold")
    t.add_column("value")
    lg = w["longest"]
    for key, value in (
        ("memory limit", gib(lim) + ("" if lim is not None else " (none: planned to -B)")),
        ("static per rank (worst stage)", gib(w["static_bytes"])),
        ("token budget B", f"{w['token_budget']}" + (" (derived from the limit)" if lim is not None else " (-B)")),
        ("predicted peak (worst rank)", gib(w["peak_bytes"])),
        ("memory coefficients", ", ".join(f"{k} {v:.3g}" for k, v in w["coefficients"].items() if k != "headroom_bytes")
         + f", headroom {gib(w['coefficients']['headroom_bytes'])} — {w['coefficients_source']}"),
        ("longest sample", f"{lg['tokens']} tokens: smallest group CP{lg['smallest_group']} (power of two CP"
                           f"{lg['smallest_pow2']}), {lg['tokens_per_rank']} tokens/rank, {gib(lg['peak_bytes'])} "
                           "with every in-flight round as large"),
    ):
        t.add_row(key, str(value))
    con.print(t)
    s = Table(title="against static CP (same memory limit and budget)")
    for col in ("plan", "rounds", "step time", "T / T(plan)", "peak (worst rank)"):
        s.add_column(col, justify="left" if col == "plan" else "right")
    s.add_row(w["policy"], str(len(w["rounds"])), fmt_s(w["step_time"]), "1.000", gib(w["peak_bytes"]))
    for e in w["static_cp"]:
        s.add_row(f"static CP{e['cp_size']}", str(e["rounds"]), fmt_s(e["step_time"]), f"{e['time_ratio']:.3f}",
                  gib(e["peak_bytes"]))
    con.print(s)
