"""``hdp bench ...``: the command-line side of the benchmarks in :mod:`hdp.trainer.bench`."""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hdp.trainer.cli.common import (CliError, Parser, _console, _emit_json, _flatten, _fmt_s, _hist_text, _print_dict,
                                    logger, positive_int, seed_int)
from hdp.trainer.cli.output import check_output_dir, check_output_file, write_atomic


BenchAdder = Callable[[Any], argparse.ArgumentParser]
"""Adds one bench's sub-parser to ``hdp bench``'s sub-parsers (see `add_bench_parsers`)."""


def _bench_parser(sub: Any, name: str, help: str, run: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
    """The sub-parser ``hdp bench NAME`` with ``--json``; ``run(args)`` returns the exit code."""
    p = sub.add_parser(name, help=help, description=help)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)
    return p


def add_planner(sub: Any) -> argparse.ArgumentParser:
    p = _bench_parser(sub, "planner", "planner speed and plan quality on the benchmark batch families", _bench_planner)
    p.add_argument("--policy", default="hdp", help="policy (default hdp)")
    p.add_argument("--repeats", type=positive_int, default=7, help="repeats of the 64- and 512-rank cases (default 7)")
    p.add_argument("--large-repeats", type=positive_int, default=2, help="repeats of the 8192-rank case (default 2)")
    p.add_argument("--small-only", action="store_true", help="skip the 8192-rank case")
    p.add_argument("--families", default=None, metavar="A,B",
                   help="batch families to time (default all: the suite's distributions, short-reasoning, pareto, "
                        "rl-grouped-16)")
    p.add_argument("--no-peers", action="store_true", dest="no_peers",
                   help="skip megatron-core's scheduler and the megatron-dcp port")
    p.add_argument("--search-budget", default="default", dest="search_budget", metavar="SPEC",
                   help="hdp's search budget ('default', 'off' or key=value pairs)")
    p.add_argument("--seed", type=seed_int, default=0, help="workload seed (default 0)")
    p.add_argument("--ranks-per-node", type=positive_int, default=None, dest="ranks_per_node", metavar="R",
                   help="the topology on: every domain on nodes of R ranks (default: one node)")
    p.add_argument("--large-families", default="lognormal", dest="large_families", metavar="A,B",
                   help="families of the 131,072-sample, 8,192-rank case (default lognormal; 'all': every family)")
    return p


