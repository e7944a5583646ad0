"""Public names that moved or were renamed keep a path: the old keyword of a config class raises a TypeError
naming the new name, where it lives and how to pass it (the old attribute an AttributeError saying where to
read it), from one table per class (`hdp.packing.moved`); each has a CHANGES.md entry.  The command line's
renamed flags: tests/distributed/trainer/test_cli_bad_input.py."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import re
from pathlib import Path

import pytest

from hdp.packing import PlannerConfig
from hdp.packing.moved import MovedFields, moved_fields
from hdp.trainer.config import EngineConfig, PlanningConfig
from hdp.trainer.model import ModelConfig, OptimConfig
from hdp.trainer.parallel import ParallelConfig

CHANGES = Path(__file__).resolve().parents[3] / "CHANGES.md"


def test_engine_config_keywords_that_moved_to_planning_config_name_it() -> None:
    """Before: ``EngineConfig(collective_timeout_s=60)`` was a bare "unexpected keyword argument"."""
    with pytest.raises(TypeError) as exc:
        EngineConfig(collective_timeout_s=60.0)
    assert str(exc.value) == (
        "EngineConfig(collective_timeout_s=...) is now PlanningConfig(collective_timeout_s=...) (moved on 2026-12-04, "
        "see CHANGES.md): pass EngineConfig(planning=PlanningConfig(collective_timeout_s=...))")
    with pytest.raises(TypeError, match=re.escape(
            "EngineConfig(moe_zero_memory=...) is now PlanningConfig(zero_memory=...) (renamed and moved on 2026-12-04, "
            "see CHANGES.md): pass EngineConfig(planning=PlanningConfig(zero_memory=...))")):
        EngineConfig(moe_zero_memory="level1")
    with pytest.raises(TypeError, match=r"moe_zero_memory_num_layers=\.\.\.\) is now PlanningConfig\(zero_memory_num_"
                                        r".*; EngineConfig\(calibration_path=\.\.\.\) is now PlanningConfig\("):
        EngineConfig(moe_zero_memory_num_layers=2, calibration_path="r.jsonl")  # every moved keyword named
    with pytest.raises(AttributeError, match=re.escape("EngineConfig.moe_zero_memory is now PlanningConfig.zero_memory "
                                                       "(renamed and moved on 2026-12-04, see CHANGES.md): read "
                                                       "EngineConfig.planning.zero_memory")):
        EngineConfig().moe_zero_memory  # noqa: B018
    # the new spelling works; an unknown keyword is still Python's own error
    assert EngineConfig(planning=PlanningConfig(collective_timeout_s=60.0)).planning.collective_timeout_s == 60.0
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        EngineConfig(bogus=1)
    with pytest.raises(AttributeError, match="has no attribute 'bogus'"):
        EngineConfig().bogus  # noqa: B018


def test_renamed_fields_of_the_planner_and_model_configs_name_the_new_one() -> None:
    cases = [
        (lambda: PlanningConfig(cost=None), "PlanningConfig(cost=...) is now PlanningConfig(cost_model=...) (renamed "
                                            "on 2026-12-01, see CHANGES.md; it takes a CostModel"),
        (lambda: PlannerConfig(num_ranks=4, max_tokens_per_rank=64, search_max_samples=8),
         "PlannerConfig(search_max_samples=...) is now PlannerConfig(search_budget=...) (renamed on 2026-12-01"),
        (lambda: PlanningConfig(search_max_samples=8), "pass PlanningConfig(search_budget=...)"),
        (lambda: ModelConfig(expert_model_parallel_size=2),
         "ModelConfig(expert_model_parallel_size=...) is now ParallelConfig(ep=...) (renamed and moved on 2026-12-01, "
         "see CHANGES.md): pass EngineConfig(parallel=ParallelConfig(ep=...))"),
    ]
    for make, needle in cases:
        with pytest.raises(TypeError, match=re.escape(needle)):
            make()


def test_verls_options_name_the_yaml_key_that_replaced_them() -> None:
    pytest.importorskip("verl")
    from hdp.integrations.verl.config import HdpEngineConfig, HdpOptions

    with pytest.raises(TypeError, match=re.escape(
            "actor_rollout_ref.actor.hdp.hardware_profile is now actor_rollout_ref.actor.hdp.cost_model (renamed on "
            "2026-12-02, see CHANGES.md; it takes a preset MODEL@PROFILE")):
        HdpOptions(hardware_profile="h100-nvlink")
    with pytest.raises(TypeError, match=re.escape("actor_rollout_ref.actor.hdp.cost_model_file is now "
                                                  "actor_rollout_ref.actor.hdp.cost_model")):
        HdpEngineConfig(hdp={"cost_model_file": "cost.json"})  # the dict OmegaConf's merge paths hand over
    with pytest.raises(TypeError, match=re.escape("set actor_rollout_ref.actor.hdp.search_budget")):
        HdpOptions(search_max_samples=8)


def _moved_classes() -> list[type]:
    pytest.importorskip("verl")
    import hdp.integrations.verl.config  # noqa: F401 - its HdpOptions has a table of its own

    out, todo = [], [MovedFields]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo.extend(cls.__subclasses__())
    return [c for c in out if dataclasses.is_dataclass(c)]


def test_every_moved_name_points_at_a_field_that_exists_and_has_a_changes_entry() -> None:
    classes = {c.__name__: c for c in _moved_classes()}
    for name in ("EngineConfig", "PlanningConfig", "PlannerConfig", "ModelConfig", "OptimConfig", "ParallelConfig"):
        assert name in classes, name  # every public config class consults the tables
    changes = CHANGES.read_text()
    seen = 0
    for cls in classes.values():
        now = {f.name for f in dataclasses.fields(cls)}
        for old, moved in moved_fields(cls).items():
            seen += 1
            assert old not in now, (cls, old)  # a moved name is no field any more
            other, _, field = moved.new.rpartition(".")
            target = classes[other] if other else cls
            assert field in {f.name for f in dataclasses.fields(target)}, (cls, old, moved)
            for name in (old, field):  # both named in CHANGES.md, in code spans
                assert re.search(rf"`[^`\n]*\b{name}\b[^`\n]*`", changes), (cls, old, name)
    assert seen >= 8, seen


def test_configs_still_pickle_copy_and_replace() -> None:
    for cfg in (EngineConfig(), PlanningConfig(), ModelConfig(), OptimConfig(), ParallelConfig(tp=2),
                PlannerConfig(num_ranks=4, max_tokens_per_rank=64)):
        assert pickle.loads(pickle.dumps(cfg)) == cfg
        assert copy.deepcopy(cfg) == cfg and copy.copy(cfg) == cfg
    assert dataclasses.replace(EngineConfig(), seed=7).seed == 7
    with pytest.raises(TypeError, match="is now PlanningConfig"):
        dataclasses.replace(EngineConfig(), collective_timeout_s=5.0)
