"""``hdp plan`` and ``hdp simulate`` (and ``--suite``): the planner on the command line (``hdp calibrate``:
:mod:`.calibrate`; the memory options: :mod:`.memory`)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hdp.trainer.cli.memory import derive_budget, gib, layout_text, memory_requested, memory_setup, print_whatif, whatif
from hdp.trainer.cli.output import check_output_dir, check_output_file
from hdp.packing.topology import node_of_text
from hdp.trainer.cli.common import ASCEND_TARGET, CliError, EFFICIENCY_TARGET, _check_domain_args, _config, _node_of, _console, _cost, _emit_json, _entry, _fmt_s, _hist_text, _load_lengths, logger


def _memory_and_budget(args: argparse.Namespace, command: str) -> Any:
    """The memory setup of the options (None without them); CliError when -B is missing and no
    --memory-gb derives it."""
    setup = memory_setup(args)
    if args.max_tokens_per_rank is None and (setup is None or setup.limit_bytes is None):
        raise CliError(f"{command}: pass --max-tokens-per-rank/-B (the per-rank token budget of a round), or "
                       "--memory-gb G --model NAME --layout SPEC to derive it from the memory per device")
    return setup


def _cmd_plan(args: argparse.Namespace) -> int:
    from hdp.packing import plan as make_plan
    from hdp.packing.simulate import simulate

    _check_domain_args(args)
    setup = _memory_and_budget(args, "plan")
    if args.plot:
        from hdp.trainer.cli.gantt import FORMATS

        args.plot = str(check_output_file("--plot", args.plot, default_suffix=".png", suffixes=FORMATS))
    cost = _cost(args)
    lengths = _load_lengths(args)
    if setup is not None:
        derive_budget(setup, lengths, args.ranks, args.max_tokens_per_rank)  # errors name --memory-gb
    config = _config(args, args.policy, cost, setup)
    p = make_plan(lengths, config)
    tight = simulate(p, cost, p.stats.planner_ms, p.stats.pipeline_stages, tight=True)
    p = p.with_stats(dataclasses.replace(tight, memory=p.stats.memory))  # the planner's predicted peaks
    w = whatif(lengths, p, config, setup, args.static_cp) if setup is not None else None
    if args.plot:
        from hdp.trainer.cli.gantt import plot_gantt

        plot_gantt(p, cost, args.plot, flag="--plot")
        logger.info("wrote %s", args.plot)
    if args.json:
        _emit_json({**p.to_dict(), **({"whatif": w} if w is not None else {})})
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
        *((("nodes", node_of_text(p.node_of)), ("cross-node ring traffic", f"{s['cross_node_fraction']:.1%} "
           f"({s['cross_node_groups']} groups)")) if p.node_of is not None else ()),
    ):
        summary.add_row(key, str(value))
    con.print(summary)
    from hdp.packing.simulate import rank_loads

    loads = rank_loads(p, cost) * cost.unit_time_s
    tokens = p.stats.tokens_per_rank
    rounds = Table(title="rounds" + (" (peak: predicted bytes per rank, hdp.packing.memory)" if w else ""))
    peak_cols = ("peak (worst rank)", "peak (least rank)") if w else ()
    for col in ("round", "groups", "samples", "max tokens/rank", "round time", "idle ranks", *peak_cols):
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
            *((gib(w["rounds"][rnd.index]["peak_bytes_max"]), gib(w["rounds"][rnd.index]["peak_bytes_min"])) if w else ()),
        )
    con.print(rounds)
    if len(p.rounds) > len(shown):
        con.print(f"... {len(p.rounds) - len(shown)} more rounds (use --json for all)")
    if w is not None:
        print_whatif(con, w, _fmt_s)
    if args.plot:
        con.print(f"Gantt chart: {args.plot}")
    return 0


def _peer_entry(lengths: np.ndarray, config: Any) -> tuple[dict[str, Any] | None, str | None]:
    """The megatron-core reference entry, or (None, note) when it is unavailable."""
    try:
        peers = importlib.import_module("hdp.trainer.bench.peers")
    except ImportError as exc:
        return None, f"megatron-core peer skipped: hdp.trainer.bench.peers unavailable ({exc})"
    fn = getattr(peers, "megatron_core_plan", None)
    if fn is None:
        return None, "megatron-core peer skipped: hdp.trainer.bench.peers has no megatron_core_plan"
    try:
        result = fn(lengths, config)
    except (ImportError, NotImplementedError, ValueError, MemoryError) as exc:
        return None, f"megatron-core peer skipped: {exc}"
    from hdp.packing.plan import Plan
    from hdp.packing.simulate import simulate

    if isinstance(result, Plan):
        if config.node_of is not None:  # its groups on the job's nodes, priced there
            result = result.on_nodes(config.node_of)
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


def simulate_on(plan: Any, cost: Any, pipeline_stages: int, planner_ms: float = 0.0) -> Any:
    """The figures of ``plan`` (on its own nodes) under ``cost``, with the tight bound."""
    from hdp.packing.simulate import simulate

    return simulate(plan, cost, planner_ms, pipeline_stages, tight=True)


def _cost_name(args: argparse.Namespace) -> str:
    """The cost model the figures name (a file, MODEL@PROFILE, or the presets of --model/--profile)."""
    if getattr(args, "cost_model", None):
        return str(args.cost_model)
    from hdp.packing.profiles import DEFAULT_MODEL, DEFAULT_PROFILE

    model = args.linear_coef if args.linear_coef is not None else (args.model or getattr(args, "shape", None) or DEFAULT_MODEL)
    return f"{model}@{args.profile or DEFAULT_PROFILE}"


def _cmd_cluster(args: argparse.Namespace) -> int:
    """``hdp simulate --cluster``: every cluster case (`hdp.packing.suite.cluster_cases`), node-aware hdp beside
    node-blind hdp and the peers under the two-level model, with each plan's cross-node ring traffic."""
    from hdp.packing.suite import CLUSTER_RANKS, cluster_cases, run_cluster_case

    ranks = (args.ranks,) if args.ranks is not None else (16, 64) if args.quick else CLUSTER_RANKS
    cases = cluster_cases(args.model or "qwen3-235b-a22b", ranks)
    results: list[dict[str, Any]] = []
    for case in cases:
        results.extend(run_cluster_case(case))
    summary = []
    for case in cases:
        row = {r["policy"]: r for r in results if r["case"] == case.name and "error" not in r}
        if "hdp" in row and "hdp-node-blind" in row:
            ref = row["hdp"]["step_time"]
            summary.append({"case": case.name, "node_blind_over_aware": row["hdp-node-blind"]["step_time"] / ref,
                            "best_peer_over_aware": min(r["step_time"] for k, r in row.items() if not k.startswith("hdp"))
                            / ref})
    if args.json:
        _emit_json({"cases": results, "summary": summary, "ranks_per_node": 8,
                    "cost_model": f"{cases[0].model}@{cases[0].profile}" if cases else None,
                    "pipeline_stages": cases[0].pipeline_stages if cases else None})
        return 0
    from rich.table import Table

    table = Table(title=f"cluster cases: T(policy)/T(hdp) and cross-node ring traffic, nodes of 8, "
                        f"{cases[0].model}@{cases[0].profile}, PP {cases[0].pipeline_stages}" if cases else "cluster")
    table.add_column("case")
    for name in ("hdp-node-blind", "static-cp-8", "static-cp-4", "megatron-dcp", "ascend-hdp", "verl-kk", "hdp"):
        table.add_column(name, justify="right")
    for case in cases:
        row = {r["policy"]: r for r in results if r["case"] == case.name}
        h = row.get("hdp")
        ref = h["step_time"] if h is not None and "error" not in h else None
        cells = []
        for name in ("hdp-node-blind", "static-cp-8", "static-cp-4", "megatron-dcp", "ascend-hdp", "verl-kk", "hdp"):
            r = row.get(name)
            if r is None or "error" in r or ref is None:
                cells.append("-")
                continue
            cells.append(f"{r['step_time'] / ref:.3f} ({r['cross_node_fraction']:.0%})" if name != "hdp"
                         else f"{_fmt_s(r['step_time'])} ({r['cross_node_fraction']:.0%})")
        table.add_row(case.name, *cells)
    _console().print(table)
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    if getattr(args, "cluster", False):
        return _cmd_cluster(args)
    if args.suite:
        given = [f for f, v in (("--cost-model", args.cost_model), ("--profile", args.profile),
                                ("--model", args.model), ("--linear-coef", args.linear_coef),
                                ("--memory-gb", args.memory_gb), ("--shape", args.shape),
                                ("--layout", args.layout)) if v is not None]
        if given:
            raise CliError(f"--suite plans every case with its own model and profile; drop {' '.join(given)}")
        return _cmd_suite(args)
    if args.lengths is None and args.workload is None:
        raise CliError("simulate: pass --lengths FILE, --workload NAME, or --suite")
    if args.ranks is None:
        raise CliError("simulate: --ranks is required (or use --suite)")
    # --zero-memory without the memory model: plan again with the B the freed expert memory allows
    zero_memory = "none"
    if args.zero_memory is not None and not memory_requested(args, besides=("zero_memory",)):
        zero_memory, args.zero_memory = args.zero_memory, None
    elif args.moe_shape is not None:
        raise CliError(f"--moe-shape={args.moe_shape!r} prices --zero-memory for a given -B without the memory model; "
                       "with --memory-gb/--layout the memory model prices the level on --shape: drop --moe-shape")
    setup = _memory_and_budget(args, "simulate")
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
    if args.plot_dir is not None:
        check_output_dir("--plot-dir", args.plot_dir)
    cost = _cost(args)
    lengths = _load_lengths(args)
    budget = args.max_tokens_per_rank if setup is None else derive_budget(setup, lengths, args.ranks,
                                                                            args.max_tokens_per_rank)
    fixed = argparse.Namespace(**{**vars(args), "max_tokens_per_rank": budget})  # B as planned, no memory model
    cases: list[dict[str, Any]] = []
    notes: list[str] = []
    plans = {}
    runs: list[tuple[str, argparse.Namespace]] = [("", args)]
    if zero_memory != "none":
        # the same memory holds more tokens when MoE activations are freed: plan with both budgets
        from hdp.moe.budget import MOE_SHAPES, token_budget_with_zero_memory

        moe_shape = args.moe_shape or "qwen3-235b-a22b"
        if moe_shape not in MOE_SHAPES:
            raise CliError(f"--moe-shape={moe_shape!r} is unknown; choose from: {', '.join(MOE_SHAPES)}")
        b_zm = token_budget_with_zero_memory(args.max_tokens_per_rank, zero_memory, MOE_SHAPES[moe_shape])
        notes.append(
            f"MoE zero-memory {zero_memory} ({moe_shape} layer shape): the memory of "
            f"B={args.max_tokens_per_rank} tokens holds B={b_zm}"
        )
        runs.append((f"+{zero_memory}", argparse.Namespace(**{**vars(args), "max_tokens_per_rank": b_zm})))
    for suffix, run_args in runs:
        for name in policies:
            config = _config(run_args, name, cost, setup if suffix == "" else None)
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
            entry["max_tokens_per_rank"] = p.max_tokens_per_rank
            if p.stats.memory is not None:
                entry["peak_bytes"] = p.stats.memory["peak_bytes"]
                entry["within_limit"] = p.stats.memory.get("within_limit")
            cases.append(entry)
            if name == "hdp" and run_args.pp > 1:
                # the plan made without the pipeline, scored with it: what knowing PP buys
                from hdp.packing.simulate import simulate

                flat_args = fixed if suffix == "" else run_args
                flat = make_plan(lengths, _config(argparse.Namespace(**{**vars(flat_args), "pp": 1}), name, cost))
                flat = flat.with_stats(simulate(flat, cost, flat.stats.planner_ms, run_args.pp))
                plans["hdp-no-pp" + suffix] = flat
                entry = _entry(flat, cost)
                entry["policy"] = "hdp-no-pp" + suffix
                entry["max_tokens_per_rank"] = flat.max_tokens_per_rank
                cases.append(entry)
            if name in ("hdp", "hdp-pow2") and config.node_of is not None:
                # the same planner with the topology withheld, its plan priced on the nodes: what knowing them buys
                blind = make_plan(lengths, dataclasses.replace(config, node_of=None))
                blind_ms = blind.stats.planner_ms
                blind = blind.on_nodes(config.node_of)
                blind = blind.with_stats(simulate_on(blind, cost, run_args.pp, blind_ms))
                plans[f"{name}-node-blind{suffix}"] = blind
                entry = _entry(blind, cost)
                entry["policy"] = f"{name}-node-blind{suffix}"
                entry["max_tokens_per_rank"] = blind.max_tokens_per_rank
                cases.append(entry)
    if not args.no_peers:
        peer, note = _peer_entry(lengths, _config(fixed, policies[0], cost))
        if peer is not None:
            cases.append(peer)
        if note:
            notes.append(note)
            logger.info("%s", note)
    if args.plot_dir:
        from hdp.trainer.cli.gantt import plot_gantt

        out = Path(args.plot_dir)
        out.mkdir(parents=True, exist_ok=True)
        for name, p in plans.items():
            plot_gantt(p, cost, out / f"gantt_{name}.png", flag="--plot-dir")
        logger.info("wrote %d Gantt charts to %s", len(plans), out)
    if args.json:
        obj: dict[str, Any] = {"cases": cases, "pipeline_stages": args.pp, "token_budget": budget,
                               "nodes": node_of_text(_node_of(args)), "ranks_per_node": args.ranks_per_node,
                               "cost_model": _cost_name(args)}
        if setup is not None:
            obj["memory"] = {"limit_bytes": setup.limit_bytes, "model": setup.model.shape.name,
                             "layout": layout_text(setup.model.layout), "static_bytes": setup.model.worst_static(),
                             "coefficients": setup.model.coef.to_dict(),
                             "coefficients_source": setup.coefficients_source}
        if notes:
            obj["notes"] = notes
        _emit_json(obj)
        return 0
    from rich.table import Table

    t_ref = next((c["step_time"] for c in cases if c["policy"] == "hdp" and "error" not in c), None)
    pp = f", PP={args.pp} (T counts {args.pp - 1} x the longest round more)" if args.pp > 1 else ""
    mem = "" if setup is None or setup.limit_bytes is None else f" (derived from {args.memory_gb:g} GiB per device)"
    nodes = "" if args.ranks_per_node is None else f", {node_of_text(_node_of(args))}"
    table = Table(title=f"simulate: {lengths.size} samples, N={args.ranks}{nodes}, B={budget}{mem}{pp}")
    peak_col = ("peak (worst rank)",) if setup is not None else ()
    node_col = ("x-node",) if args.ranks_per_node is not None else ()
    for col in ("policy", "rounds", "T", "T*", "efficiency", "eff. (tight T*)", "T/T(hdp)", "max idle", "CP degrees",
                "planner", *node_col, *peak_col):
        table.add_column(col, justify="left" if col in ("policy", "CP degrees") else "right")
    for c in cases:
        if "error" in c:
            table.add_row(c["policy"], "-", "-", "-", "-", "-", "-", "-", "skipped (see note)", "-",
                          *("-" for _ in node_col + peak_col))
            continue
        ratio = f"{c['step_time'] / t_ref:.3f}" if t_ref else "-"
        tight = c.get("efficiency_tight")
        table.add_row(
            c["policy"], str(c["rounds"]), _fmt_s(c["step_time"]), _fmt_s(c["lower_bound"]),
            f"{c['efficiency']:.2%}", f"{tight:.2%}" if tight is not None else "-", ratio, f"{c['max_idle_ratio']:.1%}",
            _hist_text(c["cp_degree_hist"]), f"{c['planner_ms']:.1f} ms",
            *((f"{c['cross_node_fraction']:.1%}",) if node_col else ()),
            *((gib(c.get("peak_bytes")),) if peak_col else ()),
        )
    con = _console()
    con.print(table)
    if setup is not None:
        con.print(f"memory: {setup.model.shape.name} on {layout_text(setup.model.layout)}; coefficients "
                  f"{setup.coefficients_source}; peak: predicted bytes of the worst rank (hdp.packing.memory)")
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
