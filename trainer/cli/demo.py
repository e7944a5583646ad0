"""``hdp demo``: the CPU demo (static CP, then HDP, on local gloo ranks)."""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

from hdp.trainer.cli.bench import _print_train_table
from hdp.trainer.cli.common import CliError, _console
from hdp.trainer.cli.output import check_output_dir, write_atomic

TITLE = "hdp demo: static CP vs HDP"
"""How the demo's output starts: its table's title."""


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.verl and args.out == "out/demo":
        args.out = "out/verl-demo"
    check_output_dir("--out", args.out)  # before the run, not after it
    if args.verl and args.smoke:
        raise CliError("--smoke: the library demo's smallest mode; for verl's use hdp demo --verl --steps 1")
    if (args.critic or args.set) and not args.verl:
        flag = "--critic" if args.critic else "--set"
        raise CliError(f"{flag}: a flag of hdp demo --verl (verl's main_ppo)")
    for kv in args.set or []:
        if "=" not in kv or kv.startswith("="):
            raise CliError(f"--set {kv!r}: pass a verl override KEY=VALUE")
    if args.verl:
        return _verl_demo(args)
    from hdp.packing.cost import CostModel
    from hdp.packing.plan import Plan
    from hdp.trainer.bench.train import SMOKE, TrainBenchSpec, bench_train
    from hdp.trainer.cli.gantt import plot_gantt

    try:
        spec = TrainBenchSpec(ranks=args.ranks if args.ranks is not None else 4,
                              steps=args.steps if args.steps is not None else 3, alternate=False, workload="short-tail",
                              **(SMOKE if args.smoke else {}))
    except ValueError as exc:
        raise CliError(f"demo: {exc} (--ranks / --steps)") from exc
    _check_capacity(spec.ranks)
    con = _console()
    # the output starts with the table: while the ranks train, a terminal shows a transient status only
    running = (con.status(f"hdp demo: training static CP, then HDP, on {spec.ranks} gloo ranks (a few minutes on "
                          "a laptop)") if con.is_terminal else contextlib.nullcontext())
    with running:
        result = bench_train(spec)
    _print_train_table(result, f"{TITLE} on {spec.ranks} gloo ranks (CPU)",
                       about=f"GPT {spec.num_layers} layers x {spec.hidden_size}, vocab {spec.vocab_size}, "
                             f"{spec.samples} samples per step, B={spec.max_tokens_per_rank} tokens/rank; static "
                             "CP first, then HDP, on the same batches and weights")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cal = result.get("calibration", {})
    from hdp.packing.cost import PARAMETERS as fields  # every CostModel field, as calibrate's to_dict has them
    cost = CostModel(**{k: cal[k] for k in fields}) if all(k in cal for k in fields) else None
    if cost is None:
        from hdp.core.stack import resolve_cost
        from hdp.trainer.bench.train import _engine_config

        config = _engine_config(spec, "hdp", None)
        cost = resolve_cost(config.planning, config.model.shape, "cpu")  # the engines' own auto model
    gantt = out / "demo_hdp_plan.png"
    plot_gantt(Plan.from_dict(result["plans"]["hdp"]), cost, gantt, title="HDP plan of the demo batch (step 1)",
               flag="--out")
    write_atomic(out / "demo_result.json", json.dumps(result, default=str, indent=1), "--out")
    con.print(f"Gantt chart of the HDP plan: {gantt}; full result: {out / 'demo_result.json'}")
    return 0 if result["loss_match"] else 1


def _check_capacity(ranks: int) -> None:
    """CliError naming --ranks, before anything starts, when this machine cannot run that many local ranks."""
    from hdp.trainer.launch import check_local_capacity

    try:
        check_local_capacity(ranks)
    except ValueError as exc:
        raise CliError(f"--ranks={ranks}: {exc}") from exc


def _verl_demo(args: argparse.Namespace) -> int:
    """``hdp demo --verl``: found through the "hdp.demos" entry point (the trainer never imports integrations)."""
    from importlib.metadata import entry_points

    found = [ep for ep in entry_points(group="hdp.demos") if ep.name == "verl"]
    if not found:
        raise ValueError("hdp demo --verl: no 'hdp.demos' entry point 'verl'; install hdp-engine with its verl "
                         "extra (pip install -e '.[verl]' in a checkout)")
    out = args.out
    ranks = args.ranks if args.ranks is not None else 2
    steps = args.steps if args.steps is not None else 3
    _check_capacity(ranks)
    con, err = _console(), _console(stderr=True)

    def echo(text: str, *, error: bool = False) -> None:
        (err if error else con).print(text, markup=False, soft_wrap=True)

    extra = ["--critic"] if getattr(args, "critic", False) else []
    extra += [f"--set={kv}" for kv in (getattr(args, "set", None) or [])]
    return int(found[0].load()(["--out", out, "--ranks", str(ranks), "--steps", str(steps), *extra], echo=echo))
