"""The ``hdp`` command line: plan, simulate, benchmark, calibrate and the demos.

Human output uses rich tables; ``--json`` prints exactly one JSON object on stdout (logs and
progress go to stderr).  User errors print ``error: <message>`` to stderr and exit with code 2; a
flag a sub-command does not take is such an error, naming the flag (and the sub-commands that take it).
Subcommands live in :mod:`.planning` (with the memory options of :mod:`.memory`), :mod:`.calibrate`,
:mod:`.bench` and :mod:`.demo`; shared helpers in :mod:`.common`; every file written goes through
:mod:`.output` (checked before the work, written atomically).  Counts and sizes take the argparse types
``positive_int`` / ``nonnegative_int`` / ``seed_int`` of :mod:`.common`.

Adding a benchmark: ``hdp bench`` has one sub-parser per bench, each with only its own flags.

* A bench of the trainer: write ``add_NAME(sub)`` in :mod:`.bench` — it calls
  ``_bench_parser(sub, NAME, help, run)`` (which adds ``--json``), adds its flags to the returned parser
  and returns it; ``run(args) -> int`` is the exit code — and append ``add_NAME`` to ``bench.BENCHES``.
* A bench of another package (verl's): an entry point in the ``hdp.benchmarks`` group,
  ``NAME = "module:runner"``, where ``runner(**flags) -> dict`` takes its parsed flags as keyword
  arguments and returns the result, and ``module`` defines ``add_arguments(parser)`` adding those flags.
  The module is imported only when ``hdp bench NAME`` runs (or its ``--help``), so that no other
  command imports it.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from hdp.packing.profiles import DEFAULT_MODEL, DEFAULT_PROFILE
from hdp.trainer.cli.bench import add_bench_parsers
from hdp.trainer.cli.common import (ALL_POLICIES, MOVED_FLAGS, CliError, Parser, _add_batch_args, _add_domain_args,
                                    nonnegative_int, positive_int, seed_int)
from hdp.trainer.cli.demo import _cmd_demo
from hdp.trainer.cli.memory import add_memory_args
from hdp.trainer.cli.calibrate import _cmd_calibrate
from hdp.trainer.cli.planning import _cmd_plan, _cmd_simulate


__all__ = ["main", "build_parser", "CliError", "positive_int", "nonnegative_int", "seed_int"]


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of the ``hdp`` command."""
    from hdp.packing.workloads import WORKLOADS

    parser = Parser(
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
    p.add_argument("--plot", metavar="FILE.png",
                   help="also write a Gantt chart (PNG, or PDF/SVG/JPEG by the suffix; a new name without one gets .png)")
    add_memory_args(p)
    p.set_defaults(func=_cmd_plan)

    s = sub.add_parser("simulate", help="compare policies on a batch, or run the built-in suite",
                       epilog=f"workloads: {', '.join(WORKLOADS)}")
    _add_batch_args(s, required=False)
    _add_domain_args(s, required=False)
    s.add_argument("--policies", default=",".join(ALL_POLICIES), help="comma-separated policies")
    s.add_argument("--suite", action="store_true", help="run the built-in benchmark suite")
    s.add_argument("--quick", action="store_true", help="suite: only N in {8, 64}; cluster: only N in {16, 64}")
    s.add_argument("--cluster", action="store_true",
                   help="run the cluster cases: domains of 16-1,024 ranks on nodes of 8 under the two-level cost model "
                        "(--model, default qwen3-235b-a22b, the model of the Ascend Qwen3-235B recipe's RL job in "
                        "docs/design.md; -N picks one size)")
    s.add_argument("--strict", action="store_true", help="suite: exit 1 when a check fails")
    s.add_argument("--no-peers", action="store_true", help="skip the megatron-core reference entry")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.add_argument("--plot-dir", metavar="DIR", help="write a Gantt chart per policy")
    s.add_argument("--moe-shape", default=None, metavar="NAME", dest="moe_shape",
                   help="with --zero-memory and a given -B (no --memory-gb/--layout): the MoE layer shape whose freed "
                        "memory raises B, planned side by side (qwen3-235b-a22b, deepseek-v3; default qwen3-235b-a22b)")
    add_memory_args(s)
    s.set_defaults(func=_cmd_simulate)

    b = sub.add_parser("bench", help="benchmarks: attention kernels, planner speed, MoE zero-memory, verl engine, "
                                     "training throughput, fault injection, memory model",
                       description="One sub-command per benchmark, each with its own flags (hdp bench BENCH --help).")
    add_bench_parsers(b)

    d = sub.add_parser("demo", help="CPU demo: train a small GPT on 4 gloo ranks with static CP, then HDP; "
                                    "--verl: a few GRPO steps through verl's main_ppo with model_engine=hdp")
    d.add_argument("--verl", action="store_true", help="run verl's main_ppo (tiny Qwen3, 2 CPU ranks) instead")
    d.add_argument("--critic", action="store_true", help="with --verl: PPO with GAE, the critic on hdp too (default GRPO)")
    d.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="with --verl: one more override of verl's main_ppo (repeatable)")
    d.add_argument("--ranks", type=positive_int, default=None, help="local gloo ranks (default 4; --verl: 2)")
    d.add_argument("--steps", type=positive_int, default=None, help="steps (default 3; the first a warm-up)")
    d.add_argument("--out", default="out/demo", help="folder for the Gantt chart and the JSON result")
    d.add_argument("--smoke", action="store_true", help="the library demo with a tiny GPT and batch (seconds; checks "
                                                        "that it runs, its figures are not the demo's)")
    d.set_defaults(func=_cmd_demo)

    c = sub.add_parser("calibrate", help="fit the cost model (and the memory model, from memory records) to measured "
                                         "records (JSON lines)")
    c.add_argument("--records", required=True, metavar="FILE.jsonl", help="measured records")
    c.add_argument("--out", metavar="COST.json", default=None,
                   help="write the cost-model file (hdp plan / simulate --cost-model read it)")
    c.add_argument("--profile", default=None,
                   help=f"base profile for parameters the records cannot determine (default {DEFAULT_PROFILE})")
    c.add_argument("--model", default=None, help=f"base model preset (default {DEFAULT_MODEL})")
    c.add_argument("--memory-cover", action="store_true", dest="memory_cover",
                   help="memory records: scale the fitted dynamic part up until no record's peak is under-predicted")
    c.add_argument("--json", action="store_true", help="print the cost-model file's JSON document")
    c.set_defaults(func=_cmd_calibrate)
    return parser