def add_job_args(p: argparse.ArgumentParser) -> None:
    """The flags that describe a training job (``hdp bench train`` and ``hdp bench regress``'s job preset)."""
    g = p.add_argument_group("the job (launched like training: torchrun, or local ranks spawned here)")
    g.add_argument("--device", default="cpu", choices=("cpu", "cuda", "npu"),
                   help="device of every rank: cpu (gloo ranks) or one rank per GPU / NPU (NCCL / HCCL; not run on "
                        "hardware) (default cpu)")
    g.add_argument("--ranks", type=positive_int, default=None,
                   help="all ranks, TP x PP x domain (default 4; under torchrun its world size)")
    g.add_argument("--model", default=None, metavar="NAME|CONFIG.json",
                   help="tiny (default: the bench's small GPT), a shape preset (dense-8b, qwen3-30b-a3b, "
                        "qwen3-235b-a22b, cpu-tiny) or a Hugging Face / Megatron config.json; random weights")
    g.add_argument("--layers", type=positive_int, default=None, help="override the model's layer count")
    g.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                   help="parameter dtype (default float32 on CPU, bfloat16 on a GPU / NPU)")
    g.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size, sequence parallel (default 1)")
    g.add_argument("--pp", type=positive_int, default=1, help="pipeline stages, 1F1B (default 1)")
    g.add_argument("--vpp", type=positive_int, default=None, help="virtual stages per pipeline rank (interleaved)")
    g.add_argument("--ep", type=positive_int, default=1, help="expert-parallel size (a MoE model) (default 1)")
    g.add_argument("--etp", type=positive_int, default=1, help="expert tensor-parallel size (hdp runs 1)")
    g.add_argument("--zero-memory", default="none", dest="zero_memory", choices=("none", "level0", "level1"),
                   help="MoE zero-memory level (default none)")
    g.add_argument("--recompute", default="none", choices=("none", "selective", "full"),
                   help="activation recompute (default none)")
    g.add_argument("--cp-algorithm", default="ring", dest="cp_algorithm", choices=("ring", "allgather"),
                   help="CP attention (default ring; allgather plans power-of-two groups)")
    g.add_argument("--lengths", default=None, metavar="FILE",
                   help="the batches: a file of one batch per line (sample lengths), or the lengths a run recorded "
                        "beside its calibration records (hdp_calibration/actor.lengths.jsonl, or the records file "
                        "itself); default the --workload")
    g.add_argument("--workload", default="short-tail", choices=("short-tail", "long-response"),
                   help="built-in batches when there is no --lengths (default short-tail)")
    g.add_argument("--samples", type=positive_int, default=None, help="samples per batch of the workload")
    g.add_argument("--max-tokens-per-rank", type=positive_int, default=None, dest="max_tokens_per_rank",
                   metavar="B", help="token budget per rank and round (default the recorded one, else 1024)")
    g.add_argument("--policies", default="static-cp,hdp",
                   help="policies side by side (default static-cp,hdp; verl-kk: verl's stock scheduling)")
    g.add_argument("--steps", type=positive_int, default=None,
                   help="steps per policy, the first untimed (default 5, regress 9; recorded lengths: one per batch "
                        "+ 1)")
    g.add_argument("--cost-model", default="fit", dest="cost_model", metavar="fit|auto|MODEL@PROFILE|FILE",
                   help="the timed steps' cost model: fit (fitted to the warm-up, default), or the job's own "
                        "(auto, a preset, a cost-model file) to replay its plans")
    g.add_argument("--peak-tflops", type=float, default=None, dest="peak_tflops", metavar="T",
                   help="peak TFLOP/s per device for MFU (default: known GPUs by name; none on CPU)")
    g.add_argument("--smoke", action="store_true", help="the smallest mode: a tiny GPT and batch (seconds; checks "
                                                        "that it runs, its figures are not throughput figures)")


def job_spec(args: argparse.Namespace, *, default_steps: int = 5, where: str = "bench train", **extra: Any) -> Any:
    """The `TrainBenchSpec` of the job flags (`add_job_args`); CliError naming the flag, before any rank starts."""
    import os

    from hdp.trainer.bench.train import SMOKE, TrainBenchSpec, check_job

    if args.peak_tflops is not None and not (math.isfinite(args.peak_tflops) and args.peak_tflops > 0):
        raise CliError(f"--peak-tflops={args.peak_tflops}: pass the device's peak TFLOP/s, a number > 0")
    torchrun = "WORLD_SIZE" in os.environ and "RANK" in os.environ
    ranks = int(os.environ["WORLD_SIZE"]) if torchrun else (args.ranks if args.ranks is not None else 4)
    fields = dict(
        ranks=ranks, policies=tuple(s.strip() for s in args.policies.split(",") if s.strip()),
        steps=args.steps if args.steps is not None else (None if args.lengths else default_steps),
        workload=args.workload, lengths=args.lengths, samples=args.samples, max_tokens_per_rank=args.max_tokens_per_rank,
        tp=args.tp, pp=args.pp, virtual_pp=args.vpp, ep=args.ep, etp=args.etp, zero_memory=args.zero_memory,
        recompute=args.recompute, cp_algorithm=args.cp_algorithm, model=args.model, layers=args.layers,
        dtype=args.dtype, cost_model=args.cost_model, peak_tflops=args.peak_tflops, device=args.device, **extra,
    )
    if args.smoke:  # the smallest model and batch; recorded lengths keep their own budget
        fields.update({k: v for k, v in SMOKE.items()
                       if fields.get(k) is None and not (args.lengths and k == "max_tokens_per_rank")})
    try:
        spec = TrainBenchSpec(**fields)
        check_job(spec)
    except ValueError as exc:
        raise CliError(f"{where}: {exc}") from exc
    if not torchrun and spec.device == "cpu":  # spawned here: can this machine run that many ranks?
        from hdp.trainer.launch import check_local_capacity

        check_local_capacity(spec.ranks)
    return spec


