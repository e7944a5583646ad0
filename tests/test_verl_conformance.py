"""hdp against verl's stock Megatron engine, option by option, through verl's worker path (2 CPU ranks).

Each case of `verl_conformance.cases()` runs the same verl job — config, seed, batch — on hdp (``model_engine=hdp``,
a domain of 2 with a CP group in its plan) and on verl's stock ``MegatronEngineWithLMHead`` /
``MegatronEngineWithValueHead`` (``model_engine=megatron``, DP 2, run on CPU by
``hdp.integrations.verl.scaffolding.stock_megatron``) and compares loss, grad norm, every parameter's change,
log-probs, entropies, values and every metric both report, to the tolerances stated in tests/verl_conformance.py.
The option table that says which verl option each case covers is tests/verl_options.py (checked by
tests/test_verl_conformance_table.py).

Tiers: one spawn per model (dense, MoE) runs every selected case of this module, its built workers shared by
all.  By default (``make test``) the cases marked ``dist_tier`` run: the representative slice.  The rest, and
the main_ppo case (the whole trainer on both engines, two processes of Ray each), are ``slow`` and run only with
``HDP_CONFORMANCE=all`` in the environment (``make test`` must stay within CI's time; docs/verl.md, "The
conformance suite"); without it they are reported as skipped, naming the variable.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("verl")
pytest.importorskip("mbridge")

import verl_conformance as V  # noqa: E402
from dist_helper import run_distributed  # noqa: E402

pytestmark = [pytest.mark.dist]

ALL = os.environ.get("HDP_CONFORMANCE", "") == "all"
"""Every case (the whole suite), not the representative slice only."""
_OPT_IN = pytest.mark.skip(reason="the whole conformance suite runs with HDP_CONFORMANCE=all (docs/verl.md)")
TIMEOUT_S = 1500.0
"""One spawn's limit: every case of a model (about 75 s for the 61 dense cases on an idle 2-core machine)."""
MOE_KINDS = ("r2", "r3")


def _params(moe: bool) -> list:
    rest = (pytest.mark.slow,) if ALL else (pytest.mark.slow, _OPT_IN)
    return [pytest.param(c.id, id=c.id, marks=() if c.dist_tier else rest)
            for c in V.cases().values() if (c.kind in MOE_KINDS) == moe]


def _selected(request: pytest.FixtureRequest, test_name: str) -> list[str]:
    """The case ids of this module's ``test_name`` items selected in this session (tier markers applied)."""
    out = []
    for item in request.session.items:
        if item.module is request.module and item.originalname == test_name and not item.get_closest_marker("skip"):
            out.append(item.callspec.params["case"])
    return out


def _run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, test_name: str, moe: bool) -> dict:
    ids = _selected(request, test_name)
    if not ids:
        return {}
    root = str(tmp_path_factory.mktemp("moe" if moe else "dense"))
    return run_distributed(V.suite_worker, 2, root, ids, moe, timeout=TIMEOUT_S)[0]


@pytest.fixture(scope="module")
def dense(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every selected dense case's checks, from one spawn."""
    return _run(request, tmp_path_factory, "test_hdp_matches_stock_megatron", moe=False)


@pytest.fixture(scope="module")
def moe(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every selected router-replay case's checks (tiny Qwen3-MoE), from one spawn."""
    return _run(request, tmp_path_factory, "test_router_replay_matches_stock_megatron", moe=True)


def _assert(result) -> None:
    assert not isinstance(result, str), f"the case raised on the ranks:\n{result}"
    assert result, "the case made no checks"
    bad = [c for c in result if not c.ok]
    assert not bad, "hdp differs from stock verl:\n" + "\n".join(str(c) for c in bad)


@pytest.mark.parametrize("case", _params(moe=False))
def test_hdp_matches_stock_megatron(case: str, dense: dict) -> None:
    _assert(dense[case])


@pytest.mark.parametrize("case", _params(moe=True))
def test_router_replay_matches_stock_megatron(case: str, moe: dict) -> None:
    _assert(moe[case])


@pytest.mark.slow
@pytest.mark.skipif(not ALL, reason="the whole conformance suite runs with HDP_CONFORMANCE=all (docs/verl.md)")
def test_main_ppo_matches_stock_megatron(tmp_path):
    """``python -m verl.trainer.main_ppo`` — Ray, verl's v1 trainer, the rollout, the ref, GAE with a critic,
    the KL loss and an entropy bonus — two steps on hdp (2 ranks, CP groups in its plans)
    and on verl's stock Megatron engine (1 rank, one micro-batch), the same model, data and seed: every metric both
    log, each step (`verl_conformance.compare_main_ppo`)."""
    runs = {e: V.main_ppo_steps(str(tmp_path / e), e, timeout=TIMEOUT_S) for e in ("hdp", "megatron")}
    (hdp, hdp_log), (stock, stock_log) = runs["hdp"], runs["megatron"]
    assert hdp and stock, f"main_ppo failed:\n{hdp_log if not hdp else stock_log}"
    _assert(V.compare_main_ppo(hdp, stock))
