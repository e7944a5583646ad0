"""``hdp bench device``: the dry run through the CLI, the ring-call metadata it checks kernels on, and that
its exactness check fails a kernel with a wrong convention.  No GPU here: the hardware rows are skipped."""

from __future__ import annotations

import math

import pytest
import torch

from hdp.kernels import AttentionKernel, KernelName, reference
from hdp.trainer.bench import device as bd


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
