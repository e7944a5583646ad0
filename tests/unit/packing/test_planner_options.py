"""The planner's options are declared once (`PlannerOptions`) and shared by every config that plans; the
engine options both doors share are declared once (`hdp.core.options.HdpOptions`), and verl's shipped
YAML holds exactly that declaration's defaults."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from hdp.packing import CostModel, PlannerConfig
from hdp.packing.config import PlannerOptions
from hdp.core import options
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
    verl = vo.planner_config(8, door_budget=4096)  # hdp's own budget wins over verl's per-GPU one
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


def test_cp_algorithm_allgather_needs_pow2_groups_on_both_doors():
    for cls, prefix in ((PlanningConfig, r"PlanningConfig"), (verl_config.HdpOptions, r"actor_rollout_ref\.actor\.hdp")):
        with pytest.raises(ValueError, match=rf"^{prefix}\.cp_algorithm=allgather with {prefix}\.group_shape=any"):
            cls(cp_algorithm="allgather")
        assert cls(cp_algorithm="allgather", group_shape="pow2").cp_algorithm.value == "allgather"


SHARED = [f.name for f in dataclasses.fields(options.HdpOptions)]


@pytest.mark.parametrize("cls", [PlanningConfig, verl_config.HdpOptions])
def test_both_doors_extend_the_one_engine_options_declaration(cls):
    assert issubclass(cls, options.HdpOptions)
    shared = {f.name: f for f in dataclasses.fields(options.HdpOptions)}
    mine = {f.name: f for f in dataclasses.fields(cls)}
    assert set(shared) <= set(mine)
    overrides = options.VERL_DEFAULTS if cls is verl_config.HdpOptions else {}
    for name, f in shared.items():  # the declaration's default, or the documented door default
        want = overrides.get(name, f.default)
        assert mine[name].default == want, (cls.__name__, name)
        assert mine[name].default_factory == f.default_factory, (cls.__name__, name)
    own = set(mine) - set(shared)  # what is the door's own
    assert own == ({"memory_coefficients"} if cls is PlanningConfig else {"_target_", "skip_old_log_prob"}), own
    # the documented overrides really differ (a default that agrees needs no entry)
    for name, value in options.VERL_DEFAULTS.items():
        assert value != shared[name].default, name


def test_the_shipped_verl_yaml_holds_the_declarations_defaults():
    from hdp.integrations.verl import config_dir
    from hdp.integrations.verl.config import HDP_STRATEGY

    actor = yaml.safe_load((Path(config_dir()) / "actor" / "hdp_actor.yaml").read_text())
    hdp = dict(actor["hdp"])
    assert hdp.pop("_target_") == "hdp.integrations.verl.config.HdpOptions"
    names = {f.name for f in dataclasses.fields(verl_config.HdpOptions)} - {"_target_"}
    assert set(hdp) == names, set(hdp) ^ names  # every option shipped, nothing else
    assert verl_config.HdpOptions(**hdp) == verl_config.HdpOptions()  # and each with the declared default
    assert actor["strategy"] == actor["megatron"]["strategy"] == HDP_STRATEGY
    ref = yaml.safe_load((Path(config_dir()) / "ref" / "hdp_ref.yaml").read_text())
    assert ref["hdp"] == "${actor_rollout_ref.actor.hdp}"  # the ref follows the actor's options
    critic = yaml.safe_load((Path(config_dir()) / "critic" / "hdp_critic.yaml").read_text())
    assert critic["hdp"] == "${actor_rollout_ref.actor.hdp}"  # and so does the critic
    for path in Path(config_dir()).rglob("*.yaml"):  # no other file ships hdp options to drift
        if path.name not in ("hdp_actor.yaml", "hdp_ref.yaml", "hdp_critic.yaml"):
            assert "hdp" not in (yaml.safe_load(path.read_text()) or {}), path


def test_the_verl_options_table_lists_every_option():
    """docs/verl.md's options table has one row per verl option, and no other (a new option is documented)."""
    import re

    doc = (Path(__file__).resolve().parents[3] / "docs" / "verl.md").read_text()
    table = doc.split("| option | default | meaning |", 1)[1].split("\n\n", 1)[0]
    rows = re.findall(r"^\| `([a-z_]+)` \|", table, re.M)
    names = {f.name for f in dataclasses.fields(verl_config.HdpOptions)} - {"_target_"}
    assert len(rows) == len(set(rows)) and set(rows) == names, set(rows) ^ names


@pytest.mark.parametrize("cls, prefix", [(PlanningConfig, "PlanningConfig"),
                                         (verl_config.HdpOptions, "actor_rollout_ref.actor.hdp")])
def test_max_consecutive_skips_is_a_count_or_none_on_both_doors(cls, prefix):
    assert cls().max_consecutive_skips == 3  # the same default on both doors
    assert cls(max_consecutive_skips=None).max_consecutive_skips is None
    assert cls(max_consecutive_skips=1).max_consecutive_skips == 1
    for bad in (0, -2, True, 1.5, "3"):
        with pytest.raises(ValueError, match=rf"^{prefix.replace('.', chr(92) + '.')}\.max_consecutive_skips={bad!r}: "
                                             r"pass a number of skipped updates in a row >= 1"):
            cls(max_consecutive_skips=bad)
