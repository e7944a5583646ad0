"""Helpers every ``hdp`` subcommand shares: arguments, lengths, cost models, JSON and tables."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

import numpy as np

from hdp.packing.moved import Moved
from hdp.packing.profiles import DEFAULT_MODEL, DEFAULT_PROFILE
from hdp.packing.workloads import MAX_LENGTHS_BYTES, MAX_SAMPLES  # the caps of --samples and --lengths


logger = logging.getLogger("hdp.cli")


ALL_POLICIES = ("hdp", "hdp-pow2", "static-cp", "megatron-dcp", "ascend-hdp", "verl-kk")


CONTRACT_KEYS = (
    "policy", "ranks", "rounds", "step_time", "lower_bound", "efficiency", "max_idle_ratio",
    "cp_degree_hist", "planner_ms",
)


ASCEND_TARGET = 1.39


EFFICIENCY_TARGET = 0.95


MOVED_FLAGS: dict[str, Moved] = {
    "--moe-zero-memory": Moved("--zero-memory", "2026-12-04", how="--zero-memory LEVEL"),
    "--search-max-samples": Moved("--search-budget", "2026-12-01",
                                  how="--search-budget SPEC ('default', 'off' or pools, e.g. search=2000000)"),
}
"""Flags that were renamed (`hdp.packing.moved.Moved`): an unrecognised one is named with its new spelling
(`hdp.trainer.cli.main`).  ``--model NAME`` of a model shape (plan, simulate), ``--shape NAME`` since
2026-12-04, is a change of meaning, not of spelling: `hdp.trainer.cli.memory.memory_setup` names it."""


class CliError(ValueError):
    """A user error the CLI reports as ``error: ...`` with exit code 2."""


class Parser(argparse.ArgumentParser):
    """argparse with its usage errors on one line (``error: hdp plan: argument --samples: ...``), exit 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def _int_in(text: str, low: int, high: int | None, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; pass {what}") from None
    if value < low or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"{value} is out of range; pass {what}")
    return value


def positive_int(text: str) -> int:
    """argparse type of a count or size: a whole number >= 1 (argparse names the flag and the value)."""
    return _int_in(text, 1, None, "a whole number >= 1")


def nonnegative_int(text: str) -> int:
    """argparse type of a count that may be 0: a whole number >= 0."""
    return _int_in(text, 0, None, "a whole number >= 0")


MAX_SEED = 2**32 - 1
"""Largest seed (numpy's legacy seeding, which some workloads use, takes [0, 2^32 - 1])."""


def seed_int(text: str) -> int:
    """argparse type of a random seed: a whole number in [0, 2^32 - 1]."""
    return _int_in(text, 0, MAX_SEED, f"a seed in [0, {MAX_SEED}]")


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
    src.add_argument("--lengths", metavar="FILE",
                     help=f"text file with one sample length per line (gzip when it ends in .gz; at most "
                          f"{MAX_SAMPLES:,} lengths and {MAX_LENGTHS_BYTES >> 20} MiB unpacked)")
    src.add_argument("--workload", metavar="NAME", help="built-in workload generator (see --help-workloads)")
    p.add_argument("--samples", type=_sample_count, default=1024,
                   help=f"samples to draw with --workload (default 1024, at most {MAX_SAMPLES:,})")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of --workload (default 0)")


def _add_domain_args(p: argparse.ArgumentParser, *, required: bool = True) -> None:
    p.add_argument("--ranks", "-N", type=positive_int, required=required, help="N: ranks in the domain")
    p.add_argument(
        "--max-tokens-per-rank", "-B", type=positive_int, default=None, dest="max_tokens_per_rank",
        help="B: per-rank token budget of one round (required unless --memory-gb derives it; then a cap on it)",
    )
    p.add_argument("--group-shape", default="any", help="any (contiguous ranges) or pow2 (aligned blocks)")
    _add_cost_args(p)
    p.add_argument("--static-cp", type=positive_int, default=None, dest="static_cp",
                   help="CP size k for static-cp style baselines (default: smallest fitting power of two)")
    p.add_argument("--search-budget", default="default", dest="search_budget", metavar="SPEC",
                   help="hdp: work it may spend beyond its first plan (hdp.packing.SearchBudget): 'default', "
                        "'off' (no local search) or pools, e.g. construct=20000,search=2000000,rivals=65536")
    p.add_argument("--pp", type=positive_int, default=None, dest="pp", metavar="P",
                   help="pipeline stages: the step time counts (P - 1) x the longest round more, and hdp plans for it "
                        "(default 1, or the PP of --layout)")
    p.add_argument("--ranks-per-node", type=positive_int, default=None, dest="ranks_per_node", metavar="R",
                   help="consecutive domain ranks per node (hdp.packing.topology.node_map): a CP ring across nodes runs "
                        "at the profile's inter-node link and hdp keeps groups inside nodes where cheaper (default: one node)")