def _leaves(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Every sub-command's parser by its prog (``hdp bench train``), entry-point benches not yet loaded left out."""
    out: dict[str, argparse.ArgumentParser] = {}
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]  # noqa: SLF001
    if not subs:
        return {parser.prog: parser}
    for p in subs[0].choices.values():
        out.update(_leaves(p))
    return out


def _unrecognized(parser: argparse.ArgumentParser, args: argparse.Namespace, extra: Sequence[str]) -> str:
    """``error: hdp bench device: unrecognized arguments: --lengths x (--lengths is a flag of hdp plan, hdp simulate, hdp bench train, hdp bench regress)``; a
    renamed flag (`MOVED_FLAGS`) is named with its new spelling."""
    prog = " ".join(["hdp", args.command] + ([args.bench] if getattr(args, "bench", None) else []))
    leaves = _leaves(parser)
    hints = []

    def owners(flag: str) -> list[str]:
        return [name for name, p in leaves.items() if any(flag in a.option_strings for a in p._actions)]  # noqa: SLF001

    for flag in dict.fromkeys(e.split("=", 1)[0] for e in extra if e.startswith("-")):
        moved = MOVED_FLAGS.get(flag)
        if moved is not None:  # a renamed flag: its new spelling, here or where it is taken now
            takers = owners(moved.new)
            then = f"pass {moved.how}" if prog in takers else f"{moved.new} is a flag of {', '.join(takers)}"
            hints.append(f"{flag} was renamed {moved.new} on {moved.on}, see CHANGES.md: {then}")
            continue
        others = [name for name in owners(flag) if name != prog]
        if others:
            hints.append(f"{flag} is a flag of {', '.join(others)}")
    hint = f" ({'; '.join(hints)})" if hints else ""
    return f"error: {prog}: unrecognized arguments: {' '.join(extra)}{hint} (see {prog} --help)"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``hdp``; returns the exit code (2 for user errors)."""
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
    except SystemExit as exc:  # argparse usage errors (already printed) and --help
        return int(exc.code or 0) if not isinstance(exc.code, str) else 2
    if extra:
        print(_unrecognized(parser, args, extra), file=sys.stderr)
        return 2
    from hdp.trainer.quiet import quiet_third_party_warnings  # not hdp.trainer.launch: plan needs no torch

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
