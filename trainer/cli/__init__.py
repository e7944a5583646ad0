"""The ``hdp`` command line: plan, simulate, benchmark, calibrate and the demos.

Human output uses rich tables; ``--json`` prints exactly one JSON object on stdout (logs and
progress go to stderr).  User errors print ``error: <message>`` to stderr and exit with code 2.
Subcommands live in :mod:`.planning` (with the memory options of :mod:`.memory`), :mod:`.calibrate`,
:mod:`.bench` and :mod:`.demo`; shared helpers in :mod:`.common`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from hdp.trainer.cli.bench import _cmd_bench
from hdp.trainer.cli.common import ALL_POLICIES, CliError, _add_batch_args, _add_domain_args
from hdp.trainer.cli.demo import _cmd_demo
from hdp.trainer.cli.memory import add_memory_args
from hdp.trainer.cli.calibrate import _cmd_calibrate
from hdp.trainer.cli.planning import _cmd_plan, _cmd_simulate


__all__ = ["main", "build_parser", "CliError"]


class _Parser(argparse.ArgumentParser):
    """argparse with its usage errors on one line (``error: hdp plan: argument --samples: ...``), exit 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of the ``hdp`` command."""
    from hdp.packing.workloads import WORKLOADS

    parser = _Parser(
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
    add_memory_args(p)
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
    add_memory_args(s)
    s.set_defaults(func=_cmd_simulate)

    b = sub.add_parser("bench", help="benchmarks: attention kernels, planner speed, MoE zero-memory, verl engine, "
                                         "training throughput, fault injection")
    b.add_argument("what", choices=("attention", "planner", "exact", "moe", "verl", "train", "faults", "memory"))
    b.add_argument("--only", default=None, metavar="A,B",
                   help="faults: scenarios to run (in-process, other-world, sigkill-mid-step, sigstop-mid-step, "
                        "sigkill-during-save, verl; default all); memory: cases to run (their names, or 'limit')")
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
    b.add_argument("--families", default=None, metavar="A,B",
                   help="planner: batch families to time (default all: the suite's distributions, short-reasoning, "
                        "pareto, rl-grouped-16)")
    b.add_argument("--no-peers", action="store_true", dest="no_peers",
                   help="planner: skip megatron-core's scheduler and the megatron-dcp port")
    b.add_argument("--search-budget", default="default", dest="search_budget", metavar="SPEC",
                   help="planner: hdp's search budget ('default', 'off' or key=value pairs)")
    b.add_argument("--seed", type=int, default=0, help="planner / exact: workload seed")
    b.add_argument("--instances", type=int, default=20, help="exact: random small instances (default 20)")
    b.add_argument("--json", action="store_true", help="print one JSON object")
    b.set_defaults(func=_cmd_bench)

    d = sub.add_parser("demo", help="CPU demo: train a small GPT on 4 gloo ranks with static CP, then HDP; "
                                    "--verl: a few GRPO steps through verl's main_ppo with model_engine=hdp")
    d.add_argument("--verl", action="store_true", help="run verl's main_ppo (tiny Qwen3, 2 CPU ranks) instead")
    d.add_argument("--ranks", type=int, default=None, help="local gloo ranks (default 4; --verl: 2)")
    d.add_argument("--steps", type=int, default=None, help="steps (default 3; the first a warm-up)")
    d.add_argument("--out", default="out/demo", help="folder for the Gantt chart and the JSON result")
    d.set_defaults(func=_cmd_demo)

    c = sub.add_parser("calibrate", help="fit the cost model (and the memory model, from memory records) to measured "
                                         "records (JSON lines)")
    c.add_argument("--records", required=True, metavar="FILE.jsonl", help="measured records")
    c.add_argument("--out", metavar="COST.json", default=None,
                   help="write the cost-model file (hdp plan / simulate --cost-model read it)")
    c.add_argument("--profile", default=None,
                   help="base profile for parameters the records cannot determine (default h100-nvlink)")
    c.add_argument("--model", default=None, help="base model preset (default deepseek-v3)")
    c.add_argument("--memory-cover", action="store_true", dest="memory_cover",
                   help="memory records: scale the fitted dynamic part up until no record's peak is under-predicted")
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
