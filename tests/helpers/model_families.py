"""Definitions more than one test module needs (a test module never imports another), moved out of
test_model_families.py; used by tests/distributed/trainer/test_model_families.py,
tests/slow/trainer/test_model_families_slow.py."""

from __future__ import annotations

VERL = ["llama3.1", "qwen3-yarn", "qwen2-window", "qwen3-off-by-one", "qwen3-scale", "deepseek-v3"]


def _check(results: list[dict], name: str) -> None:
    from hdp.integrations.verl.scaffolding.families import LOGP_TOL, LOSS_RTOL, NORM_RTOL

    r = results[0]
    assert all(x == r for x in results), results
    assert r["cp_groups"] >= 1, f"{name}: the plan must put a sample on a CP group"
    assert r["logp_err"] <= LOGP_TOL, f"{name}: max |log-prob - HF| = {r['logp_err']:.3g} > {LOGP_TOL}"
    assert r["loss_rel"] <= LOSS_RTOL, f"{name}: loss differs from HF by {r['loss_rel']:.3g} (relative)"
    assert r["norm_rel"] <= NORM_RTOL, f"{name}: grad norm differs from HF by {r['norm_rel']:.3g} (relative)"
