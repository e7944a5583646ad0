"""Cost-model files: save -> load round trip, and every bad file rejected with the field named."""

from __future__ import annotations

import dataclasses
import json

import pytest

from hdp.packing import CostModel, cost_model
from hdp.packing.cost_file import FORMAT, VERSION, read_cost_file, resolve_cost


def test_save_load_round_trip_is_exact(tmp_path):
    cost = cost_model("qwen3-235b-a22b", "ascend-910b-hccs")
    path = tmp_path / "cost.json"
    cost.save(path, metadata={"base": "qwen3-235b-a22b@ascend-910b-hccs", "fitted": ["unit_time_s"]})
    assert CostModel.load(path) == cost
    doc = read_cost_file(path)
    assert doc["format"] == FORMAT and doc["version"] == VERSION
    assert doc["base"] == "qwen3-235b-a22b@ascend-910b-hccs" and doc["fitted"] == ["unit_time_s"]
    assert set(doc["parameters"]) == {f.name for f in dataclasses.fields(CostModel)}
    assert not (tmp_path / "cost.json.tmp").exists()


def _write(tmp_path, doc):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d: d.update(version=VERSION + 1), "version"),
        (lambda d: d.update(format="something-else"), "format"),
        (lambda d: d["parameters"].pop("linear_coef"), r"\['linear_coef'\] are missing"),
        (lambda d: d["parameters"].update(bogus=1.0), r"unknown parameters \['bogus'\]"),
        (lambda d: d["parameters"].update(unit_time_s=-1.0), "unit_time_s"),
        (lambda d: d["parameters"].update(round_cost="x"), "parameters.round_cost"),
    ],
)
def test_bad_cost_files_name_the_problem(tmp_path, mutate, match):
    path = tmp_path / "good.json"
    CostModel().save(path)
    doc = json.loads(path.read_text())
    mutate(doc)
    with pytest.raises(ValueError, match=match):
        CostModel.load(_write(tmp_path, doc))


def test_unreadable_and_non_json_files(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        CostModel.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        CostModel.load(bad)
    binary = tmp_path / "bin.json"
    binary.write_bytes(b"\xff\xfe\x00\x81")
    with pytest.raises(ValueError, match="not a text file"):
        CostModel.load(binary)


def test_resolve_cost_names_the_field(tmp_path):
    cost = CostModel(linear_coef=5.0)
    assert resolve_cost(cost, "x.cost") is cost
    with pytest.raises(ValueError, match=r"^x\.cost: cost-model file"):
        resolve_cost(tmp_path / "none.json", "x.cost")
    with pytest.raises(ValueError, match=r"x\.cost=3"):
        resolve_cost(3, "x.cost")
