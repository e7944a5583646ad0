"""The slow tier (over ~20 s) of the tests tests/unit/trainer/test_bench_device.py describes: its docstring says what they check and how."""

from __future__ import annotations

import json

from hdp.trainer.bench import device as bd


def test_dry_run_through_the_cli_lists_every_row(tmp_path):
    from helpers.cli_helper import hdp_json

    out = tmp_path / "out"
    result = hdp_json("bench", "device", "--dry-run", "--json", "--out", str(out))
    rows = {r["row"]: r for r in result["rows"]}
    assert list(rows) == list(bd.ROWS)
    assert result["dry_run"] is True and result["hardware"] is False and "not hardware" in result["note"]
    for name, row in rows.items():
        assert row["status"] in ("ok", "fail", "skipped"), (name, row.get("reason"), row.get("traceback"))
        assert row["hardware"] is False
    for name in ("kernel_exactness", "kernel_speed", "logprobs", "engine_pp1", "train_job"):
        assert rows[name]["status"] == "ok", (name, rows[name].get("reason"))
    job = rows["train_job"]["figures"]  # hdp bench train's device path, on 2 CPU ranks
    assert job["loss_match"] and job["environment"]["device"] == "cpu" and job["model"]["train_flops_per_step"] > 0
    assert rows["engine_vpp"]["status"] == "skipped" and "pp > 1" in rows["engine_vpp"]["reason"]
    # the adapter under test on CPU is torch's fused-flash adapter through its stand-in; flash-attn says why not
    kernels = rows["kernel_exactness"]["figures"]["kernels"]
    assert kernels["flash_attn"]["status"].startswith("skipped: ")
    assert all(kernels["torch_flash"][dt]["ok"] for dt in bd.TOLERANCES)
    assert kernels["torch_flash"]["bfloat16"]["errors"]["ring_out"] > 0  # bf16 against fp64: two sides differ
    engine = rows["engine_pp1"]["figures"]
    assert engine["device_run"]["dtype"] == "bfloat16" and engine["cpu_fp32_run"]["dtype"] == "float32"
    assert max(engine["loss_rel_diff"]) > 0 and engine["device_run"]["steps"][0]["memory_predicted_gb"] > 0
    lp = rows["logprobs"]["figures"]
    assert 0 < lp["max_abs_logprob_diff"] <= 1e-3
    cost = rows["cost_terms"]
    if cost["status"] == "ok":  # a busy 2-core machine's times may fit no model: then the fit says why
        from hdp.packing import PlannerConfig, plan
        from hdp.packing.cost_file import load_cost_model

        model = load_cost_model(cost["figures"]["cost_model_file"])
        assert set(cost["figures"]["from_base"]) >= {"step_latency", "comm_per_token"}
        p = plan([3000, 900, 200, 40, 40], PlannerConfig(num_ranks=4, max_tokens_per_rank=1024, cost=model))
        assert p.num_rounds >= 1
    else:
        assert cost["status"] == "fail" and cost["reason"].startswith(("calibrate", "records")), cost["reason"]
    assert (out / "device.json").is_file() and (out / "device_records.jsonl").is_file()
    assert json.loads((out / "device.json").read_text())["rows"][-1]["row"] == "engine_vpp"
    # the human table: one line per row
    table = bd.format_table(result)
    assert all(name in table for name in bd.ROWS)
