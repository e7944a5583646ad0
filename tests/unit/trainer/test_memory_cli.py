"""The memory model on the command line : ``hdp plan/simulate --memory-gb --shape --layout``
derive B and keep every round's predicted peak within the limit, the what-if report compares with static
CP at the smallest CP size that fits, zero-memory shrinks the group a 32K sample needs, ``hdp calibrate``
fits the memory coefficients into the cost-model file that plan reads back, and bad input is one line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from hdp.packing import cost_model
from hdp.packing.calibrate import group_seconds, load_records
from hdp.packing.cost_file import load_memory_coefficients, read_cost_file
from hdp.packing.memory import GB, MemoryCoefficients, MemoryLayout, MemoryModel, fit_memory, memory_features, model_for
from hdp.trainer.cli import main

from helpers.memory_cli import ISSUE, QWEN, _check_plan_within_limit

"""The command the memory model's checks run."""


def _json_out(capsys):
    out = capsys.readouterr().out
    assert out.count("\n") == 1, out  # exactly one JSON object on stdout
    return json.loads(out)


def _error_line(capsys) -> str:
    cap = capsys.readouterr()
    assert "Traceback" not in cap.err and "Traceback" not in cap.out
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), cap.err
    return lines[0]


def test_issue_command_names_the_memory_the_longest_sample_needs_and_plans_with_zero_memory(capsys):
    # with neither recompute nor zero-memory (the defaults: the most memory) the batch's 18,682-token sample
    # needs 67 GB per device even on all 16 ranks: one line naming the setting, the figure and the fixes
    assert main(ISSUE) == 2
    line = _error_line(capsys)
    assert "18682 tokens fits no group of the domain" in line and "--memory-gb=64" in line
    assert re.search(r"needs 67(\.0)? GB", line) and "zero-memory" in line and "recompute" in line
    # the same job with MoE zero-memory level1 (or selective recompute) plans within 64 GiB
    for extra in (["--zero-memory", "level1"], ["--recompute", "selective"]):
        assert main(ISSUE + extra) == 0
        d = _json_out(capsys)
        _check_plan_within_limit(d, 64)
        assert d["whatif"]["token_budget"] == d["stats"]["token_budget"]
    # the derived budget grows with the level: level1 frees the expert activations
    assert main(ISSUE + ["--zero-memory", "level1"]) == 0
    b1 = _json_out(capsys)["stats"]["token_budget"]
    assert b1 == model_for(QWEN, MemoryLayout.parse("tp1,pp8,ep16", domain=16, zero_memory="level1")).token_budget(64 * GB)


def test_a_token_budget_caps_the_derived_one(capsys):
    assert main(ISSUE + ["--zero-memory", "level1", "-B", "2000"]) == 0
    d = _json_out(capsys)
    assert d["stats"]["token_budget"] == 2000 and d["stats"]["memory"]["within_limit"]


