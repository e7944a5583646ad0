"""``hdp bench device``: the dry run through the CLI, the ring-call metadata it checks kernels on, and that
its exactness check fails a kernel with a wrong convention.  No GPU here: the hardware rows are skipped."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hdp.kernels import AttentionKernel, KernelName, reference
from hdp.trainer.bench import device as bd


def _hdp() -> list[str]:
    exe = Path(sys.executable).with_name("hdp")
    return [str(exe)] if exe.exists() else [sys.executable, "-c", "import sys; from hdp.trainer.cli import main; "
                                                                   "sys.exit(main())"]


@pytest.mark.slow
def test_dry_run_through_the_cli_lists_every_row(tmp_path):
    from cli_helper import hdp_json

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


def test_without_an_accelerator_every_row_is_skipped_with_the_reason(tmp_path):
    result = bd.bench_device(dry_run=False, device="cpu", out_dir=tmp_path)
    assert [r["row"] for r in result["rows"]] == list(bd.ROWS)
    for row in result["rows"]:
        assert row["status"] == "skipped" and "no accelerator" in row["reason"]
    assert result["hardware"] is False and result["note"] == "not run on hardware"


def test_bad_rows_and_budget_raise():
    with pytest.raises(ValueError, match="unknown"):
        bd.bench_device(dry_run=True, rows=["kernel_exactness", "nope"])
    with pytest.raises(ValueError, match="budget_s"):
        bd.bench_device(dry_run=True, budget_s=0)


def test_cli_bad_flags_name_the_fix(tmp_path):
    proc = subprocess.run(_hdp() + ["bench", "device", "--dry-run", "--rows", "kernel_speed,bogus"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--rows" in proc.stderr and "kernel_exactness" in proc.stderr
    f = tmp_path / "a_file"
    f.write_text("x")
    proc = subprocess.run(_hdp() + ["bench", "device", "--dry-run", "--out", str(f)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--out" in proc.stderr


@pytest.mark.parametrize("lengths,k", [((37, 64, 23), 3), ((9, 20), 2), ((5, 0, 12), 4), ((40,), 1)])
def test_ring_calls_cover_the_causal_mask_once(lengths, k):
    """Every (query, key) pair of the pack's causal mask is computed by exactly one ring call."""
    t = sum(lengths)
    seen = torch.zeros((t, t), dtype=torch.int64)
    for c in bd.ring_calls(lengths, k):
        cq, ck = c.cu_q.tolist(), c.cu_k.tolist()
        for s in range(len(cq) - 1):
            qs, ks = c.q_rows[cq[s]:cq[s + 1]], c.k_rows[ck[s]:ck[s + 1]]
            m, n = len(qs), len(ks)
            vis = torch.ones((m, n), dtype=torch.bool)
            if c.causal:
                vis = torch.arange(n)[None, :] <= torch.arange(m)[:, None] + (n - m)
            seen[qs[:, None], ks[None, :]] += vis.long()
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    want = torch.zeros((t, t), dtype=torch.int64)
    for a, b in zip(starts, starts[1:]):
        want[a:b, a:b] = torch.tril(torch.ones((b - a, b - a), dtype=torch.int64))
    assert torch.equal(seen, want)


def _ctx(tmp_path):
    import time

    return bd._Ctx(device=torch.device("cpu"), dry=True, shapes=bd.DRY, out_dir=tmp_path,
                   deadline=time.monotonic() + 60)


def test_exactness_passes_the_reference_and_fails_a_wrong_lse(tmp_path):
    """The check that the GPU run relies on: a kernel whose lse is in base 2 (exp2 units) fails the ring
    merge; the reference itself passes."""
    ctx = _ctx(tmp_path)
    good = AttentionKernel(KernelName.REFERENCE, reference.attn_fwd, reference.attn_bwd)
    res = bd._exactness_one(good, torch.bfloat16, ctx)
    assert res["ok"], res
    assert res["calls"] == bd.DRY.ring ** 2

    def base2_fwd(*args, **kw):
        out, lse = reference.attn_fwd(*args, **kw)
        return out, lse / math.log(2.0)

    bad = AttentionKernel(KernelName.REFERENCE, base2_fwd, reference.attn_bwd)
    res = bd._exactness_one(bad, torch.bfloat16, ctx)
    assert not res["ok"] and "call_lse" in res["failed"] and "ring_out" in res["failed"]


def test_exactness_fails_a_kernel_that_ignores_the_merged_lse(tmp_path):
    """A backward that recomputes its own block's lse instead of using the merged one is wrong for the ring."""
    ctx = _ctx(tmp_path)

    def own_lse_bwd(dout, q, k, v, out, lse, cq, ck, causal, scale):
        own_out, own = reference.attn_fwd(q, k, v, cq, ck, causal, scale)
        return reference.attn_bwd(dout, q, k, v, own_out, own, cq, ck, causal, scale)

    bad = AttentionKernel(KernelName.REFERENCE, reference.attn_fwd, own_lse_bwd)
    res = bd._exactness_one(bad, torch.float16, ctx)
    assert not res["ok"] and {"ring_dq", "ring_dk"} & set(res["failed"])
