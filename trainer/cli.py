"""The ``hdp`` command line: plan, simulate, benchmark and calibrate.

Human output uses rich tables; ``--json`` prints exactly one JSON object on stdout (logs and
progress go to stderr).  User errors print ``error: <message>`` to stderr and exit with code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import logging
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["main", "build_parser"]

logger = logging.getLogger("hdp.cli")

ALL_POLICIES = ("hdp", "hdp-pow2", "static-cp", "megatron-dcp", "ascend-hdp", "verl-kk")
CONTRACT_KEYS = (
    "policy", "ranks", "rounds", "step_time", "lower_bound", "efficiency", "max_idle_ratio",
    "cp_degree_hist", "planner_ms",
)
ASCEND_TARGET = 1.39
EFFICIENCY_TARGET = 0.95


class CliError(ValueError):
    """A user error the CLI reports as ``error: ...`` with exit code 2."""


# --------------------------------------------------------------------------------------- helpers


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def _emit_json(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj, default=_json_default) + "\n")
    sys.stdout.flush()


def _console(stderr: bool = False):  # noqa: ANN202 - rich is imported lazily
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else 160  # rich falls back to 80 columns off a terminal
    return Console(stderr=stderr, highlight=False, width=width)


def _fmt_s(seconds: float) -> str:
    if seconds >= 1.0:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"


def _add_batch_args(p: argparse.ArgumentParser, *, required: bool = True) -> None:
    src = p.add_mutually_exclusive_group(required=required)
    src.add_argument("--lengths", metavar="FILE", help="text file with one sample length per line")
    src.add_argument("--workload", metavar="NAME", help="built-in workload generator (see --help-workloads)")
    p.add_argument("--samples", type=int, default=1024, help="samples to draw with --workload (default 1024)")
    p.add_argument("--seed", type=int, default=0, help="seed of --workload (default 0)")


def _add_domain_args(p: argparse.ArgumentParser, *, required: bool = True) -> None:
    p.add_argument("--ranks", "-N", type=int, required=required, help="N: ranks in the domain")
    p.add_argument(
        "--max-tokens-per-rank", "-B", type=int, required=required, dest="max_tokens_per_rank",
        help="B: per-rank token budget of one round",
    )
    p.add_argument("--group-shape", default="any", help="any (contiguous ranges) or pow2 (aligned blocks)")
    _add_cost_args(p)
    p.add_argument("--static-cp", type=int, default=None, dest="static_cp",
                   help="CP size k for static-cp style baselines (default: smallest fitting power of two)")
    p.add_argument("--search-budget", default="default", dest="search_budget", metavar="SPEC",
                   help="hdp: work it may spend beyond its first plan (hdp.packing.SearchBudget): 'default', "
                        "'off' (no local search) or pools, e.g. construct=20000,search=3000000,rivals=65536")
    p.add_argument("--pp", type=int, default=1, dest="pp", metavar="P",
                   help="pipeline stages: the step time counts (P - 1) x the longest round more, and hdp plans for it (default 1)")


def _add_cost_args(p: argparse.ArgumentParser) -> None:
    """--cost-model FILE, or --profile/--model/--linear-coef (a preset pair); not both."""
    p.add_argument("--cost-model", metavar="COST.json", dest="cost_model", default=None,
                   help="cost-model file (hdp calibrate --out); replaces --profile/--model/--linear-coef")
    p.add_argument("--profile", default=None, help="hardware profile (default h100-nvlink)")
    model = p.add_mutually_exclusive_group()
    model.add_argument("--model", default=None, help="model preset (default deepseek-v3)")
    model.add_argument("--linear-coef", type=float, default=None, help="linear coefficient a instead of a preset")


def _check_domain_args(args: argparse.Namespace) -> None:
    """Range checks of --ranks / --max-tokens-per-rank beyond what argparse does (CliError)."""
    from hdp.packing.validate import MAX_LENGTH

    b = getattr(args, "max_tokens_per_rank", None)
    if b is not None and not 1 <= b <= MAX_LENGTH:
        raise CliError(f"--max-tokens-per-rank={b}: the per-rank token budget B must be in [1, {MAX_LENGTH}] (2^40)")
    n = getattr(args, "ranks", None)
    if n is not None and not 1 <= n <= 1 << 24:
        raise CliError(f"--ranks={n}: the domain size N must be in [1, {1 << 24}]")


def _load_lengths(args: argparse.Namespace) -> np.ndarray:
    from hdp.packing.workloads import get_workload, read_lengths

    if args.lengths is not None:
        return read_lengths(args.lengths)
    if args.samples < 1:
        raise CliError(f"--samples={args.samples}: must be >= 1")
    return get_workload(args.workload)(n=args.samples, seed=args.seed)


def _cost(args: argparse.Namespace):  # noqa: ANN202
    """The cost model of --cost-model FILE, or of the --model/--linear-coef and --profile presets."""
    from hdp.packing import cost_model
    from hdp.packing.cost_file import load_cost_model

    if getattr(args, "cost_model", None):
        given = [f for f, v in (("--profile", args.profile), ("--model", args.model),
                                ("--linear-coef", args.linear_coef)) if v is not None]
        if given:
            raise CliError(
                f"--cost-model and {'/'.join(given)} are mutually exclusive: the cost-model file holds every "
                f"parameter; drop {' '.join(given)} (or drop --cost-model to plan with the presets)"
            )
        try:
            return load_cost_model(args.cost_model)
        except ValueError as exc:
            raise CliError(f"--cost-model: {exc}") from exc
    model: Any = args.linear_coef if args.linear_coef is not None else (args.model or "deepseek-v3")
    return cost_model(model, args.profile or "h100-nvlink")


def _config(args: argparse.Namespace, policy: str, cost: Any = None):  # noqa: ANN202
    from hdp.packing import PlannerConfig

    shape = "pow2" if policy == "hdp-pow2" else args.group_shape  # hdp-pow2: hdp on power-of-two groups
    return PlannerConfig(
        num_ranks=args.ranks,
        max_tokens_per_rank=args.max_tokens_per_rank,
        policy="hdp" if policy == "hdp-pow2" else policy,
        group_shape=shape,
        cost=cost if cost is not None else _cost(args),
        static_cp_size=args.static_cp,
        search_budget=args.search_budget,
        pipeline_stages=args.pp,
    )


def _entry(plan: Any, cost: Any) -> dict[str, Any]:
    from hdp.packing.suite import plan_entry

    return plan_entry(plan, cost)


def _hist_text(hist: dict[str, int], top: int = 6) -> str:
    items = list(hist.items())
    if len(items) <= top:
        return " ".join(f"CP{k}:{v}" for k, v in items)
    shown = sorted(sorted(items, key=lambda kv: -kv[1])[:top], key=lambda kv: int(kv[0]))
    return " ".join(f"CP{k}:{v}" for k, v in shown) + f" +{len(items) - top} sizes (max CP{items[-1][0]})"


# ------------------------------------------------------------------------------------------ plan


def _cmd_plan(args: argparse.Namespace) -> int:
    from hdp.packing import plan as make_plan
    from hdp.packing.simulate import simulate

    _check_domain_args(args)
    cost = _cost(args)
    lengths = _load_lengths(args)
    p = make_plan(lengths, _config(args, args.policy, cost))
    p = p.with_stats(simulate(p, cost, p.stats.planner_ms, p.stats.pipeline_stages, tight=True))
    if args.plot:
        from hdp.trainer.gantt import plot_gantt

        plot_gantt(p, cost, args.plot)
        logger.info("wrote %s", args.plot)
    if args.json:
        _emit_json(p.to_dict())
        return 0
    from rich.table import Table

    con = _console()
    s = p.stats.to_dict()
    summary = Table(title=f"hdp plan — policy {p.policy}", show_header=False)
    summary.add_column("field", style="bold")
    summary.add_column("value")
    for key, value in (
        ("samples", p.num_samples), ("ranks N", p.num_ranks), ("budget B", p.max_tokens_per_rank),
        ("rounds (min)", f"{s['rounds']} ({s['min_rounds']})"),
        ("step time T", _fmt_s(s["step_time"])), ("lower bound T*", _fmt_s(s["lower_bound"])),
        ("efficiency", f"{s['efficiency']:.2%}"),
        ("efficiency (tight T*)", f"{s['efficiency_tight']:.2%}" if s.get("efficiency_tight") is not None else "-"),
        ("max idle ratio", f"{s['max_idle_ratio']:.2%}"),
        ("max tokens/rank", s["max_tokens_per_rank"]), ("CP degrees", _hist_text(s["cp_degree_hist"])),
        ("planner", f"{s['planner_ms']:.1f} ms"), ("checksum", p.checksum()),
    ):
        summary.add_row(key, str(value))
    con.print(summary)
    from hdp.packing.simulate import rank_loads

    loads = rank_loads(p, cost) * cost.unit_time_s
    tokens = p.stats.tokens_per_rank
    rounds = Table(title="rounds")
    for col in ("round", "groups", "samples", "max tokens/rank", "round time", "idle ranks"):
        rounds.add_column(col, justify="right" if col != "groups" else "left")
    shown = p.rounds[:50]
    for rnd in shown:
        sizes: dict[int, int] = {}
        for g in rnd.groups:
            sizes[g.size] = sizes.get(g.size, 0) + 1
        covered = sum(g.size for g in rnd.groups)
        rounds.add_row(
            str(rnd.index),
            " ".join(f"CP{k}×{n}" for k, n in sorted(sizes.items(), reverse=True)),
            str(sum(len(g.samples) for g in rnd.groups)),
            str(int(tokens[rnd.index].max())),
            _fmt_s(float(loads[rnd.index].max())),
            str(p.num_ranks - covered),
        )
    con.print(rounds)
    if len(p.rounds) > len(shown):
        con.print(f"... {len(p.rounds) - len(shown)} more rounds (use --json for all)")
    if args.plot:
        con.print(f"Gantt chart: {args.plot}")
    return 0


# -------------------------------------------------------------------------------------- simulate


def _peer_entry(lengths: np.ndarray, config: Any) -> tuple[dict[str, Any] | None, str | None]:
    """The megatron-core reference entry, or (None, note) when it is unavailable."""
    try:
        peers = importlib.import_module("hdp.trainer.peers")
    except ImportError as exc:
        return None, f"megatron-core peer skipped: hdp.trainer.peers unavailable ({exc})"
    fn = getattr(peers, "megatron_core_plan", None)
    if fn is None:
        return None, "megatron-core peer skipped: hdp.trainer.peers has no megatron_core_plan"
    try:
        result = fn(lengths, config)
    except (ImportError, NotImplementedError, ValueError, MemoryError) as exc:
        return None, f"megatron-core peer skipped: {exc}"
    from hdp.packing.plan import Plan
    from hdp.packing.simulate import simulate

    if isinstance(result, Plan):
        p = result if result.stats is not None else result.with_stats(simulate(result, config.cost))
        entry = _entry(p, config.cost)
        # its memory model is per sample: a rank may hold more than B tokens in one of our rounds
        entry["budget_ok"] = bool(p.stats.max_tokens_per_rank <= config.max_tokens_per_rank)
    elif isinstance(result, dict):
        entry = dict(result)
    else:
        return None, f"megatron-core peer skipped: unexpected result type {type(result).__name__}"
    entry["policy"] = "megatron-core"
    return entry, None


def _cmd_simulate(args: argparse.Namespace) -> int:
    if args.suite:
        given = [f for f, v in (("--cost-model", args.cost_model), ("--profile", args.profile),
                                ("--model", args.model), ("--linear-coef", args.linear_coef)) if v is not None]
        if given:
            raise CliError(f"--suite plans every case with its own model and profile; drop {' '.join(given)}")
        return _cmd_suite(args)
    if args.lengths is None and args.workload is None:
        raise CliError("simulate: pass --lengths FILE, --workload NAME, or --suite")
    if args.ranks is None or args.max_tokens_per_rank is None:
        raise CliError("simulate: --ranks and --max-tokens-per-rank are required (or use --suite)")
    from hdp.packing import Policy
    from hdp.packing import plan as make_plan

    policies = [s.strip() for s in args.policies.split(",") if s.strip()]
    if not policies:
        raise CliError("--policies: list at least one policy")
    known = [p.value for p in Policy] + ["hdp-pow2"]
    for name in policies:
        if name not in known:
            raise CliError(f"--policies: policy={name!r} is unknown; choose from: {', '.join(known)}")
    _check_domain_args(args)
    if args.plot_dir and Path(args.plot_dir).exists() and not Path(args.plot_dir).is_dir():
        raise CliError(f"--plot-dir={args.plot_dir!r} is an existing file; name a directory for the Gantt charts")
    cost = _cost(args)
    lengths = _load_lengths(args)
    cases: list[dict[str, Any]] = []
    notes: list[str] = []
    plans = {}
    runs: list[tuple[str, argparse.Namespace]] = [("", args)]
    if args.moe_zero_memory != "none":
        # the same memory holds more tokens when MoE activations are freed: plan with both budgets
        from hdp.moe.budget import MOE_SHAPES, token_budget_with_zero_memory

        if args.moe_shape not in MOE_SHAPES:
            raise CliError(f"--moe-shape={args.moe_shape!r} is unknown; choose from: {', '.join(MOE_SHAPES)}")
        b_zm = token_budget_with_zero_memory(
            args.max_tokens_per_rank, args.moe_zero_memory, MOE_SHAPES[args.moe_shape]
        )
        notes.append(
            f"MoE zero-memory {args.moe_zero_memory} ({args.moe_shape} layer shape): the memory of "
            f"B={args.max_tokens_per_rank} tokens holds B={b_zm}"
        )
        runs.append((f"+{args.moe_zero_memory}", argparse.Namespace(**{**vars(args), "max_tokens_per_rank": b_zm})))
    for suffix, run_args in runs:
        for name in policies:
            config = _config(run_args, name, cost)
            try:
                p = make_plan(lengths, config)
            except (ImportError, NotImplementedError, ValueError, MemoryError) as exc:
                if name == "hdp" and isinstance(exc, ValueError):
                    raise  # bad input: the batch or the config, not a baseline's limit
                reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                cases.append({"policy": name + suffix, "error": reason})
                notes.append(f"{name + suffix} skipped: {reason}")
                logger.warning("%s skipped: %s", name + suffix, reason)
                continue
            plans[name + suffix] = p
            entry = _entry(p, cost)
            entry["policy"] = name + suffix
            entry["max_tokens_per_rank"] = run_args.max_tokens_per_rank
            cases.append(entry)
            if name == "hdp" and run_args.pp > 1:
                # the plan made without the pipeline, scored with it: what knowing PP buys
                from hdp.packing.simulate import simulate

                flat = make_plan(lengths, _config(argparse.Namespace(**{**vars(run_args), "pp": 1}), name, cost))
                flat = flat.with_stats(simulate(flat, cost, flat.stats.planner_ms, run_args.pp))
                plans["hdp-no-pp" + suffix] = flat
                entry = _entry(flat, cost)
                entry["policy"] = "hdp-no-pp" + suffix
                entry["max_tokens_per_rank"] = run_args.max_tokens_per_rank
                cases.append(entry)
    if not args.no_peers:
        peer, note = _peer_entry(lengths, _config(args, policies[0], cost))
        if peer is not None:
            cases.append(peer)
        if note:
            notes.append(note)
            logger.info("%s", note)
    if args.plot_dir:
        from hdp.trainer.gantt import plot_gantt

        out = Path(args.plot_dir)
        out.mkdir(parents=True, exist_ok=True)
        for name, p in plans.items():
            plot_gantt(p, cost, out / f"gantt_{name}.png")
        logger.info("wrote %d Gantt charts to %s", len(plans), out)
    if args.json:
        obj: dict[str, Any] = {"cases": cases, "pipeline_stages": args.pp}
        if notes:
            obj["notes"] = notes
        _emit_json(obj)
        return 0
    from rich.table import Table

    t_ref = next((c["step_time"] for c in cases if c["policy"] == "hdp" and "error" not in c), None)
    pp = f", PP={args.pp} (T counts {args.pp - 1} x the longest round more)" if args.pp > 1 else ""
    table = Table(title=f"simulate: {lengths.size} samples, N={args.ranks}, B={args.max_tokens_per_rank}{pp}")
    for col in ("policy", "rounds", "T", "T*", "efficiency", "eff. (tight T*)", "T/T(hdp)", "max idle", "CP degrees",
                "planner"):
        table.add_column(col, justify="left" if col in ("policy", "CP degrees") else "right")
    for c in cases:
        if "error" in c:
            table.add_row(c["policy"], "-", "-", "-", "-", "-", "-", "-", "skipped (see note)", "-")
            continue
        ratio = f"{c['step_time'] / t_ref:.3f}" if t_ref else "-"
        tight = c.get("efficiency_tight")
        table.add_row(
            c["policy"], str(c["rounds"]), _fmt_s(c["step_time"]), _fmt_s(c["lower_bound"]),
            f"{c['efficiency']:.2%}", f"{tight:.2%}" if tight is not None else "-", ratio, f"{c['max_idle_ratio']:.1%}",
            _hist_text(c["cp_degree_hist"]), f"{c['planner_ms']:.1f} ms",
        )
    con = _console()
    con.print(table)
    for n in notes:
        con.print(f"[dim]note: {n}[/dim]")
    return 0


def _suite_checks(results: list[dict[str, Any]], cases: Sequence[Any]) -> list[dict[str, Any]]:
    by_case: dict[str, dict[str, dict[str, Any]]] = {}
    for r in results:
        by_case.setdefault(r["case"], {})[r["policy"]] = r
    checks: list[dict[str, Any]] = []

    # 1. hdp >= 95% efficiency where the longest sample needs <= N/4 ranks
    fails, n = [], 0
    for case in cases:
        h = by_case.get(case.name, {}).get("hdp")
        if h is None or "error" in h or h["longest_needs_ranks"] > case.num_ranks / 4:
            if h is not None and "error" in h:
                fails.append(f"{case.name}: hdp failed ({h['error']})")
            continue
        n += 1
        if h["efficiency"] < EFFICIENCY_TARGET:
            tight = h.get("efficiency_tight")
            fails.append(f"{case.name}: {h['efficiency']:.3f}" + (f" (tight T*: {tight:.3f})" if tight is not None else ""))
    checks.append({
        "name": f"hdp efficiency >= {EFFICIENCY_TARGET} where longest needs <= N/4 ranks",
        "passed": not fails and n > 0, "detail": "; ".join(fails) or f"{n} cases",
    })

    # 2. hdp at least as fast as every other policy on every case
    fails, n = [], 0
    for case in cases:
        row = by_case.get(case.name, {})
        h = row.get("hdp")
        if h is None or "error" in h:
            fails.append(f"{case.name}: no hdp result")
            continue
        for name, r in row.items():
            if name == "hdp" or "error" in r or r.get("budget_ok") is False:
                continue  # a plan over the token budget is not a valid plan to compare with
            n += 1
            if h["step_time"] > r["step_time"] * (1 + 1e-9):
                fails.append(f"{case.name}: {name} {r['step_time'] / h['step_time']:.3f}x")
    checks.append({
        "name": "hdp >= every other policy on every case",
        "passed": not fails and n > 0, "detail": "; ".join(fails) or f"{n} comparisons",
    })

    # 3. Ascend short-tail: static CP8 at least 1.39x slower than hdp
    ascend = [c for c in cases if "ascend" in c.tags]
    fails, details = [], []
    for case in ascend:
        row = by_case.get(case.name, {})
        h, s = row.get("hdp"), row.get("static-cp")
        if h is None or s is None or "error" in h or "error" in s:
            fails.append(f"{case.name}: missing hdp or static-cp result")
            continue
        ratio = s["step_time"] / h["step_time"]
        details.append(f"{case.name}: {ratio:.3f}")
        if ratio < ASCEND_TARGET:
            fails.append(f"{case.name}: {ratio:.3f}")
    checks.append({
        "name": f"T(static-cp CP8)/T(hdp) >= {ASCEND_TARGET} on ascend-short-tail",
        "passed": bool(ascend) and not fails, "detail": "; ".join(fails or details) or "no ascend case",
    })
    return checks


def _cmd_suite(args: argparse.Namespace) -> int:
    from hdp.packing.suite import SUITE, run_case

    policies = [s.strip() for s in args.policies.split(",") if s.strip()]
    cases = [c for c in SUITE if not args.quick or c.num_ranks in (8, 64)]
    results: list[dict[str, Any]] = []
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=_console(stderr=True), transient=True,
    ) as progress:
        task = progress.add_task("suite", total=len(cases))
        for case in cases:
            progress.update(task, description=f"suite {case.name}")
            results.extend(run_case(case, policies))
            if not args.no_peers:
                entry, _ = _peer_entry(case.lengths(), case.config("hdp"))
                if entry is not None:
                    entry["case"] = case.name
                    entry["longest_needs_ranks"] = results[-1].get("longest_needs_ranks")
                    results.append(entry)
            progress.advance(task)
    checks = _suite_checks(results, cases)
    failed = any(not c["passed"] for c in checks)
    if args.json:
        _emit_json({"cases": results, "checks": checks, "passed": not failed})
    else:
        from rich.table import Table

        by_case: dict[str, dict[str, dict[str, Any]]] = {}
        for r in results:
            by_case.setdefault(r["case"], {})[r["policy"]] = r
        table = Table(title="hdp suite — efficiency (T(policy)/T(hdp))")
        table.add_column("case")
        table.add_column("N", justify="right")
        table.add_column("needs", justify="right")
        shown = policies + (["megatron-core"] if any(r["policy"] == "megatron-core" for r in results) else [])
        for name in shown:
            table.add_column(name, justify="right")
        for case in cases:
            row = by_case.get(case.name, {})
            h = row.get("hdp")
            t_ref = h["step_time"] if h is not None and "error" not in h else None
            cells = []
            for name in shown:
                r = row.get(name)
                if r is None or "error" in r:
                    cells.append("[red]error[/red]")
                    continue
                cell = f"{r['efficiency']:.3f}"
                if t_ref and name != "hdp":
                    cell += f" ({r['step_time'] / t_ref:.2f}x)"
                cells.append(cell)
            needs = next(iter(row.values()))["longest_needs_ranks"] if row else "-"
            table.add_row(case.name, str(case.num_ranks), str(needs), *cells)
        con = _console()
        con.print(table)
        errors = [r for r in results if "error" in r]
        for r in errors[:10]:
            con.print(f"[dim]{r['case']} / {r['policy']}: {r['error'][:120]}[/dim]")
        for c in checks:
            mark = "[green]PASS[/green]" if c["passed"] else "[red]FAIL[/red]"
            con.print(f"{mark} {c['name']} — {c['detail']}")
    return 1 if (failed and args.strict) else 0


# ----------------------------------------------------------------------------------------- bench


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.what == "attention":
        return _bench_attention(args)
    if args.what == "train":
        return _bench_train(args)
    if args.what == "verl":
        # found through the "hdp.benchmarks" entry-point group, so the trainer never imports the
        # integrations package (dependencies point one way: packing <- hdp <- trainer <- integrations)
        from importlib.metadata import entry_points

        found = [ep for ep in entry_points(group="hdp.benchmarks") if ep.name == "verl"]
        if not found:
            raise SystemExit("hdp bench verl: no 'hdp.benchmarks' entry point 'verl'; reinstall hdp-engine (pip install -e .)")
        result = found[0].load()(ranks=_given(args.ranks, 4, "--ranks"), steps=_given(args.steps, 5, "--steps"))
        if args.json:
            _emit_json(result)
        else:
            _print_dict(_flatten(result), f"verl engine benchmark, {_given(args.ranks, 4, '--ranks')} ranks")
        return 0
    if args.what == "moe":
        from hdp.trainer.bench_moe import bench_moe

        shape = {"seq_length": args.seq_length} if args.seq_length else {}
        result = bench_moe(ep=args.ep, caching_malloc=not args.system_malloc, **shape)
        if args.json:
            _emit_json(result)
        else:
            _print_dict(_flatten(result), f"MoE zero-memory benchmark, EP={args.ep}")
        return 0
    if args.what == "exact":
        return _bench_exact(args)
    if args.what == "faults":
        return _bench_faults(args)
    return _bench_planner(args)


def _bench_faults(args: argparse.Namespace) -> int:
    from hdp.trainer.bench_faults import SCENARIOS, run_faults

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


def _bench_exact(args: argparse.Namespace) -> int:
    from hdp.packing.exact import optimum_gaps

    result = optimum_gaps(instances=args.instances, seed=args.seed)
    if args.json:
        _emit_json(result)
        return 0
    _print_dict({k: v for k, v in result.items() if k != "gaps"},
                "hdp vs exact optimum (branch and bound), T(hdp)/T(opt) - 1")
    return 0


def _bench_train(args: argparse.Namespace) -> int:
    from hdp.trainer.bench_train import TrainBenchSpec, bench_train, compare_with_baseline

    # every check before any rank is spawned: bad input never costs a run, nor loses one
    try:
        spec = TrainBenchSpec(
            ranks=_given(args.ranks, 4, "--ranks"),
            policies=tuple(s.strip() for s in args.policies.split(",") if s.strip()),
            steps=_given(args.steps, 5, "--steps"), workload=args.workload, tp=args.tp, pp=args.pp,
        )
    except ValueError as exc:
        raise CliError(f"bench train: {exc}") from exc
    if not (math.isfinite(args.tolerance) and 0.0 <= args.tolerance < 1.0):
        raise CliError(f"--tolerance={args.tolerance}: pass a fraction in [0, 1) (0.05 = 5% slower is a regression)")
    baseline = _load_baseline(args.baseline, spec.policies) if args.baseline else None
    if args.output and Path(args.output).is_dir():
        raise CliError(f"--output={args.output!r} is a directory; name a file for the JSON result")
    result = bench_train(spec)
    if not result:  # a non-zero rank under torchrun
        return 0
    problems = compare_with_baseline(result, baseline, args.tolerance) if baseline else []
    result["regressions"] = problems
    if args.output:
        Path(args.output).write_text(json.dumps(result, default=str, indent=1))
    if args.json:
        _emit_json(result)
    else:
        layout = f"{spec.ranks} ranks = TP {spec.tp} x PP {spec.pp} x domain {spec.ranks // (spec.tp * spec.pp)}"
        _print_train_table(result, f"bench train: {spec.workload}, {layout}, {spec.steps} steps per policy")
    for msg in problems:
        print(f"regression: {msg}", file=sys.stderr)
    return 1 if problems else 0


def _given(value: int | None, default: int, flag: str) -> int:
    """``value`` if the flag was given (0 included: validated by the caller), else ``default``."""
    return default if value is None else value


def _load_baseline(path: str, policies: tuple[str, ...]) -> dict[str, Any]:
    """A stored ``bench train --json`` result, checked before the run: a JSON object whose
    ``results`` maps policy names to objects with a positive, finite number ``tokens_per_s``
    (``speedup``, if present, maps names to positive numbers), sharing a policy with this run."""
    where = f"--baseline={path!r}"
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CliError(f"{where}: cannot read a JSON result ({exc}); pass a file written by bench train --json/--output")
    if not isinstance(doc, dict):
        raise CliError(f"{where}: holds a JSON {type(doc).__name__}, not the object bench train --json writes")
    results = doc.get("results")
    if not isinstance(results, dict) or not results:
        raise CliError(f"{where}: field 'results' is {results!r}; it must map policy names to their results "
                       "(a file written by bench train --json/--output)")
    for name, r in results.items():
        tps = r.get("tokens_per_s") if isinstance(r, dict) else None
        if isinstance(tps, bool) or not isinstance(tps, (int, float)) or not math.isfinite(tps) or tps <= 0:
            raise CliError(f"{where}: field 'results.{name}.tokens_per_s' is {tps!r}; it must be a positive number")
    speedup = doc.get("speedup", {})
    if not isinstance(speedup, dict):
        raise CliError(f"{where}: field 'speedup' is {speedup!r}; it must map names to numbers")
    for name, v in speedup.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise CliError(f"{where}: field 'speedup.{name}' is {v!r}; it must be a positive number")
    if not set(results) & set(policies):
        raise CliError(f"{where}: its policies {sorted(results)} share none with --policies {list(policies)}; "
                       "nothing could be compared")
    return doc


def _print_train_table(result: dict[str, Any], title: str) -> None:
    from rich.table import Table

    con = _console()
    table = Table(title=title)
    for col in ("policy", "tokens/s/rank", "step time", "rounds", "planned eff.", "CP degrees (first step)"):
        table.add_column(col, justify="left" if col in ("policy", "CP degrees (first step)") else "right")
    for p, r in result["results"].items():
        table.add_row(p, f"{r['tokens_per_s']:.0f}", _fmt_s(r["step_time_s"]), ",".join(map(str, r["rounds"])),
                      f"{r['efficiency_planned']:.1%}", _hist_text(r["cp_degree_hist"]))
    con.print(table)
    steps = Table(title="loss of every step (the update does not depend on the plan)")
    steps.add_column("step", justify="right")
    for p in result["results"]:
        steps.add_column(f"{p} loss", justify="right")
        steps.add_column(f"{p} time", justify="right")
    n = len(next(iter(result["results"].values()))["losses"])
    for s in range(n):
        cells = []
        for r in result["results"].values():
            cells += [f"{r['losses'][s]:.6f}", _fmt_s(r["step_times_s"][s])]
        steps.add_row(str(s) + (" (warm-up)" if s == 0 else ""), *cells)
    con.print(steps)
    sp = ", ".join(f"{k} {v:.2f}x" for k, v in result["speedup"].items())
    cpu = ", ".join(f"{k} {v:.2f}x" for k, v in result.get("speedup_cpu_time", {}).items())
    con.print(f"speedup (tokens/s): {sp}; per CPU-second of all ranks: {cpu}; losses match: "
              f"{result['loss_match']} (max rel. diff {result['loss_max_rel_diff']:.1e})")
    cal = result.get("calibration", {})
    if "predicted_over_measured" in cal:
        ratios = ", ".join(f"{k} {v:.2f}" for k, v in cal["predicted_over_measured"].items())
        con.print(f"cost model fitted to this run's records (R² {cal.get('r2', float('nan')):.3f}); "
                  f"simulated / measured step time: {ratios}")


def _cmd_demo(args: argparse.Namespace) -> int:
    from hdp.packing.cost import CostModel
    from hdp.packing.plan import Plan
    from hdp.trainer.bench_train import TrainBenchSpec, bench_train
    from hdp.trainer.gantt import plot_gantt

    spec = TrainBenchSpec(ranks=args.ranks, steps=args.steps, alternate=False, workload="short-tail")
    con = _console()
    con.print(f"hdp demo: {spec.ranks} gloo ranks on CPU, GPT {spec.num_layers} layers x {spec.hidden_size}, "
              f"vocab {spec.vocab_size}, {spec.samples} samples per step, B={spec.max_tokens_per_rank} tokens/rank; "
              "static CP first, then HDP, on the same batches")
    result = bench_train(spec)
    _print_train_table(result, "static CP vs HDP (CPU demo)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cal = result.get("calibration", {})
    from hdp.packing.cost import PARAMETERS as fields  # every CostModel field, as calibrate's to_dict has them
    cost = CostModel(**{k: cal[k] for k in fields}) if all(k in cal for k in fields) else None
    if cost is None:
        from hdp.trainer.bench_train import _engine_config

        cost = _engine_config(spec, "hdp", None).planning.cost  # the engines' own auto model
    gantt = out / "demo_hdp_plan.png"
    plot_gantt(Plan.from_dict(result["plans"]["hdp"]), cost, gantt, title="HDP plan of the demo batch (step 1)")
    (out / "demo_result.json").write_text(json.dumps(result, default=str, indent=1))
    con.print(f"Gantt chart of the HDP plan: {gantt}; full result: {out / 'demo_result.json'}")
    return 0 if result["loss_match"] else 1


def _bench_attention(args: argparse.Namespace) -> int:
    try:
        mod = importlib.import_module("hdp.trainer.bench_attention")
    except ImportError as exc:
        raise CliError(f"bench attention: hdp.trainer.bench_attention is not available ({exc})") from exc
    result = mod.bench_attention(ranks=_given(args.ranks, 2, "--ranks"), tokens=args.tokens, algo=args.algo)
    result = dict(result)
    if args.json:
        _emit_json(result)
        return 0
    _print_dict(result, f"attention benchmark: {args.algo}, {_given(args.ranks, 2, '--ranks')} ranks, {args.tokens} tokens")
    return 0


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as one level of dotted keys (for tables)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _print_dict(d: dict[str, Any], title: str) -> None:
    from rich.table import Table

    table = Table(title=title, show_header=False)
    table.add_column("key", style="bold")
    table.add_column("value", justify="right")
    for k, v in d.items():
        table.add_row(str(k), f"{v:.6g}" if isinstance(v, float) else str(v))
    _console().print(table)


def _bench_planner(args: argparse.Namespace) -> int:
    from hdp.packing import PlannerConfig
    from hdp.packing import plan as make_plan
    from hdp.packing.workloads import lognormal

    from hdp.packing import SearchBudget

    budget = SearchBudget.parse(args.search_budget, "--search-budget")
    runs = [
        ("1024 samples / 64 ranks", 1_024, 64, args.repeats, 100.0),
        ("8192 samples / 512 ranks", 8_192, 512, args.repeats, 50.0),
        ("131072 samples / 8192 ranks", 131_072, 8_192, args.large_repeats, 1000.0),
    ]
    if args.small_only:
        runs = runs[:2]
    out: list[dict[str, Any]] = []
    for label, s, n, repeats, target in runs:
        lengths = lognormal(s, mean=2048.0, sigma=1.2, max_len=32_768, seed=args.seed)
        config = PlannerConfig(num_ranks=n, max_tokens_per_rank=4_096, policy=args.policy, search_budget=budget)
        walls, cpus, policy_ms = [], [], []
        make_plan(lengths[: min(s, 256)], config)  # warm-up: imports, caches
        for _ in range(max(1, repeats)):
            t0, c0 = time.perf_counter(), time.process_time()
            p = make_plan(lengths, config)
            walls.append((time.perf_counter() - t0) * 1e3)
            cpus.append((time.process_time() - c0) * 1e3)
            policy_ms.append(p.stats.planner_ms)
        med = statistics.median(walls)
        out.append({
            "name": label, "samples": s, "ranks": n, "policy": args.policy, "repeats": len(walls),
            "median_ms": med, "median_cpu_ms": statistics.median(cpus),
            "policy_median_ms": statistics.median(policy_ms), "target_ms": target,
            "passed": med <= target, "efficiency": p.stats.efficiency,
        })
        logger.info("%s: median %.1f ms", label, med)
    meta = {"search_budget": dataclasses.asdict(budget),
            "cost_model": "deepseek-v3 on h100-nvlink (PlannerConfig default)", "lengths": "lognormal mean 2048, sigma 1.2, max 32768, B=4096"}
    if args.json:
        _emit_json({"planner": out, "passed": all(r["passed"] for r in out), **meta})
        return 0
    from rich.table import Table

    table = Table(title=f"planner speed (policy {args.policy}, lognormal lengths, B=4096, search budget {budget})")
    for col in ("case", "repeats", "median plan() ms", "median CPU ms", "policy ms", "target ms", "efficiency", "result"):
        table.add_column(col, justify="left" if col == "case" else "right")
    for r in out:
        table.add_row(
            r["name"], str(r["repeats"]), f"{r['median_ms']:.1f}", f"{r['median_cpu_ms']:.1f}",
            f"{r['policy_median_ms']:.1f}", f"{r['target_ms']:.0f}", f"{r['efficiency']:.3f}",
            "[green]PASS[/green]" if r["passed"] else "[red]FAIL[/red]",
        )
    _console().print(table)
    return 0


# ------------------------------------------------------------------------------------- calibrate


def _cmd_calibrate(args: argparse.Namespace) -> int:
    """Fit the cost model to measured records; print it and write the cost-model file (--out)."""
    from hdp.packing import cost_model
    from hdp.packing.calibrate import calibrate, load_records
    from hdp.packing.cost import PARAMETERS
    from hdp.packing.cost_file import cost_document, save_cost_model

    model, profile = args.model or "deepseek-v3", args.profile or "h100-nvlink"
    base = cost_model(model, profile)
    base_name = f"{model}@{profile}"
    if args.out is not None:
        out = Path(args.out)
        if out.is_dir():
            raise CliError(f"--out={args.out!r} is a directory; pass a file path such as cost.json")
        if not out.parent.is_dir():
            raise CliError(f"--out={args.out!r}: the folder {str(out.parent)!r} does not exist")
    result = calibrate(load_records(args.records), base=base)
    meta = result.metadata(base_name)
    if args.out is not None:
        save_cost_model(result.cost, args.out, metadata=meta)
        logger.info("wrote %s", args.out)
    doc = cost_document(result.cost, metadata=meta)
    if args.json:
        _emit_json(doc)
        return 0
    from rich.table import Table

    c = result.cost
    table = Table(title=f"calibrated cost model ({result.n_records} records; base {base_name})")
    for col in ("parameter", "value", "seconds", "source"):
        table.add_column(col, justify="left" if col in ("parameter", "source") else "right")
    per_unit = {"linear_coef": None, "unit_time_s": None}
    for n in PARAMETERS:
        v = float(getattr(c, n))
        secs = "-" if n in per_unit else _fmt_s(v * c.unit_time_s) + ("/token" if n.endswith("per_token") else "")
        src = "fitted" if n in result.fitted else f"base ({result.reasons.get(n, '')})"
        table.add_row(n, f"{v:.6g}", secs, src)
    con = _console()
    con.print(table)
    con.print(f"R² {result.r2:.4f}; relative error median {result.median_rel_err:.2%}, p90 "
              f"{result.rel_err_p90:.2%}, max {result.max_rel_err:.2%}")
    for w in result.warnings:
        con.print(f"[yellow]warning:[/yellow] {w}")
    if args.out is not None:
        con.print(f"cost-model file: {args.out} (hdp plan / hdp simulate --cost-model {args.out})")
    return 0


# ---------------------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of the ``hdp`` command."""
    from hdp.packing.workloads import WORKLOADS

    parser = argparse.ArgumentParser(
        prog="hdp", description="Sequence-length-aware hybrid data/context parallel planner.",
        epilog=f"workloads: {', '.join(WORKLOADS)}",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level to stderr")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="plan one step and print it", epilog=f"workloads: {', '.join(WORKLOADS)}")
    _add_batch_args(p)
    _add_domain_args(p)
    p.add_argument("--policy", default="hdp", help="packing policy (default hdp)")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.add_argument("--plot", metavar="FILE.png", help="also write a Gantt chart")
    p.set_defaults(func=_cmd_plan)

    s = sub.add_parser("simulate", help="compare policies on a batch, or run the built-in suite",
                       epilog=f"workloads: {', '.join(WORKLOADS)}")
    _add_batch_args(s, required=False)
    _add_domain_args(s, required=False)
    s.add_argument("--policies", default=",".join(ALL_POLICIES), help="comma-separated policies")
    s.add_argument("--suite", action="store_true", help="run the built-in benchmark suite")
    s.add_argument("--quick", action="store_true", help="suite: only N in {8, 64}")
    s.add_argument("--strict", action="store_true", help="suite: exit 1 when a check fails")
    s.add_argument("--no-peers", action="store_true", help="skip the megatron-core reference entry")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.add_argument("--plot-dir", metavar="DIR", help="write a Gantt chart per policy")
    s.add_argument("--moe-zero-memory", default="none", choices=("none", "level0", "level1"),
                   help="also plan with the token budget MoE zero-memory recomputation frees")
    s.add_argument("--moe-shape", default="qwen3-235b-a22b",
                   help="MoE layer shape for --moe-zero-memory (qwen3-235b-a22b, deepseek-v3)")
    s.set_defaults(func=_cmd_simulate)

    b = sub.add_parser("bench", help="benchmarks: attention kernels, planner speed, MoE zero-memory, verl engine, "
                                         "training throughput, fault injection")
    b.add_argument("what", choices=("attention", "planner", "exact", "moe", "verl", "train", "faults"))
    b.add_argument("--only", default=None, metavar="A,B",
                   help="faults: scenarios to run (in-process, other-world, sigkill-mid-step, sigstop-mid-step, "
                        "sigkill-during-save; default all)")
    b.add_argument("--timeout", type=float, default=10.0, help="faults: the engines' collective timeout in s (default 10)")
    b.add_argument("--policies", default="static-cp,hdp", help="train: policies compared side by side")
    b.add_argument("--workload", default="short-tail", help="train: short-tail or long-response")
    b.add_argument("--baseline", metavar="FILE", help="train: stored result to compare with")
    b.add_argument("--tolerance", type=float, default=0.05, help="train: allowed regression vs --baseline")
    b.add_argument("--output", metavar="FILE", help="train: also write the JSON result to FILE")
    b.add_argument("--steps", type=int, default=None, help="verl / train: steps per policy, the first untimed (default 5)")
    b.add_argument("--ep", type=int, default=2, help="moe: expert parallel size (default 2)")
    b.add_argument("--seq-length", type=int, default=None,
                   help="moe: sample length packed per rank (default 2048; shorter = more MoE-heavy steps)")
    b.add_argument("--system-malloc", action="store_true",
                   help="moe: glibc's default malloc instead of reusing freed memory like a GPU allocator")
    b.add_argument("--ranks", type=int, default=None,
                   help="attention: ranks (default 2); train: all ranks, TP x PP x domain (default 4)")
    b.add_argument("--tp", type=int, default=1, help="train: tensor-parallel size, sequence parallel (default 1)")
    b.add_argument("--pp", type=int, default=1, help="train: pipeline stages, 1F1B (default 1)")
    b.add_argument("--tokens", type=int, default=8192, help="attention: tokens (default 8192)")
    b.add_argument("--algo", default="ring", help="attention: ring or allgather")
    b.add_argument("--policy", default="hdp", help="planner: policy (default hdp)")
    b.add_argument("--repeats", type=int, default=7, help="planner: repeats of the 64- and 512-rank cases")
    b.add_argument("--large-repeats", type=int, default=2, help="planner: repeats of the 8192-rank case")
    b.add_argument("--small-only", action="store_true", help="planner: skip the 8192-rank case")
    b.add_argument("--search-budget", default="default", dest="search_budget", metavar="SPEC",
                   help="planner: hdp's search budget ('default', 'off' or key=value pairs)")
    b.add_argument("--seed", type=int, default=0, help="planner / exact: workload seed")
    b.add_argument("--instances", type=int, default=20, help="exact: random small instances (default 20)")
    b.add_argument("--json", action="store_true", help="print one JSON object")
    b.set_defaults(func=_cmd_bench)

    d = sub.add_parser("demo", help="CPU demo: train a small GPT on 4 gloo ranks with static CP, then HDP")
    d.add_argument("--ranks", type=int, default=4, help="local gloo ranks (default 4)")
    d.add_argument("--steps", type=int, default=3, help="steps per policy, the first a warm-up (default 3)")
    d.add_argument("--out", default="out/demo", help="folder for the Gantt chart and the JSON result")
    d.set_defaults(func=_cmd_demo)

    c = sub.add_parser("calibrate", help="fit the cost model to measured records (JSON lines)")
    c.add_argument("--records", required=True, metavar="FILE.jsonl", help="measured records")
    c.add_argument("--out", metavar="COST.json", default=None,
                   help="write the cost-model file (hdp plan / simulate --cost-model read it)")
    c.add_argument("--profile", default=None,
                   help="base profile for parameters the records cannot determine (default h100-nvlink)")
    c.add_argument("--model", default=None, help="base model preset (default deepseek-v3)")
    c.add_argument("--json", action="store_true", help="print the cost-model file's JSON document")
    c.set_defaults(func=_cmd_calibrate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``hdp``; returns the exit code (2 for user errors)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse usage errors (already printed) and --help
        return int(exc.code or 0) if not isinstance(exc.code, str) else 2
    from hdp.trainer.launch import quiet_third_party_warnings

    quiet_third_party_warnings()  # the known Megatron / torch fallback and deprecation warnings
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(
            stream=sys.stderr, level=logging.INFO if args.verbose else logging.WARNING,
            format="%(levelname)s %(name)s: %(message)s",
        )
    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