def _add_cost_args(p: argparse.ArgumentParser) -> None:
    """--cost-model FILE, or --profile/--model/--linear-coef (a preset pair); not both."""
    p.add_argument("--cost-model", metavar="SPEC", dest="cost_model", default=None,
                   help="a cost-model file (hdp calibrate --out) or a preset MODEL@PROFILE, as cost_model means in "
                        "the library and verl; replaces --profile/--model/--linear-coef")
    p.add_argument("--profile", default=None, help=f"hardware profile (default {DEFAULT_PROFILE})")
    model = p.add_mutually_exclusive_group()
    model.add_argument("--model", default=None,
                       help=f"cost-model preset (default {DEFAULT_MODEL}, or with --shape the preset of that name)")
    model.add_argument("--linear-coef", type=float, default=None, help="linear coefficient a instead of a preset")


def _sample_count(text: str) -> int:
    """argparse type of --samples: an integer (``1e4`` notation accepted) in [1, MAX_SAMPLES]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of samples") from None
    if not value.is_integer() or not 1 <= value <= MAX_SAMPLES:
        raise argparse.ArgumentTypeError(f"{text!r}: pass a whole number of samples in [1, {MAX_SAMPLES:,}]")
    return int(value)


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
        try:
            return read_lengths(args.lengths)
        except ValueError as exc:
            raise CliError(f"--lengths: {exc}") from exc
    return get_workload(args.workload)(n=args.samples, seed=args.seed)


def _cost(args: argparse.Namespace):  # noqa: ANN202
    """The cost model of --cost-model SPEC (file or MODEL@PROFILE), or of the --model/--linear-coef and
    --profile presets (--model defaults to the --shape's name, then deepseek-v3)."""
    from hdp.packing import cost_model
    from hdp.packing.cost_file import resolve_cost

    if getattr(args, "cost_model", None):
        given = [f for f, v in (("--profile", args.profile), ("--model", args.model),
                                ("--linear-coef", args.linear_coef)) if v is not None]
        if given:
            raise CliError(
                f"--cost-model and {'/'.join(given)} are mutually exclusive: the cost-model file holds every "
                f"parameter; drop {' '.join(given)} (or drop --cost-model to plan with the presets)"
            )
        try:
            return resolve_cost(args.cost_model, "--cost-model")
        except ValueError as exc:
            raise CliError(str(exc)) from exc
    model: Any = args.linear_coef if args.linear_coef is not None else (
        args.model or getattr(args, "shape", None) or DEFAULT_MODEL)  # a shape's cost preset by default
    return cost_model(model, args.profile or DEFAULT_PROFILE)


def _config(args: argparse.Namespace, policy: str, cost: Any = None, memory: Any = None):  # noqa: ANN202
    """The `PlannerConfig` of the options for ``policy``; ``memory`` (a `hdp.trainer.cli.memory.MemorySetup`)
    adds the memory limit and model (B is then derived, ``-B`` caps it)."""
    from hdp.packing import PlannerConfig

    shape = "pow2" if policy == "hdp-pow2" else args.group_shape  # hdp-pow2: hdp on power-of-two groups
    mem = {} if memory is None else {"memory_limit": memory.limit_bytes, "memory_model": memory.model}
    return PlannerConfig(
        **mem,
        num_ranks=args.ranks,
        max_tokens_per_rank=args.max_tokens_per_rank,
        policy="hdp" if policy == "hdp-pow2" else policy,
        group_shape=shape,
        cost=cost if cost is not None else _cost(args),
        static_cp_size=args.static_cp,
        search_budget=args.search_budget,
        pipeline_stages=args.pp,
        node_of=_node_of(args),
    )


def _node_of(args: argparse.Namespace) -> tuple[int, ...] | None:
    """The node map of --ranks-per-node over --ranks (None: one node)."""
    from hdp.packing.topology import node_map

    per = getattr(args, "ranks_per_node", None)
    return None if per is None else node_map(args.ranks, per)


def _entry(plan: Any, cost: Any) -> dict[str, Any]:
    from hdp.packing.suite import plan_entry

    return plan_entry(plan, cost)


def _hist_text(hist: dict[str, int], top: int = 6) -> str:
    items = list(hist.items())
    if len(items) <= top:
        return " ".join(f"CP{k}:{v}" for k, v in items)
    shown = sorted(sorted(items, key=lambda kv: -kv[1])[:top], key=lambda kv: int(kv[0]))
    return " ".join(f"CP{k}:{v}" for k, v in shown) + f" +{len(items) - top} sizes (max CP{items[-1][0]})"


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