def add_train(sub: Any) -> argparse.ArgumentParser:
    p = _bench_parser(sub, "train", "the user's training job under policies side by side: tokens/s (per device), "
                                    "MFU, peak memory, phases, paired speedups with 95%% intervals, equal losses",
                      _bench_train)
    add_job_args(p)
    p.add_argument("--records-dir", default=None, dest="records_dir", metavar="DIR",
                   help="where the engines write their calibration records and lengths (default a temporary folder)")
    p.add_argument("--baseline", metavar="FILE", help="stored result to compare with")
    p.add_argument("--tolerance", type=float, default=0.05, help="allowed regression vs --baseline (default 0.05)")
    p.add_argument("--output", metavar="FILE", help="also write the JSON result to FILE")
    return p


def add_memory(sub: Any) -> argparse.ArgumentParser:
    p = _bench_parser(sub, "memory", "memory model: predicted vs measured peaks, a run to a memory limit, and the "
                                     "log-prob paths' bytes and time (--only logprobs)", _bench_memory)
    p.add_argument("--only", default=None, metavar="A,B",
                   help="cases to run (their names, 'limit', or 'logprobs': the logits vs the fused log-prob path, a "
                        "log-prob pass and a training round at --tokens x --vocab, not in the default set: it needs "
                        "~6 GB and minutes at the defaults; default every case and 'limit')")
    p.add_argument("--tokens", type=positive_int, default=8192, help="logprobs: tokens T of the round (default 8192)")
    p.add_argument("--vocab", type=positive_int, default=151936, help="logprobs: vocabulary V (default 151936)")
    p.add_argument("--hidden", type=positive_int, default=256,
                   help="logprobs: hidden size H (default 256: the logits path's bytes do not depend on it)")
    p.add_argument("--repeats", type=positive_int, default=3, help="logprobs: timed pairs per kind (default 3)")
    return p


def add_device(sub: Any) -> argparse.ArgumentParser:
    p = _bench_parser(sub, "device", "one accelerator: kernel exactness and speed, its cost terms, log-probs, the engine "
                                     "on one device (--dry-run: every row on CPU, small shapes)", _bench_device)
    p.add_argument("--dry-run", action="store_true", dest="dry_run", help="every row on CPU with small shapes (seconds)")
    p.add_argument("--device", default=None, help="device to measure (default the first accelerator)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="folder for device.json (rewritten after every row), the cost-model file and its records "
                        "(default a new temporary folder)")
    p.add_argument("--rows", default=None, metavar="A,B", help="rows to run (default all)")
    p.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                   help="rows that would start after this many seconds are skipped (default 480)")
    p.add_argument("--strict", action="store_true", help="exit 1 when a row fails or errs")
    return p


def add_regress(sub: Any) -> argparse.ArgumentParser:
    p = _bench_parser(sub, "regress", "guard a job's throughput: its rows (tokens/s, paired speedups, peak memory, equal "
                                      "losses) against a baseline recorded on this machine, one tolerance per row",
                      _bench_regress)
    p.add_argument("--preset", default="job", metavar="job|NAME|FILE.py",
                   help="job (default: the job the flags below describe), or a preset file defining PRESET; NAME reads "
                        "benchmarks/NAME.py under the working directory (this project's CI preset: ci, from a "
                        "checkout's root)")
    p.add_argument("--baseline", default=None, metavar="FILE",
                   help="baseline file (the job preset needs one; ci: benchmarks/ci_baseline.json): a regular JSON file "
                        "of at most 1 MiB holding a figure for every row the run measures, each inside its row's "
                        "range; checked before anything runs")
    p.add_argument("--only", default=None, metavar="A,B", help="rows or benchmarks to run (default all)")
    p.add_argument("--update", action="store_true",
                   help="record this machine's baseline instead: every row's median over --repeats runs, its "
                        "tolerance derived from their spread, the hardware, versions, config and commit (a new file, "
                        "or rows merged into an existing one; its folder must exist)")
    p.add_argument("--repeats", type=positive_int, default=None,
                   help="runs of every benchmark (default 3 with --update, else 1); the figure is their median")
    p.add_argument("--allow-lower", action="store_true", dest="allow_lower",
                   help="with --update: record a speed row's figure worse than the file's (refused without it)")
    add_job_args(p)
    return p


