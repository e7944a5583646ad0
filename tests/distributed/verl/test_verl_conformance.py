"""hdp against verl's stock Megatron engine, option by option, through verl's worker path (2 CPU ranks): the
representative slice (the cases marked ``dist_tier``), run by ``make test``.

Each case of `verl_conformance.cases()` runs the same verl job — config, seed, batch — on hdp (``model_engine=hdp``,
a domain of 2 with a CP group in its plan) and on verl's stock ``MegatronEngineWithLMHead`` /
``MegatronEngineWithValueHead`` (``model_engine=megatron``, DP 2, run on CPU by
``hdp.integrations.verl.scaffolding.stock_megatron``) and compares loss, grad norm, every parameter's change,
log-probs, entropies, values and every metric both report, to the tolerances stated in
tests/helpers/verl_conformance.py.
The option table that says which verl option each case covers is tests/helpers/verl_options.py (checked by
tests/unit/verl/test_verl_conformance_table.py).  One spawn per model (dense, MoE) runs every selected case of this
module,
its built workers shared by all.  The rest of the suite and the main_ppo case: test_verl_conformance_all.py.
"""

from __future__ import annotations

import pytest

pytest.importorskip("verl")
pytest.importorskip("mbridge")

import helpers.verl_conformance as V  # noqa: E402
from helpers.verl_conformance import dense, moe  # noqa: E402,F401  (the suite's fixtures: one spawn per model)


@pytest.mark.parametrize("case", V.case_ids(moe=False, dist_tier=True))
def test_hdp_matches_stock_megatron(case: str, dense: dict) -> None:
    V.assert_conforms(dense[case])


@pytest.mark.parametrize("case", V.case_ids(moe=True, dist_tier=True))
def test_router_replay_matches_stock_megatron(case: str, moe: dict) -> None:
    V.assert_conforms(moe[case])
