"""Bad command-line input gets one clear error line naming the field, the value and the fix — never
a traceback, never a run that is then lost, never a success that checked nothing."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys

import pytest

from hdp.trainer.cli import main


@pytest.fixture
def no_run(monkeypatch):
    """Fail the test if a benchmark would start: every check must come before any rank is spawned."""
    import benchmarks.faults as bench_faults
    import hdp.trainer.bench.train as bench_train

    def boom(*a, **k):
        raise AssertionError("a run started before the input was checked")

    monkeypatch.setattr(bench_train, "bench_train", boom)
    monkeypatch.setattr(bench_faults, "run_faults", boom)
    from benchmarks import ci

    for name in ci.RUNNERS:  # hdp bench regress --preset ci: no benchmark of it starts either
        monkeypatch.setitem(ci.RUNNERS, name, boom)
    import hdp.trainer.launch as launch

    def spawn_checked(fn, world_size, *a, **k):  # the capacity check runs; a real start does not
        launch.check_local_capacity(world_size)
        boom()

    monkeypatch.setattr(launch, "spawn", spawn_checked)


def _files(tmp_path):
    out = {}
    for name, text in {"empty-object": "{}", "list": "[1]", "no-results": '{"results": []}',
                       "text-tps": '{"results": {"hdp": {"tokens_per_s": "fast"}}}',
                       "nan-tps": '{"results": {"hdp": {"tokens_per_s": NaN}}}',
                       "other-policy": '{"results": {"verl-kk": {"tokens_per_s": 3.0}}}',
                       "bad-speedup": '{"results": {"hdp": {"tokens_per_s": 3.0}}, "speedup": {"hdp": null}}',
                       "not-json": "tokens 3"}.items():
        p = tmp_path / f"{name}.json"
        p.write_text(text)
        out[name] = str(p)
    huge = {"format": "hdp-cost-model", "version": 2, "parameters": {
        "linear_coef": 1e308, "round_cost": 1e308, "step_overhead": 0.0, "step_latency": 0.0, "comm_per_token": 0.0,
        "merge_per_token": 0.0, "cp_per_token": 0.0, "unit_time_s": 1e-9}}
    (tmp_path / "huge.json").write_text(json.dumps(huge))
    out["huge"] = str(tmp_path / "huge.json")
    (tmp_path / "deep.json").write_text("[" * 200_000 + "]" * 200_000)
    out["deep"] = str(tmp_path / "deep.json")
    import random

    rng = random.Random(0)  # seconds unrelated to the work: a fit that explains nothing
    noise = [{"kind": "group", "lengths": [rng.randint(100, 9000)], "group_size": 1, "seconds": rng.uniform(0.1, 1.0)}
             for _ in range(200)]
    (tmp_path / "noise.jsonl").write_text("".join(json.dumps(r) + "\n" for r in noise))
    out["noise"] = str(tmp_path / "noise.jsonl")
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "binary.txt").write_bytes(bytes(range(128, 256)))
    out["a-file"] = str(tmp_path / "a-file")
    out["binary"] = str(tmp_path / "binary.txt")
    out["dir"] = str(tmp_path)
    os.mkfifo(tmp_path / "fifo.json")  # opening it to read blocks until a writer comes: none does
    out["fifo"] = str(tmp_path / "fifo.json")
    from benchmarks.ci import BASELINE_FILE

    committed = json.loads(BASELINE_FILE.read_text())["rows"]
    for name, rows in {"no-rows": {}, "attention-half": {"attention-exact": True},
                       "huge-ratio": {**committed, "attention-efficiency": 1e300},
                       "minus-huge": {**committed, "train-pp1-speedup": -1e300},
                       "negative-ratio": {**committed, "verl-door-overhead": -1.2},
                       "zero-ratio": {**committed, "planner-time": 0},
                       "big-int": {**committed, "nodes-speedup": 10**400},
                       "too-efficient": {**committed, "planner-efficiency": 1.5},
                       "flag-number": {**committed, "faults-ok": 1}}.items():
        (tmp_path / f"{name}.json").write_text(json.dumps({"rows": rows}))
        out[name] = str(tmp_path / f"{name}.json")
    (tmp_path / "nan-row.json").write_text('{"rows": {"attention-efficiency": NaN, "attention-exact": true}}')
    out["nan-row"] = str(tmp_path / "nan-row.json")
    (tmp_path / "padded.json").write_text(json.dumps({"rows": committed}) + " " * (1 << 20))
    out["padded"] = str(tmp_path / "padded.json")
    return out


CASES = [
    (["bench", "train", "--baseline", "{empty-object}"], "field 'results' is None"),
    (["bench", "train", "--baseline", "{list}"], "holds a JSON list"),
    (["bench", "train", "--baseline", "{no-results}"], "field 'results' is []"),
    (["bench", "train", "--baseline", "{text-tps}"], "'results.hdp.tokens_per_s' is 'fast'"),
    (["bench", "train", "--baseline", "{nan-tps}"], "'results.hdp.tokens_per_s' is nan"),
    (["bench", "train", "--baseline", "{other-policy}"], "share none with --policies"),
    (["bench", "train", "--baseline", "{bad-speedup}"], "'speedup.hdp' is None"),
    (["bench", "train", "--baseline", "{not-json}"], "cannot read a JSON result"),
    (["bench", "train", "--baseline", "{fifo}"], "is not a regular file"),
    (["bench", "train", "--baseline", "/dev/zero"], "is not a regular file"),
    (["bench", "train", "--tolerance", "nan"], "--tolerance=nan"),
    (["bench", "train", "--tolerance", "-0.1"], "--tolerance=-0.1"),
    (["bench", "train", "--policies", "hdp,bogus"], "policy='bogus' is unknown"),
    (["bench", "train", "--ranks", "0"], "argument --ranks: 0 is out of range"),
    (["bench", "train", "--steps", "0"], "argument --steps: 0 is out of range"),
    (["bench", "train", "--output", "{dir}"], "is a directory"),
    (["benchmarks", "faults", "--only", "sigkill,bogus"], "scenario='sigkill' is unknown"),
    (["benchmarks", "faults", "--timeout", "nan"], "--timeout=nan"),
    (["simulate", "--workload", "rl", "-N", "8", "-B", "8192", "--no-peers", "--plot-dir", "{a-file}"],
     "is a file; name a folder"),
    (["plan", "--lengths", "{binary}", "-N", "8", "-B", "8192"], "binary.txt"),
    (["plan", "--workload", "rl", "-N", "8", "-B", "8192", "--cost-model", "{huge}"], "above 1e+30 units"),
    (["plan", "--workload", "rl", "-N", "8", "-B", "8192", "--cost-model", "{deep}"], "nested too deeply"),
    (["plan", "--workload", "rl", "-N", "8", "-B", "8192", "--cost-model", "/dev/zero"], "is not a regular file"),
    (["plan", "--lengths", "/dev/zero", "-N", "8", "-B", "8192"], "is not a regular file"),
    (["plan", "--workload", "rl", "--samples", "1e10", "-N", "8", "-B", "8192"], "[1, 10,000,000]"),
    (["plan", "--workload", "rl", "-N", "8", "-B", "8192", "--plot", "{dir}"], "--plot=" ),
    (["demo", "--out", "{a-file}"], "is a file; name a folder"),
    (["bench", "train", "--ranks", "10000"], "local ranks"),
    # the job: its model, layout, lengths and device, checked before any rank starts
    (["bench", "train", "--model", "nope"], "--model='nope': no such file and no shape preset"),
    (["bench", "train", "--model", "{not-json}"], "not valid JSON"),
    (["bench", "train", "--lengths", "{dir}"], "--lengths '{dir}' is not a regular file"),
    (["bench", "train", "--lengths", "{not-json}"], "'tokens 3' is not a list of integers"),
    (["bench", "train", "--ranks", "2", "--tp", "2", "--model", "dense-8b", "--layers", "3", "--pp", "2"],
     "ranks=2: must be a multiple of tp x pp = 2 x 2"),
    (["bench", "train", "--ranks", "4", "--pp", "2", "--layers", "3"], "num_layers=3 is not divisible by pp"),
    (["bench", "train", "--device", "npu"], "'npu': torch_npu/CANN is not available"),
    (["bench", "train", "--peak-tflops", "nan"], "--peak-tflops=nan"),
    (["bench", "regress"], "--baseline: the job preset compares with a baseline of this machine and job"),
    (["bench", "regress", "--preset", "ci", "--tp", "2"], "--tp: flags of the job preset"),
    (["bench", "regress", "--preset", "nightly"], "no preset file 'benchmarks/nightly.py'"),
    (["bench", "regress", "--allow-lower", "--baseline", "{a-file}"], "--allow-lower: a flag of --update"),
    (["calibrate", "--records", "{noise}"], "the fit explains nothing"),
    (["calibrate", "--records", "/dev/zero"], "records file '/dev/zero' is not a regular file"),
    (["calibrate", "--records", "{dir}"], "is not a regular file (a directory or a device)"),
    (["bench", "regress", "--preset", "ci", "--only", "attention,warp"], "'warp' unknown"),
    (["bench", "regress", "--preset", "ci", "--only", "attention", "--baseline", "{text-tps}"], "field 'rows' is None"),
    (["bench", "regress", "--preset", "ci", "--only", "attention", "--baseline", "{dir}/missing.json"], "no such file"),
    # the baseline file: a regular file of at most 1 MiB (a FIFO is never opened), read before anything runs
    (["bench", "regress", "--preset", "ci", "--only", "attention", "--baseline", "{fifo}"], "--baseline '{fifo}' is not a regular file"),
    (["bench", "regress", "--preset", "ci", "--only", "attention", "--baseline", "/dev/zero"], "--baseline '/dev/zero' is not a regular"),
    (["bench", "regress", "--preset", "ci", "--only", "attention", "--baseline", "{dir}"], "is not a regular file"),
    (["bench", "regress", "--preset", "ci", "--only", "attention", "--baseline", "{padded}"], "more than the 1048576"),
    (["bench", "regress", "--preset", "ci", "--only", "attention", "--update", "--baseline", "{fifo}"],
     "--baseline='{fifo}' is a FIFO (named pipe)"),
    (["bench", "regress", "--preset", "ci", "--only", "attention", "--update", "--baseline", "/dev/zero"], "is a character device"),
    (["bench", "regress", "--preset", "ci", "--only", "attention", "--update", "--baseline", "{dir}"], "is a directory"),
    (["bench", "regress", "--preset", "ci", "--only", "attention", "--update", "--baseline", "{dir}/no-such-folder/b.json"],
     "the folder '{dir}/no-such-folder' does not exist"),
    # every row the run measures has a figure in it
    (["bench", "regress", "--preset", "ci", "--baseline", "{no-rows}"], "no figure for row(s) attention-efficiency, attention-exact, "
                                                      "train-pp1-speedup"),
    (["bench", "regress", "--preset", "ci", "--only", "attention", "--baseline", "{attention-half}"],
     "no figure for row(s) attention-efficiency, which this run measures"),
    # each figure finite and inside its row's range
    (["bench", "regress", "--preset", "ci", "--only", "attention", "--baseline", "{huge-ratio}"],
     "'rows.attention-efficiency' is 1e+300; it must be a number in (0, 2]"),
    (["bench", "regress", "--preset", "ci", "--only", "attention", "--baseline", "{minus-huge}"],
     "'rows.train-pp1-speedup' is -1e+300; it must be a number in (0, 100]"),
    (["bench", "regress", "--preset", "ci", "--only", "attention", "--baseline", "{negative-ratio}"],
     "'rows.verl-door-overhead' is -1.2; it must be a number in (0, 100]"),
    (["bench", "regress", "--preset", "ci", "--only", "attention", "--baseline", "{zero-ratio}"],
     "'rows.planner-time' is 0; it must be a number in (0, 10000]"),
    (["bench", "regress", "--preset", "ci", "--only", "attention", "--baseline", "{big-int}"], "'rows.nodes-speedup' is 'an integer of 401"),
    (["bench", "regress", "--preset", "ci", "--only", "attention", "--baseline", "{too-efficient}"],
     "'rows.planner-efficiency' is 1.5; it must be a number in (0, 1]"),
    (["bench", "regress", "--preset", "ci", "--only", "attention", "--baseline", "{nan-row}"], "'rows.attention-efficiency' is nan"),
    (["bench", "regress", "--preset", "ci", "--only", "attention", "--baseline", "{flag-number}"], "'rows.faults-ok' is 1; it must be true"),
    # renamed flags name their new spelling (hdp.trainer.cli.common.MOVED_FLAGS), and --model of a shape --shape
    (["simulate", "--workload", "rl", "-N", "8", "-B", "8192", "--moe-zero-memory", "level1"],
     "--moe-zero-memory was renamed --zero-memory on 2026-12-04, see CHANGES.md: pass --zero-memory LEVEL"),
    (["plan", "--workload", "rl", "-N", "8", "-B", "8192", "--search-max-samples", "5"],
     "--search-max-samples was renamed --search-budget on 2026-12-01, see CHANGES.md: pass --search-budget SPEC"),
    (["plan", "--workload", "rl", "-N", "64", "--memory-gb", "80", "--model", "qwen3-235b-a22b", "--layout",
      "tp1,pp8,ep16"], "--model names the cost preset only since 2026-12-04 (it named the shape before; see "
                       "CHANGES.md); pass --shape qwen3-235b-a22b instead of --model qwen3-235b-a22b"),
]


@contextlib.contextmanager
def _hang_fails(seconds: int):
    """Raise in the test when the body runs longer than ``seconds`` (a blocking open or read is interrupted)."""
    def alarm(signum, frame):
        raise TimeoutError(f"the command was still running after {seconds} s (a blocking read?)")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("argv,needle", CASES, ids=[" ".join(a[:3]) + f" #{i}" for i, (a, _) in enumerate(CASES)])
def test_bad_input_is_one_clear_line_before_any_run(argv, needle, tmp_path, capsys, no_run):
    files = _files(tmp_path)
    argv = [a.format(**files) for a in argv]
    with _hang_fails(60):  # a check that opens a FIFO (or reads /dev/zero) waits forever: a failure
        if argv[0] == "benchmarks":  # this project's CI benches: python -m benchmarks (outside the wheel)
            from benchmarks.cli import main as bench_main

            rc = bench_main(argv[1:])
        else:
            rc = main(argv)
    captured = capsys.readouterr()
    assert rc == 2, captured
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err  # one line, no traceback
    assert needle.format(**files) in lines[0], captured.err
    assert captured.out == "" or json.loads(captured.out) is not None  # nothing half-printed on stdout


def test_calibrate_rejects_a_huge_outlier_by_name_and_fits_the_rest(tmp_path) -> None:
    """One record of length 10^12 among 400: ``hdp calibrate`` exits 0 with one warning line
    naming records[399], and the fitted model equals the fit of the 399 other records alone."""
    from hdp.packing import cost_model
    from hdp.packing.calibrate import group_seconds

    machine = cost_model("cpu-tiny", "cpu-gloo")
    rng = random.Random(0)
    records = []
    for _ in range(399):
        k = rng.choice([1, 1, 2, 4])
        lengths = [rng.randint(200, 8000) for _ in range(rng.randint(1, 3))]
        seconds = group_seconds(machine, lengths, k) * (1 + rng.uniform(-0.02, 0.02))
        records.append({"kind": "group", "lengths": lengths, "group_size": k, "seconds": seconds})
    outlier = {"kind": "group", "lengths": [10**12], "group_size": 1, "seconds": 0.5}
    fits = {}
    for name, recs in (("clean", records), ("outlier", records + [outlier])):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in recs))
        out = subprocess.run([sys.executable, "-m", "hdp.trainer", "calibrate", "--records", str(path), "--json"],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        fits[name] = (json.loads(out.stdout), out.stderr.strip().splitlines())
    doc, err = fits["outlier"]
    assert len(err) == 1 and "rejected 1 record(s)" in err[0] and "records[399]" in err[0], err
    assert "lengths [1000000000000]" in err[0] and doc["fit"]["warnings"] == [err[0].split(": ", 1)[1]], (err, doc)
    assert fits["clean"][1] == [], fits["clean"][1]
    assert doc["fit"]["n_records"] == 399 and doc["fit"]["r2"] > 0.99, doc["fit"]
    assert doc["parameters"] == fits["clean"][0]["parameters"]
