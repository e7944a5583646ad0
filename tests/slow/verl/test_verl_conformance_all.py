"""The whole conformance suite beyond the representative slice (test_verl_conformance.py, which says what a case
compares), and the main_ppo case: ``slow``, run only with ``HDP_CONFORMANCE=all`` in the environment
(``make test-conformance``; ``make test`` must stay within CI's time, docs/verl.md "The conformance suite");
without it they are reported as skipped, naming the variable.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("verl")
pytest.importorskip("mbridge")

import helpers.verl_conformance as V  # noqa: E402
from helpers.verl_conformance import dense, moe  # noqa: E402,F401  (the suite's fixtures: one spawn per model)

ALL = os.environ.get("HDP_CONFORMANCE", "") == "all"
"""Every case (the whole suite), not the representative slice only."""

pytestmark = [pytest.mark.skipif(not ALL, reason='the whole conformance suite runs with HDP_CONFORMANCE=all (docs/verl.md)')]


@pytest.mark.parametrize("case", V.case_ids(moe=False, dist_tier=False))
def test_hdp_matches_stock_megatron(case: str, dense: dict) -> None:
    V.assert_conforms(dense[case])


@pytest.mark.parametrize("case", V.case_ids(moe=True, dist_tier=False))
def test_router_replay_matches_stock_megatron(case: str, moe: dict) -> None:
    V.assert_conforms(moe[case])


def test_main_ppo_matches_stock_megatron(tmp_path):
    """``python -m verl.trainer.main_ppo`` — Ray, verl's v1 trainer, the rollout, the ref, GAE with a critic,
    the KL loss and an entropy bonus — two steps on hdp (2 ranks, CP groups in its plans)
    and on verl's stock Megatron engine (1 rank, one micro-batch), the same model, data and seed: every metric both
    log, each step (`verl_conformance.compare_main_ppo`)."""
    runs = {e: V.main_ppo_steps(str(tmp_path / e), e, timeout=V.SUITE_TIMEOUT_S) for e in ("hdp", "megatron")}
    (hdp, hdp_log), (stock, stock_log) = runs["hdp"], runs["megatron"]
    assert hdp and stock, f"main_ppo failed:\n{hdp_log if not hdp else stock_log}"
    V.assert_conforms(V.compare_main_ppo(hdp, stock))