def test_whatif_json_every_round_within_the_limit_and_static_cp_at_the_smallest_fitting_size(capsys):
    assert main(ISSUE + ["--zero-memory", "level1"]) == 0
    d = _json_out(capsys)
    w, lim = d["whatif"], 64 * GB
    assert w["limit_bytes"] == lim and w["model"] == QWEN and w["layout"].startswith("tp1,pp8,ep16")
    assert "zero-memory level1" in w["layout"] and w["coefficients"] == MemoryCoefficients().to_dict()
    assert len(w["rounds"]) == d["num_rounds"]
    for r, groups in zip(w["rounds"], d["rounds"]):
        assert 0 < r["peak_bytes_min"] <= r["peak_bytes_max"] <= lim
        sizes = [hi - lo + 1 for lo, hi in (g["ranks"] for g in groups)]
        assert r["groups"] == {str(k): sizes.count(k) for k in sorted(set(sizes), reverse=True)}
    lg, b = w["longest"], w["token_budget"]
    assert lg["tokens"] == max(d["lengths"])
    k = lg["smallest_group"]
    assert -(-lg["tokens"] // k) <= b + 1 and -(-lg["tokens"] // (k - 1)) > b  # the fewest ranks it fits on
    assert lg["smallest_pow2"] >= k and lg["smallest_pow2"] & (lg["smallest_pow2"] - 1) == 0
    sizes = [e["cp_size"] for e in w["static_cp"]]
    assert sizes[0] == k and set(sizes) <= {k, lg["smallest_pow2"]}
    for e in w["static_cp"]:
        assert e["within_limit"] is True and e["peak_bytes"] <= lim
        assert e["time_ratio"] == pytest.approx(e["step_time"] / w["step_time"]) and e["time_ratio"] >= 1 - 1e-9
    assert w["step_time"] == pytest.approx(d["stats"]["step_time"])


def test_whatif_table(capsys):
    argv = [a for a in ISSUE if a != "--json"] + ["--zero-memory", "level1", "--samples", "64"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for needle in ("peak (worst rank)", "peak (least rank)", "against static CP", "static CP", "T / T(plan)",
                   "token budget B", "derived from the limit", "smallest group CP", "not calibrated", "64.0 GiB"):
        assert needle in out, needle


def test_zero_memory_level1_needs_a_smaller_cp_group_for_a_32k_sample(tmp_path, capsys):
    lengths = tmp_path / "qwen3_32k.txt"
    lengths.write_text("32768\n" + "2048\n" * 63)
    smallest = {}
    for zm in ("none", "level1"):
        argv = ["plan", "--lengths", str(lengths), "-N", "16", "--memory-gb", "96", "--shape", QWEN, "--layout",
                "tp1,pp8,ep16", "--recompute", "selective", "--zero-memory", zm, "--json"]
        assert main(argv) == 0
        d = _json_out(capsys)
        _check_plan_within_limit(d, 96)
        w = d["whatif"]
        smallest[zm] = w["longest"]["smallest_group"]
        assert w["static_cp"][0]["cp_size"] == smallest[zm]
        long_group = next(g for rnd in d["rounds"] for g in rnd if 0 in g["samples"])
        assert long_group["ranks"][1] - long_group["ranks"][0] + 1 >= smallest[zm]  # never narrower than it fits
    assert smallest == {"none": 13, "level1": 4}


def test_layout_sets_the_pipeline_stages_and_layout_alone_reports_peaks(capsys):
    argv = ["plan", "--workload", "rl", "--samples", "64", "-N", "16", "-B", "4096", "--shape", QWEN,
            "--layout", "tp1,pp8,ep16", "--zero-memory", "level1", "--json"]
    assert main(argv) == 0
    d = _json_out(capsys)
    mem = d["stats"]["memory"]
    assert d["stats"]["pipeline_stages"] == 8 and d["max_tokens_per_rank"] == 4096
    assert mem["limit_bytes"] is None and "within_limit" not in mem and mem["peak_bytes"] > mem["static_bytes"]
    assert d["whatif"]["limit_bytes"] is None


def test_simulate_with_a_memory_limit(capsys):
    argv = ["simulate", "--workload", "rl", "--samples", "64", "-N", "16", "--memory-gb", "64", "--shape", QWEN,
            "--layout", "tp1,pp8,ep16", "--zero-memory", "level1", "--policies", "hdp,static-cp", "--no-peers", "--json"]
    assert main(argv) == 0
    d = _json_out(capsys)
    b = model_for(QWEN, MemoryLayout.parse("tp1,pp8,ep16", domain=16, zero_memory="level1")).token_budget(64 * GB)
    assert d["pipeline_stages"] == 8 and d["token_budget"] == b and d["memory"]["limit_bytes"] == 64 * GB
    by = {c["policy"]: c for c in d["cases"]}
    assert {"hdp", "hdp-no-pp", "static-cp"} <= set(by)
    for name in ("hdp", "static-cp"):
        assert by[name]["max_tokens_per_rank"] == b and by[name]["within_limit"] is True
        assert by[name]["peak_bytes"] <= 64 * GB
    assert by["hdp-no-pp"]["max_tokens_per_rank"] == b


def test_one_model_name_is_a_cost_preset_and_a_shape(capsys):
    # qwen3-30b-a3b has a shape only: its cost preset is derived from it
    argv = ["plan", "--workload", "rl", "--samples", "32", "-N", "8", "--memory-gb", "80", "--shape", "qwen3-30b-a3b",
            "--layout", "tp1,pp2,ep8", "--zero-memory", "level1", "--json"]
    assert main(argv) == 0
    d = _json_out(capsys)
    assert d["stats"]["memory"]["model"] == "qwen3-30b-a3b" and d["stats"]["memory"]["within_limit"]
    assert cost_model("qwen3-30b-a3b").linear_coef > 0


# ------------------------------------------------------------------------------------------ calibrate

TRUTH = MemoryCoefficients(activation=1.3, expert=0.7, cp=2.0, logits=1.1, headroom_bytes=3e8)


def _memory_records(n: int = 60, seed: int = 0) -> list[dict]:
    """What an engine writes: peaks of a known model (TRUTH) on a PP2 layout at three zero-memory levels
    (the levels separate the activation and expert terms)."""
    rng = np.random.default_rng(seed)
    recs = []
    for i in range(n):
        lay = MemoryLayout.parse("tp1,pp2,ep16", domain=16, zero_memory=("none", "level0", "level1")[i % 3])
        base = model_for(QWEN, lay)
        true = MemoryModel(shape=base.shape, layout=lay, coef=TRUTH)
        stage, k = int(rng.integers(0, 2)), int(rng.integers(1, 5))
        t = float(rng.integers(100, 8000))
        w = t * float(rng.uniform(1.0, 2.0))
        static = base.static_bytes(stage)
        recs.append({"kind": "memory", "features": memory_features(base, t, k, stage, w), "static_bytes": static,
                     "peak_bytes": static + true.dynamic_bytes(t, k, stage=stage, window_tokens=w), "tokens": t,
                     "group_size": k, "stage": stage, "window_tokens": w, "step": i // 4, "round": i % 4, "rank": 0})
    return recs


def _timing_records(cost, n: int = 30, seed: int = 1) -> list[dict]:
    rng = np.random.default_rng(seed)
    recs = []
    for _ in range(n):
        k = int(rng.choice([1, 2, 4]))
        lengths = rng.integers(200, 8000, int(rng.integers(1, 4))).tolist()
        recs.append({"kind": "group", "lengths": lengths, "group_size": k, "seconds": group_seconds(cost, lengths, k)})
    return recs


def _write(path: Path, recs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def _assert_truth(coef: MemoryCoefficients, records: list[dict], cover: bool = False) -> None:
    """``coef`` is what `fit_memory` makes of the records (exactly, through the file), near the truth
    (the small CP term least well determined), and predicts the records' peaks."""
    assert coef == fit_memory(records, cover=cover)[0]
    for name in ("activation", "expert", "cp", "logits"):
        assert getattr(coef, name) == pytest.approx(getattr(TRUTH, name), rel=0.05), name
    assert coef.headroom_bytes == pytest.approx(TRUTH.headroom_bytes, rel=0.05)
    c = np.array([coef.activation, coef.expert, coef.cp, coef.logits])
    for r in records:
        pred = r["static_bytes"] + float(np.dot(c, r["features"])) + coef.headroom_bytes
        assert pred == pytest.approx(r["peak_bytes"], rel=1e-3)


def test_calibrate_fits_the_memory_model_into_the_cost_model_file_and_plan_reads_it(tmp_path, capsys):
    true_cost = cost_model("dense-8b", "h100-nvlink")
    mem_recs = _memory_records()
    records = _write(tmp_path / "r.jsonl", _timing_records(true_cost) + mem_recs)
    out = tmp_path / "cost.json"
    assert main(["calibrate", "--records", str(records), "--out", str(out), "--model", "dense-8b"]) == 0
    text = capsys.readouterr().out
    assert "calibrated cost model" in text and "calibrated memory model (60 records)" in text
    assert "with its memory section" in text
    # the cost fit ignores the memory records and still recovers the timing model
    doc = read_cost_file(out)
    assert doc["parameters"]["unit_time_s"] == pytest.approx(true_cost.unit_time_s, rel=1e-3)
    assert doc["fit"]["n_group_records"] == 30
    fit = doc["memory"]["fit"]
    assert fit["n_records"] == 60 and fit["max_rel_err"] < 1e-4 and fit["cover"] is False
    _assert_truth(load_memory_coefficients(out), mem_recs)
    # --json prints the same document
    assert main(["calibrate", "--records", str(records), "--model", "dense-8b", "--json"]) == 0
    assert _json_out(capsys)["memory"]["coefficients"] == pytest.approx(doc["memory"]["coefficients"])
    # plan reads the memory section of its --cost-model file (and says so); --shape names the shape
    argv = ISSUE + ["--zero-memory", "level1"]
    assert main(argv + ["--cost-model", str(out)]) == 0
    d = _json_out(capsys)
    w = d["whatif"]
    assert "the --cost-model file's memory section" in w["coefficients_source"]
    assert MemoryCoefficients(**w["coefficients"]) == load_memory_coefficients(out)
    fitted = MemoryModel(shape=model_for(QWEN, MemoryLayout()).shape, coef=load_memory_coefficients(out),
                         layout=MemoryLayout.parse("tp1,pp8,ep16", domain=16, zero_memory="level1"))
    assert d["stats"]["token_budget"] == fitted.token_budget(64 * GB)
    _check_plan_within_limit(d, 64)
    # or from --memory-coefficients FILE, whatever the cost model
    assert main(argv + ["--memory-coefficients", str(out)]) == 0
    assert "(--memory-coefficients)" in _json_out(capsys)["whatif"]["coefficients_source"]


def test_calibrate_memory_records_alone_keep_the_base_cost(tmp_path, capsys):
    mem_recs = _memory_records()
    records = _write(tmp_path / "m.jsonl", mem_recs)
    out = tmp_path / "mem.json"
    assert main(["calibrate", "--records", str(records), "--out", str(out), "--memory-cover"]) == 0
    assert "no group timing records" in capsys.readouterr().out
    doc = read_cost_file(out)
    base = cost_model("deepseek-v3", "h100-nvlink")
    assert doc["fitted"] == [] and doc["fit"] is None and doc["base"] == "deepseek-v3@h100-nvlink"
    assert doc["parameters"]["linear_coef"] == base.linear_coef
    assert doc["memory"]["fit"]["cover"] is True
    _assert_truth(load_memory_coefficients(out), mem_recs, cover=True)
    # a file without a memory section reads as None
    assert main(["calibrate", "--records", str(_write(tmp_path / "t.jsonl", _timing_records(base))),
                 "--out", str(tmp_path / "plain.json")]) == 0
    capsys.readouterr()
    assert load_memory_coefficients(tmp_path / "plain.json") is None


@pytest.mark.parametrize("change, match", [
    ({"features": [1.0, 2.0]}, r"\.features=\[1\.0, 2\.0\]: expected the bytes of the 4 terms"),
    ({"features": [1.0, -2.0, 0.0, 0.0]}, r"\.features=.*finite numbers >= 0"),
    ({"peak_bytes": 1.0}, r"\.peak_bytes=1\.0: must exceed static_bytes"),
    ({"static_bytes": "1e9"}, r"\.static_bytes='1e9': expected the rank's static bytes"),
    ({"group_size": 0}, r"\.group_size=0: expected the size of the rank's group"),
    ({"stage": 1.5}, r"\.stage=1\.5: expected the pipeline stage, an integer >= 0"),
    ({"window_tokens": None}, r"\.window_tokens=None: expected the local tokens of the rounds in flight"),
    ({"rank": -1}, r"\.rank=-1: expected the rank index"),
    ({"weight": 0}, r"\.weight=0: pass a number in"),
])
def test_bad_memory_records_name_the_file_line_and_field(tmp_path, change, match):
    rec = {**_memory_records(1)[0], **change}
    f = _write(tmp_path / "r.jsonl", [_memory_records(1)[0], rec])
    with pytest.raises(ValueError, match=r"r\.jsonl:2" + match):
        load_records(f)
    missing = {k: v for k, v in _memory_records(1)[0].items() if k != "tokens"}
    with pytest.raises(ValueError, match=r"r\.jsonl:1\.tokens=None: expected the rank's local tokens"):
        load_records(_write(tmp_path / "r.jsonl", [missing]))


def test_a_bad_memory_section_names_the_file_and_field(tmp_path):
    true_cost = cost_model("dense-8b", "h100-nvlink")
    records = _write(tmp_path / "r.jsonl", _timing_records(true_cost) + _memory_records(12))
    out = tmp_path / "cost.json"
    assert main(["calibrate", "--records", str(records), "--out", str(out), "--json"]) == 0
    doc = json.loads(out.read_text())
    for section, match in (
        ({**doc["memory"], "coefficients": {**doc["memory"]["coefficients"], "cp": -1}}, r"memory\.coefficients\.cp=-1"),
        ({**doc["memory"], "coefficients": {"cp": 1.0}}, r"memory\.coefficients: missing \['activation'"),
        ({**doc["memory"], "extra": 1}, r"memory: unknown keys \['extra'\]"),
        ([1, 2], r"memory must be an object"),
    ):
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({**doc, "memory": section}))
        with pytest.raises(ValueError, match=r"cost-model file '.*bad\.json': " + match):
            load_memory_coefficients(bad)
        with pytest.raises(ValueError, match=match):
            read_cost_file(bad)


# ------------------------------------------------------------------------------------------ bad input

_PLAN = ["plan", "--workload", "rl", "--samples", "32", "-N", "16"]
BAD = [
    (_PLAN + ["--memory-gb", "16", "--shape", QWEN, "--layout", "tp1,pp8,ep16"],
     ("--memory-gb=16", "is below the static memory of qwen3-235b-a22b", "raise the limit")),
    (ISSUE, ("--memory-gb=64", "fits no group of the domain")),
    (_PLAN + ["--memory-gb", "64", "--shape", QWEN, "--layout", "tp1,cp4"], "--layout='tp1,cp4' (domain -N 16): layout 'tp1,cp4': 'cp4'"),
    (_PLAN + ["--memory-gb", "64", "--shape", QWEN, "--layout", "tp3,pp8,ep16"], "does not fit --shape='qwen3-235b-a22b'"),
    (_PLAN + ["--memory-gb", "64", "--shape", QWEN, "--layout", "tp1,pp8,ep3"], "ep x etp = 3 ranks do not divide the 16 ranks"),
    (_PLAN + ["--memory-gb", "64", "--shape", QWEN, "--layout", "tp1,pp8,ep16,dp8"], "dp8 but the domain is 16"),
    (_PLAN + ["--memory-gb", "64", "--shape", QWEN, "--layout", "tp1,pp8,ep16", "--pp", "4"], "--pp=4 but --layout"),
    (_PLAN + ["-B", "4096", "--zero-memory", "level1"], "neither --memory-gb G"),
    (_PLAN + ["--memory-gb", "64", "--shape", "deepseek-v3"], "--shape='deepseek-v3' is not a model shape"),
    (_PLAN + ["--memory-gb", "64"], "need --shape NAME"),
    (_PLAN + ["--memory-gb", "nan", "--shape", QWEN], "--memory-gb=nan"),
    (_PLAN + ["--memory-gb", "-1", "--shape", QWEN], "--memory-gb=-1.0"),
    (_PLAN, "pass --max-tokens-per-rank/-B"),
    (_PLAN + ["--layout", "tp1,pp8,ep16", "--shape", QWEN], "pass --max-tokens-per-rank/-B"),
    (_PLAN + ["--memory-gb", "64", "--shape", QWEN, "--layout", "tp1,pp8,ep16", "--memory-coefficients", "{plain}"],
     "has no memory section"),
    (_PLAN + ["--memory-gb", "64", "--shape", QWEN, "--layout", "tp1,pp8,ep16", "--memory-coefficients", "{missing}"],
     "--memory-coefficients: cost-model file"),
    (["simulate", "--workload", "rl", "--samples", "32", "-N", "16", "--memory-gb", "64", "--shape", QWEN,
      "--layout", "tp1,pp8,ep16", "--zero-memory", "level1", "--moe-shape", "deepseek-v3", "--no-peers"],
     "--moe-shape='deepseek-v3' prices --zero-memory for a given -B"),
    (["simulate", "--suite", "--memory-gb", "64"], "--suite plans every case with its own model"),
]


@pytest.mark.parametrize("argv, needle", BAD, ids=[f"#{i}" for i in range(len(BAD))])
def test_bad_memory_input_is_one_clear_line(argv, needle, tmp_path, capsys):
    plain = tmp_path / "plain.json"
    from hdp.packing.cost_file import save_cost_model

    save_cost_model(cost_model("dense-8b"), plain)
    files = {"plain": str(plain), "missing": str(tmp_path / "missing.json")}
    assert main([a.format(**files) for a in argv]) == 2
    line = _error_line(capsys)
    for n in (needle,) if isinstance(needle, str) else needle:
        assert n in line, n


def test_logprobs_fused_prices_the_fused_path_and_raises_the_budget_where_the_last_stage_binds(capsys):
    """``--logprobs fused`` (the library engine's default, verl's use_fused_kernels=True) prices the last stage's
    logits term as the fused log-prob path's bytes; the default stays the logits path (the most memory).  On the
    recipe layout stage 0's eight rounds in flight bind the budget, so it is the same; on one stage the budget
    rises."""
    level1 = ISSUE + ["--zero-memory", "level1"]
    got = {}
    for path in (None, "logits", "fused"):
        assert main(level1 + ([] if path is None else ["--logprobs", path])) == 0
        d = _json_out(capsys)
        _check_plan_within_limit(d, 64)
        got[path] = d
    assert got[None]["stats"]["memory"]["layout"]["fused_logprobs"] is False
    assert got["fused"]["stats"]["memory"]["layout"]["fused_logprobs"] is True
    assert "log-probs fused" in got["fused"]["whatif"]["layout"]
    assert got[None]["stats"]["token_budget"] == got["logits"]["stats"]["token_budget"] \
        == got["fused"]["stats"]["token_budget"]
    one_stage = ["plan", "--workload", "rl", "--samples", "64", "-N", "8", "--memory-gb", "80", "--shape",
                 "qwen3-30b-a3b", "--layout", "tp1,pp1,ep8", "--zero-memory", "level1", "--recompute", "full", "--json"]
    budgets = {}
    for path in ("logits", "fused"):
        assert main(one_stage + ["--logprobs", path]) == 0
        d = _json_out(capsys)
        _check_plan_within_limit(d, 80, pp=1)
        budgets[path] = d["stats"]["token_budget"]
        lay = MemoryLayout.parse("tp1,pp1,ep8", domain=8, zero_memory="level1", recompute="full",
                                 fused_logprobs=path == "fused")
        assert budgets[path] == model_for("qwen3-30b-a3b", lay).token_budget(80 * GB)
    assert budgets["fused"] > 2 * budgets["logits"], budgets
