"""The planner's options are declared once (`PlannerOptions`) and shared by every config that plans."""

from __future__ import annotations

import dataclasses

import pytest

from hdp.packing import CostModel, PlannerConfig
from hdp.packing.config import PlannerOptions
from hdp.trainer.config import PlanningConfig

pytest.importorskip("verl")  # verl first: it loads hdp's plugin, which registers the engine
verl_config = pytest.importorskip("hdp.integrations.verl.config")

OPTION_NAMES = [f.name for f in dataclasses.fields(PlannerOptions)]


@pytest.mark.parametrize("cls", [PlannerConfig, PlanningConfig, verl_config.HdpOptions])
def test_every_planner_config_inherits_the_one_declaration(cls):
    assert issubclass(cls, PlannerOptions)
    own = {f.name: f for f in dataclasses.fields(cls)}
    for name in OPTION_NAMES:  # same field objects' defaults: declared once, not copied
        assert own[name].default == {f.name: f for f in dataclasses.fields(PlannerOptions)}[name].default


@pytest.mark.parametrize(
    "cls, kwargs, prefix",
    [
        (PlannerConfig, dict(num_ranks=4, max_tokens_per_rank=8), "config"),
        (PlanningConfig, {}, "PlanningConfig"),
        (verl_config.HdpOptions, {}, "actor_rollout_ref.actor.hdp"),
    ],
)
@pytest.mark.parametrize(
    "bad, field",
    [({"policy": "nope"}, "policy"), ({"group_shape": "hex"}, "group_shape"),
     ({"max_extra_rounds": -1}, "max_extra_rounds"), ({"search_budget": {"search": -3}}, r"search_budget\.search"),
     ({"search_budget": "fast"}, "search_budget"),
     ({"static_cp_size": 0}, "static_cp_size")],
)
def test_errors_name_the_field_under_each_prefix(cls, kwargs, prefix, bad, field):
    with pytest.raises(ValueError, match=rf"^{prefix.replace('.', chr(92) + '.')}\.{field}"):
        cls(**kwargs, **bad)


def test_engine_and_verl_options_build_the_same_planner_config(tmp_path):
    cost = CostModel(linear_coef=1234.0, step_overhead=5.0)
    path = tmp_path / "cost.json"
    cost.save(path)
    opts = dict(policy="static-cp", group_shape="pow2", static_cp_size=2, max_extra_rounds=1,
                search_budget={"construct": 100, "search": 0})
    engine = PlanningConfig(max_tokens_per_rank=512, cost_model=str(path), **opts).planner_config(8)
    vo = verl_config.HdpOptions(max_tokens_per_rank=512, cost_model=str(path), **opts)
    verl = vo.planner_config(8, 512, vo.cost(None))
    direct = PlannerConfig(num_ranks=8, max_tokens_per_rank=512, cost=cost, **opts)
    assert engine == verl == direct


def test_bad_cost_model_and_impossible_cp_settings_fail_at_configuration(tmp_path):
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.actor\.hdp\.cost_model: cost-model file"):
        verl_config.HdpOptions(cost_model=str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.actor\.hdp\.cost_model='dense-8b@tpu': profile='tpu'"):
        verl_config.HdpOptions(cost_model="dense-8b@tpu")
    with pytest.raises(ValueError, match=r"hdp\.cp_algorithm=allgather with .*group_shape=any"):
        verl_config.HdpOptions(cp_algorithm="allgather")
    assert verl_config.HdpOptions(cp_algorithm="allgather", group_shape="pow2").cost_model == "auto"
    with pytest.raises(ValueError, match=r"PlanningConfig\.cost_model"):
        PlanningConfig(cost_model=str(tmp_path / "missing.json"))
