"""``python -m benchmarks NAME``: this project's CI-only benchmarks and fault scenarios, outside the wheel.

Run from a checkout's root (``benchmarks`` imports as a package there; pytest puts the root on its path):
``attention``, ``exact``, ``moe``, ``faults``, ``nodes`` and, where verl is installed, ``verl``,
``verl-old-logprob`` and ``models``, each printing a table or one JSON object with ``--json``; ``regress`` is
``hdp bench regress --preset ci`` (every benchmark in a short mode against ``benchmarks/ci_baseline.json``).
What users run on their own job stays in the package: ``hdp bench train|regress|device|planner|memory``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import math
import sys
from collections.abc import Sequence
from typing import Any

from hdp.trainer.cli.common import (CliError, Parser, _console, _emit_json, _flatten, _fmt_s, _print_dict,
                                    positive_int, seed_int)
from hdp.trainer.cli.bench import _bench_parser, _run_entry_point

__all__ = ["main", "build_parser", "VERL_BENCHES"]

VERL_BENCHES = {"verl": ("benchmarks.verl.bench", "bench_verl"),
                "verl-old-logprob": ("benchmarks.verl.bench_old_log_prob", "bench_verl_old_logprob"),
                "models": ("benchmarks.verl.bench_models", "bench_models")}
"""The verl benches: name -> (module, runner); each module's ``add_arguments(parser)`` adds the runner's flags."""


def add_attention(sub: Any) -> argparse.ArgumentParser:
    p = _bench_parser(sub, "attention", "CP attention kernels: forward + backward of one causal sequence", _bench_attention)
    p.add_argument("--ranks", type=positive_int, default=2, help="gloo ranks (default 2)")
    p.add_argument("--tokens", type=positive_int, default=8192, help="tokens of the sequence (default 8192)")
    p.add_argument("--algo", default="ring", choices=("ring", "allgather"), help="CP attention (default ring)")
    return p


def add_exact(sub: Any) -> argparse.ArgumentParser:
    p = _bench_parser(sub, "exact", "hdp against the exact optimum (branch and bound) on small instances", _bench_exact)
    p.add_argument("--instances", type=positive_int, default=20, help="random small instances (default 20)")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the instances (default 0)")
    return p


def add_moe(sub: Any) -> argparse.ArgumentParser:
    p = _bench_parser(sub, "moe", "MoE zero-memory: memory and time of the expert path", _bench_moe)
    p.add_argument("--ep", type=positive_int, default=2, help="expert parallel size (default 2)")
    p.add_argument("--seq-length", type=positive_int, default=None, dest="seq_length",
                   help="sample length packed per rank (default 2048; shorter = more MoE-heavy steps)")
    p.add_argument("--system-malloc", action="store_true", dest="system_malloc",
                   help="glibc's default malloc instead of reusing freed memory like a GPU allocator")
    p.add_argument("--experts", default="sequential,te_grouped", metavar="A,B",
                   help="expert kinds side by side: sequential (SequentialMLP), te_grouped (TEGroupedMLP's grouped "
                        "GEMMs) (default both)")
    p.add_argument("--smoke", action="store_true", help="the smallest mode: a tiny MoE, one timed step (seconds; "
                                                        "checks that it runs, its figures are not the benchmark's)")
    return p


def add_faults(sub: Any) -> argparse.ArgumentParser:
    p = _bench_parser(sub, "faults", "fault injection: every rank raises, nothing hangs, state unchanged", _bench_faults)
    p.add_argument("--only", default=None, metavar="A,B", help="scenarios to run (default all)")
    p.add_argument("--timeout", type=float, default=10.0, help="the engines' collective timeout in s (default 10)")
    return p


def add_nodes(sub: Any) -> argparse.ArgumentParser:
    p = _bench_parser(sub, "nodes", "CP rings on 4 gloo ranks emulating two nodes with a slow link: node-aware vs "
                                    "node-blind plans, step time and losses", _bench_nodes)
    p.add_argument("--steps", type=positive_int, default=7, help="steps per engine, the first untimed (default 7)")
    p.add_argument("--link-us", type=float, default=None, dest="link_us",
                   help="microseconds a ring exchange between the emulated nodes takes at least (default the "
                        "cpu-gloo profile's, hdp.packing.profiles.CPU_NODE_LINK_US)")
    return p


def _bench_attention(args: argparse.Namespace) -> int:
    from benchmarks.attention import bench_attention

    result = dict(bench_attention(ranks=args.ranks, tokens=args.tokens, algo=args.algo))
    if args.json:
        _emit_json(result)
        return 0
    _print_dict(result, f"attention benchmark: {args.algo}, {args.ranks} ranks, {args.tokens} tokens")
    return 0


def _bench_exact(args: argparse.Namespace) -> int:
    from hdp.packing.exact import optimum_gaps

    result = optimum_gaps(instances=args.instances, seed=args.seed)
    if args.json:
        _emit_json(result)
        return 0
    _print_dict({k: v for k, v in result.items() if k != "gaps"},
                "hdp vs exact optimum (branch and bound), T(hdp)/T(opt) - 1")
    return 0


def _bench_moe(args: argparse.Namespace) -> int:
    from benchmarks.moe import SMOKE, bench_moe

    shape = dict(SMOKE) if args.smoke else {}
    if args.seq_length:
        shape["seq_length"] = args.seq_length
    kinds = tuple(k.strip() for k in args.experts.split(",") if k.strip())
    bad = [k for k in kinds if k not in ("sequential", "te_grouped")]
    if not kinds or bad or len(set(kinds)) != len(kinds):
        raise CliError(f"--experts={args.experts!r}: choose distinct kinds among sequential, te_grouped")
    shape["experts"] = kinds
    result = bench_moe(ep=args.ep, caching_malloc=not args.system_malloc, **shape)
    if args.json:
        _emit_json(result)
    else:
        _print_dict(_flatten(result), f"MoE zero-memory benchmark, EP={args.ep}")
    return 0


def _bench_faults(args: argparse.Namespace) -> int:
    from benchmarks.faults import SCENARIOS, run_faults

    only = tuple(s.strip() for s in (args.only or "").split(",") if s.strip()) or None
    for name in only or ():
        if name not in SCENARIOS:
            raise CliError(f"--only: scenario={name!r} is unknown; choose from: {', '.join(SCENARIOS)}")
    if not (args.timeout == args.timeout and 1.0 <= args.timeout <= 3600.0):  # NaN-safe
        raise CliError(f"--timeout={args.timeout}: pass seconds in [1, 3600] (the engines' collective timeout)")
    result = run_faults(timeout_s=args.timeout, only=only)
    if args.json:
        _emit_json(result)
    else:
        from rich.table import Table

        con = _console()
        table = Table(title=f"injected faults (collective timeout {args.timeout:g} s)")
        for col in ("fault", "ranks raised", "died", "s to exit", "state unchanged", "ok"):
            table.add_column(col)
        for r in result["faults"]:
            table.add_row(r["fault"], str(r["ranks_raised"]), str(r["ranks_died"]), f"{r['seconds_to_exit']:.2f}",
                          str(r["state_unchanged"]), "yes" if r["ok"] else "NO")
        con.print(table)
        for name, ok in result["checks"].items():
            con.print(f"{name}: {'yes' if ok else 'NO'}")
    return 0 if result["ok"] else 1


def _bench_nodes(args: argparse.Namespace) -> int:
    """``python -m benchmarks nodes``: median step time of node-aware and node-blind plans, side by side, and their losses."""
    from benchmarks.nodes import NodesBenchSpec, bench_nodes

    try:
        spec = NodesBenchSpec(steps=args.steps, **({} if args.link_us is None else {"link_us": args.link_us}))
    except ValueError as exc:
        raise CliError(f"bench nodes: {exc}") from exc
    if not math.isfinite(spec.link_us) or spec.link_us < 0:
        raise CliError(f"--link-us={args.link_us}: pass microseconds >= 0")
    from hdp.trainer.launch import check_local_capacity

    check_local_capacity(spec.ranks)
    result = bench_nodes(spec)
    if args.json:
        _emit_json(result)
        return 0
    n = result["nodes"]
    _print_dict({"median step, node-aware": _fmt_s(n["median_step_s"]["node-aware"]),
                 "median step, node-blind": _fmt_s(n["median_step_s"]["node-blind"]),
                 "node-blind / node-aware (measured, timed steps' wall seconds)": f"{n['blind_over_aware']:.3f}",
                 "node-blind / node-aware (cost model)": f"{n['predicted_blind_over_aware']:.3f}",
                 "cross-node ring traffic, aware / blind": f"{n['cross_node_fraction']['node-aware']:.0%} / "
                                                           f"{n['cross_node_fraction']['node-blind']:.0%}",
                 "largest relative loss difference": f"{n['max_loss_rel_diff']:.2e}"},
                f"two emulated nodes of {n['spec']['ranks_per_node']} ranks, {n['spec']['link_us']:g} us per ring "
                "exchange between them")
    return 0


def _add_verl(sub: Any, name: str) -> None:
    module, runner = VERL_BENCHES[name]

    def run(args: argparse.Namespace) -> int:
        mod = importlib.import_module(module)
        return _run_entry_point(name, getattr(mod, runner), args)

    p = _bench_parser(sub, name, f"{name} (needs verl: pip install -e '.[verl]')", run)
    if importlib.util.find_spec("verl") is not None:
        importlib.import_module(module).add_arguments(p)


def _regress(sub: Any) -> None:
    """``regress``: listed here; `main` hands it to ``hdp bench regress --preset ci`` with its flags."""
    sub.add_parser("regress", help="hdp bench regress --preset ci: every benchmark in a short mode against "
                                   "benchmarks/ci_baseline.json (its flags pass through)", add_help=False)


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m benchmarks``."""
    parser = Parser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for add in (add_attention, add_exact, add_moe, add_faults, add_nodes):
        add(sub)
    for name in VERL_BENCHES:
        _add_verl(sub, name)
    _regress(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one CI benchmark; its exit code (2 and one ``error:`` line for bad input)."""
    from hdp.trainer.quiet import quiet_third_party_warnings

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["regress"]:
        from hdp.trainer.cli import main as hdp_main

        return int(hdp_main(["bench", "regress", "--preset", "ci", *argv[1:]]) or 0)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse usage errors (already printed) and --help
        return int(exc.code or 0) if not isinstance(exc.code, str) else 2
    quiet_third_party_warnings()
    if not logging.getLogger().handlers:
        logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except (CliError, ValueError, TypeError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