BENCHES: tuple[BenchAdder, ...] = (add_planner, add_train, add_memory, add_device, add_regress)
"""The benches users run, in ``hdp bench --help`` order; a new one appends its adder here.  This project's CI-only
benchmarks (attention, exact, moe, faults, nodes, verl, verl-old-logprob, models) are outside the wheel:
``python -m benchmarks --help`` in a checkout."""

ENTRY_POINT_GROUP = "hdp.benchmarks"
"""Benches of other packages (verl's): entry point NAME = ``module:runner``; see `add_bench_parsers`."""


class _EntryPointParser(Parser):
    """The sub-parser of an entry-point bench: its module is imported (and its ``add_arguments`` called)
    only when ``hdp bench NAME`` is parsed or its help shown, so that other commands never import it."""

    def __init__(self, *args: Any, entry_point: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._entry_point, self._loaded = entry_point, entry_point is None

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        ep = self._entry_point
        try:
            runner = ep.load()
            add = getattr(importlib.import_module(ep.module), "add_arguments", None)
        except ImportError as exc:
            self.error(f"cannot load the {ENTRY_POINT_GROUP!r} entry point {ep.name} = {ep.value} ({exc}); install "
                       "hdp-engine with the extra it needs (pip install -e '.[verl]' in a checkout)")
        if add is not None:
            add(self)
        self.set_defaults(func=functools.partial(_run_entry_point, ep.name, runner))

    def parse_known_args(self, args: Any = None, namespace: Any = None):  # type: ignore[override]  # noqa: ANN201
        self._load()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self._load()
        return super().format_help()


def add_bench_parsers(bench: argparse.ArgumentParser) -> None:
    """Add one sub-parser per bench to the ``hdp bench`` parser.

    The trainer's benches are `BENCHES`.  A package's bench registers itself as an entry point of the
    ``hdp.benchmarks`` group (``NAME = "module:runner"``): ``runner(**flags) -> dict`` takes the parsed
    values of its flags as keyword arguments and returns the result (printed as a table, or as JSON with
    ``--json``; the command exits 1 when the result says ``"passed": false``); the flags come from
    ``add_arguments(parser)`` in the runner's module.
    """
    sub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH", parser_class=_EntryPointParser)
    for add in BENCHES:
        add(sub)
    from importlib.metadata import entry_points

    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        if ep.name not in sub.choices:
            p = sub.add_parser(ep.name, help=f"{ep.name} (entry point {ep.value})", entry_point=ep)
            p.add_argument("--json", action="store_true", help="print one JSON object")


def _run_entry_point(name: str, runner: Callable[..., dict[str, Any]], args: argparse.Namespace) -> int:
    params = inspect.signature(runner).parameters
    flags = {k: v for k, v in vars(args).items() if k in params}
    result = runner(**flags)
    if args.json:
        _emit_json(result)
    else:
        shown = ", ".join(f"{k} {v}" for k, v in flags.items())
        _print_dict(_flatten(result), f"hdp bench {name}" + (f" ({shown})" if shown else ""))
    if result.get("passed") is False:  # the bench's own checks failed (verl: the paths ran one plan, ...)
        print(f"hdp bench {name}: its checks failed (passed: false)", file=sys.stderr)
        return 1
    return 0


def _fmt_figure(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    return f"{v:.4g}"


_JOB_FLAGS = ("device", "ranks", "model", "layers", "dtype", "tp", "pp", "vpp", "ep", "etp", "zero_memory", "recompute",
              "cp_algorithm", "lengths", "workload", "samples", "max_tokens_per_rank", "policies", "steps", "cost_model",
              "peak_tflops", "smoke")
"""Destinations of `add_job_args`' flags (they describe the job preset's job)."""

REGRESS_STEPS = 9
"""``hdp bench regress``'s default steps per policy (8 timed, paired): enough for a 95% interval of the paired
speedup."""


def _bench_regress(args: argparse.Namespace) -> int:
    """``hdp bench regress``: the table (row, baseline, now, tolerance, verdict); exit 1 naming each failed row."""
    from hdp.trainer.bench.regress import job_preset, load_preset, run_regress

    only = [s.strip() for s in (args.only or "").split(",") if s.strip()]
    if args.allow_lower and not args.update:
        raise CliError("--allow-lower: a flag of --update (it lets a worse speed figure be recorded)")
    if args.preset == "job":
        preset = job_preset(job_spec(args, default_steps=REGRESS_STEPS, where="bench regress"))
    else:
        defaults = argparse.ArgumentParser(add_help=False)
        add_job_args(defaults)
        unset = vars(defaults.parse_args([]))
        given = [f"--{d.replace('_', '-')}" for d in _JOB_FLAGS if getattr(args, d) != unset[d]]
        if given:
            raise CliError(f"{', '.join(given)}: flags of the job preset; --preset {args.preset} defines its own runs")
        try:
            preset = load_preset(args.preset)
        except ValueError as exc:
            raise CliError(f"bench regress: {exc}") from exc
    baseline = args.baseline or preset.baseline
    if baseline is None:
        raise CliError("--baseline: the job preset compares with a baseline of this machine and job; record one with "
                       "hdp bench regress --update --baseline FILE (with the same job flags), then pass --baseline FILE")
    if args.update:  # the file --update writes, checked before any benchmark runs
        check_output_file("--baseline", baseline)
    repeats = args.repeats if args.repeats is not None else (3 if args.update else 1)
    try:
        report = run_regress(preset=preset, baseline=baseline, only=only or None, update=args.update, repeats=repeats,
                             allow_lower=args.allow_lower)
    except (ValueError, RuntimeError) as exc:
        raise CliError(f"bench regress: {exc}") from exc
    if not report["judged"]:  # another rank of a torchrun job: rank 0 judges, prints and writes
        return 0
    if args.json:
        _emit_json(report)
    else:
        from rich.table import Table

        table = Table(title=f"hdp bench regress, preset {report['preset']}, against {report['baseline_file']}")
        for col in ("row", "baseline", "now", "tolerance", "verdict"):
            table.add_column(col, justify="right" if col in ("baseline", "now", "tolerance") else "left")
        for r in report["rows"]:
            table.add_row(r["row"], _fmt_figure(r["baseline"]), _fmt_figure(r["now"]), r["tolerance"], r["verdict"])
        con = _console()
        con.print(table)
        con.print("seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in report["seconds"].items()))
        if report.get("lowered"):
            con.print(f"recorded lower speed figures (--allow-lower): {', '.join(report['lowered'])}", markup=False)
    for r in report["rows"]:
        if r["row"] in report["failed"]:
            print(f"regression: {r['row']} ({r['meaning']}): now {_fmt_figure(r['now'])}, baseline "
                  f"{_fmt_figure(r['baseline'])}, tolerance {r['tolerance']}: {r['verdict']}", file=sys.stderr)
    return 1 if report["failed"] else 0


def _bench_memory(args: argparse.Namespace) -> int:
    """``hdp bench memory``: predicted vs measured peak per configuration, and a run to a memory limit."""
    from hdp.trainer.bench.memory import CASES, bench_limit, bench_memory, summary

    only = tuple(s.strip() for s in (args.only or "").split(",") if s.strip())
    names = {c.name for c in CASES} | {"limit", "logprobs"}
    for name in only:
        if name not in names:
            raise CliError(f"--only={name!r}: memory cases are {', '.join(sorted(names))}")
    cases = tuple(c for c in CASES if not only or c.name in only)
    result = summary(bench_memory(cases)) if cases else {"cases": [], "passed": True}
    if not only or "limit" in only:
        result["limit"] = bench_limit()
        result["passed"] = result["passed"] and result["limit"]["passed"]
    if "logprobs" in only:
        from hdp.trainer.bench.logprobs import bench_logprobs

        result["logprobs"] = bench_logprobs(args.tokens, args.vocab, args.hidden, repeats=args.repeats)
        result["passed"] = result["passed"] and result["logprobs"]["passed"]
    if args.json:
        _emit_json(result)
        return 0
    from rich.table import Table

    if result["cases"]:
        table = Table(title="memory model: each round's predicted vs measured peak after calibration (held-out rounds)")
        for col in ("case", "group sizes", "predicted MB", "measured MB", "max rel err", "max err beyond static", "ok"):
            table.add_column(col)
        for c in result["cases"]:
            table.add_row(c["name"], ",".join(map(str, c["group_sizes"])), f"{c['predicted_bytes'] / 1e6:.3f}",
                          f"{c['measured_bytes'] / 1e6:.3f}", f"{c['max_rel_err']:.1%}", f"{c['max_dynamic_rel_err']:.1%}",
                          "yes" if c["passed"] else "NO")
        _console().print(table)
    lp = result.get("logprobs")
    if lp:
        sh = lp["shape"]
        t = Table(title=f"log-prob paths: T={sh['tokens']}, V={sh['vocab']}, H={sh['hidden']}, {sh['dtype']}, "
                        f"{lp['threads']} threads, {lp['repeats']} timed pairs (median, min-max)")
        for col in ("kind", "path", "peak MB", "peak MB beyond dW", "fused / logits", "seconds", "time fused / logits"):
            t.add_column(col)
        for kind in ("logprob_pass", "training_round"):
            row = lp[kind]
            for path in ("logits", "fused"):
                r = row[path]
                sec = (f"{r['seconds_median']:.2f} ({r['seconds_spread'][0]:.2f}-{r['seconds_spread'][1]:.2f})"
                       if r["seconds_median"] is not None else "-")
                ratio = path == "fused"
                t.add_row(kind, path, f"{r['peak_bytes'] / 1e6:.0f}", f"{r['peak_bytes_beyond_weight_grad'] / 1e6:.0f}",
                          f"{row['memory_ratio']:.3f}" if ratio else "",
                          sec, f"{row['time_ratio_median']:.2f}" if ratio and row["time_ratio_median"] else "")
        _console().print(t)
    lim = result.get("limit")
    if lim:
        _console().print(
            f"limit {lim['limit_gb'] * 1e3:.1f} MB: token-budget plan peaked at "
            f"{lim['token_budget_run']['max_peak_gb'] * 1e3:.1f} MB, memory-aware plan at "
            f"{lim['memory_limit_run']['max_peak_gb'] * 1e3:.1f} MB; losses equal: {lim['losses_equal']}; "
            f"step time x{lim['step_time_cost']:.2f}")
    return 0


def _bench_train(args: argparse.Namespace) -> int:
    from hdp.trainer.bench.train import bench_train, compare_with_baseline

    # every check before any rank is spawned: bad input never costs a run, nor loses one
    if not (math.isfinite(args.tolerance) and 0.0 <= args.tolerance < 1.0):
        raise CliError(f"--tolerance={args.tolerance}: pass a fraction in [0, 1) (0.05 = 5% slower is a regression)")
    records = check_output_dir("--records-dir", args.records_dir) if args.records_dir is not None else None
    spec = job_spec(args, records_dir=str(records) if records is not None else None)
    baseline = _load_baseline(args.baseline, spec.policies) if args.baseline else None
    output = check_output_file("--output", args.output) if args.output is not None else None
    result = bench_train(spec)
    if not result:  # a non-zero rank under torchrun
        return 0
    problems = compare_with_baseline(result, baseline, args.tolerance) if baseline else []
    result["regressions"] = problems
    if output is not None:
        write_atomic(output, json.dumps(result, default=str, indent=1), "--output")
    if args.json:
        _emit_json(result)
    else:
        layout = f"{spec.ranks} ranks = TP {spec.tp} x PP {spec.pp} x domain {spec.ranks // (spec.tp * spec.pp)}"
        source = f"lengths {spec.lengths}" if spec.lengths else spec.workload
        _print_train_table(result, f"bench train: {result['model']['name']} on {spec.device}, {source}, {layout}, "
                                   f"{spec.steps} steps per policy")
    for msg in problems:
        print(f"regression: {msg}", file=sys.stderr)
    return 1 if problems else 0


def _load_baseline(path: str, policies: tuple[str, ...]) -> dict[str, Any]:
    """A stored ``bench train --json`` result, checked before the run: a JSON object whose
    ``results`` maps policy names to objects with a positive, finite number ``tokens_per_s``
    (``speedup``, if present, maps names to positive numbers), sharing a policy with this run."""
    from hdp.packing.cost_file import read_bounded_text

    where = f"--baseline={path!r}"
    fix = "pass a file written by bench train --json/--output"
    try:  # a regular file of at most 16 MiB (stat first: a FIFO is never opened, /dev/zero never read)
        doc = json.loads(read_bounded_text(Path(path), 16 << 20, "--baseline", fix))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CliError(f"{where}: cannot read a JSON result ({exc}); {fix}")
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


def _print_train_table(result: dict[str, Any], title: str, about: str | None = None) -> None:
    """The comparison's tables (``title`` above the first), then ``about`` (what ran, when given), the
    speedups and the cost model fitted to the run with its warnings, each printed once."""
    from rich.table import Table

    con = _console()
    table = Table(title=title)
    for col in ("policy", "tokens/s/device", "tokens/s (job)", "step time", "MFU", "peak GB", "rounds", "planned eff.",
                "CP degrees (first step)"):
        table.add_column(col, justify="left" if col in ("policy", "CP degrees (first step)") else "right")
    for p, r in result["results"].items():
        mfu = r.get("mfu")
        table.add_row(p, f"{r['tokens_per_s']:.0f}", f"{r.get('tokens_per_s_job', math.nan):.0f}",
                      _fmt_s(r["step_time_s"]), "-" if mfu is None else f"{mfu:.1%}",
                      f"{r.get('peak_memory_gb', math.nan):.3g}", ",".join(map(str, r["rounds"])),
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
    con.print("step 0 is an untimed warm-up: each engine's first calls (torch, Megatron, its process groups); "
              "every policy's planner kernels were compiled before it")
    if about:
        con.print(about)
    sp = ", ".join(f"{k} {v:.2f}x" for k, v in result["speedup"].items())
    cpu = ", ".join(f"{k} {v:.2f}x" for k, v in result.get("speedup_cpu_time", {}).items())
    con.print(f"speedup (tokens/s): {sp}; per CPU-second of all ranks: {cpu}; losses match: "
              f"{result['loss_match']} (max rel. diff {result['loss_max_rel_diff']:.1e})")
    for k, pair in result.get("paired", {}).items():
        w, c = pair["wall"], pair["cpu"]
        con.print(f"paired {k} (median of {w['n']} steps' ratios, 95% interval): wall {w['median']:.3f}x "
                  f"[{w['ci95'][0]:.3f}, {w['ci95'][1]:.3f}], CPU-seconds {c['median']:.3f}x "
                  f"[{c['ci95'][0]:.3f}, {c['ci95'][1]:.3f}]")
    model = result.get("model")
    if model:
        con.print(f"model {model['name']}: {model['train_flops_per_step'] / 1e12:.3g} TFLOP per step (median); MFU "
                  f"against {model['peak_source'] if model['peak_tflops'] is None else str(model['peak_tflops']) + ' TFLOP/s (' + model['peak_source'] + ')'}",
                  markup=False)
    for p, rep in result.get("replay", {}).items():
        con.print(f"replay: {p}'s plans equal the recorded ones in {rep['equal']} of {rep['compared']} steps")
    cal = result.get("calibration", {})
    if "predicted_over_measured" in cal:
        ratios = ", ".join(f"{k} {v:.2f}" for k, v in cal["predicted_over_measured"].items())
        con.print(f"cost model fitted to this run's records (R² {cal.get('r2', float('nan')):.3f}); "
                  f"simulated / measured step time: {ratios}")
    for msg in dict.fromkeys(cal.get("warnings", ())):  # the fit's own warnings, once each (never logged)
        con.print(f"note: {msg}", markup=False)


def _bench_planner(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from hdp.packing import SearchBudget
    from hdp.trainer.bench.planner import FAMILIES, bench_planner

    budget = SearchBudget.parse(args.search_budget, "--search-budget")
    by_name = {f.name: f for f in FAMILIES}
    wanted = [s.strip() for s in (args.families or "").split(",") if s.strip()] or list(by_name)
    unknown = [w for w in wanted if w not in by_name]
    if unknown:
        raise CliError(f"--families: {', '.join(map(repr, unknown))} unknown; choose from: {', '.join(by_name)}")
    families = [by_name[w] for w in wanted]
    result = bench_planner(families, repeats=args.repeats, seed=args.seed, policy=args.policy,
                           search_budget=budget, peers=not args.no_peers, ranks_per_node=args.ranks_per_node)
    large_names = list(by_name) if args.large_families == "all" else [
        s.strip() for s in args.large_families.split(",") if s.strip()]
    unknown = [w for w in large_names if w not in by_name]
    if unknown:
        raise CliError(f"--large-families: {', '.join(map(repr, unknown))} unknown; choose from: all, {', '.join(by_name)}")
    if not args.small_only:  # the large batches: 131,072 samples on 8,192 ranks (lognormal: the earlier benchmark's)
        large = [replace(by_name[w], name=f"{w}-large", budgets=((8_192, dict(by_name[w].budgets)[512]),))
                 for w in large_names]
        more = bench_planner(large, ((8_192, 1_000.0),), repeats=args.large_repeats, seed=args.seed,
                             policy=args.policy, search_budget=budget, peers=False, ranks_per_node=args.ranks_per_node)
        result["planner"] += more["planner"]
        result["passed"] = result["passed"] and more["passed"]
    logger.info("planner bench: %d batches, passed=%s", len(result["planner"]), result["passed"])
    if args.json:
        _emit_json(result)
        return 0
    from rich.table import Table

    def peer(r: dict[str, Any], key: str) -> list[str]:
        p = r.get(key)
        if p is None:
            return ["-", "-", "-"]
        if "error" in p:
            return ["n/a", "n/a", p["error"][:40]]
        eff = f"{p['efficiency']:.3f}" + ("" if p["budget_ok"] else " (>B)")
        return [f"{p['median_ms']:.1f}", f"{p['median_cpu_ms']:.1f}", eff]

    table = Table(title=f"planner speed (policy {args.policy}, search budget {budget}); "
                        f"peer: {result['megatron_core']['note']}")
    for col in ("family", "N", "samples", "ms", "CPU ms", "eff.", "target", "result",
                "mcore ms", "mcore CPU", "mcore eff.", "dcp-port ms", "dcp-port CPU", "dcp-port eff."):
        table.add_column(col, justify="left" if col == "family" else "right")
    for r in result["planner"]:
        table.add_row(
            r["family"], str(r["ranks"]), str(r["samples"]), f"{r['median_ms']:.1f}", f"{r['median_cpu_ms']:.1f}",
            f"{r['efficiency']:.3f}", f"{r['target_ms']:.0f}", "[green]PASS[/green]" if r["passed"] else "[red]FAIL[/red]",
            *peer(r, "megatron_core"), *peer(r, "megatron_dcp_port"),
        )
    con = _console()
    con.print(table)
    for note in result["notes"]:
        con.print(f"note: {note}")
    return 0


def _bench_device(args: argparse.Namespace) -> int:
    """``hdp bench device``: the device check (:mod:`hdp.trainer.bench.device`); a plain table, no rich (a bare
    GPU machine may lack it)."""
    from hdp.trainer.bench.device import BUDGET_S, ROWS, bench_device, format_table

    rows = None
    if args.rows is not None:
        rows = [r.strip() for r in args.rows.split(",") if r.strip()]
        bad = [r for r in rows if r not in ROWS]
        if bad or not rows:
            raise CliError(f"--rows={args.rows!r}: rows are {', '.join(ROWS)}")
    budget = BUDGET_S if args.budget is None else args.budget
    if not (math.isfinite(budget) and budget > 0):
        raise CliError(f"--budget={args.budget!r}: pass seconds > 0 (default {BUDGET_S:g})")
    out = check_output_dir("--out", args.out) if args.out is not None else None

    def progress(row: dict[str, Any]) -> None:
        print(f"hdp bench device: {row['row']} {row['status']} ({row['seconds']:.1f} s)", file=sys.stderr, flush=True)

    result = bench_device(dry_run=args.dry_run, device=args.device, out_dir=out, rows=rows, budget_s=budget,
                          on_row=progress)
    if args.json:
        _emit_json(result)
    else:
        print(format_table(result))
    bad_rows = [r["row"] for r in result["rows"] if r["status"] in ("fail", "error")]
    return 1 if args.strict and bad_rows else 0
