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


def test_version_1_files_read_with_the_per_token_terms_at_zero(tmp_path):
    """Version 1 (before merge_per_token / cp_per_token) described exactly the model with both at 0."""
    cost = CostModel(linear_coef=123.0, step_overhead=4.0)
    path = tmp_path / "v1.json"
    cost.save(path)
    doc = json.loads(path.read_text())
    doc["version"] = 1
    for name in ("merge_per_token", "cp_per_token"):
        doc["parameters"].pop(name)
    path.write_text(json.dumps(doc))
    assert CostModel.load(path) == cost
    assert read_cost_file(path)["version"] == VERSION


def test_metadata_keys_are_documented_and_nan_becomes_null(tmp_path):
    path = tmp_path / "c.json"
    with pytest.raises(ValueError, match=r"metadata keys \['note'\] are not part of the file"):
        CostModel().save(path, metadata={"note": "x"})
    with pytest.raises(ValueError, match="may not set"):
        CostModel().save(path, metadata={"version": 3})
    CostModel().save(path, metadata={"fit": {"r2": float("nan"), "n_records": 1}, "fitted": ["unit_time_s"]})
    doc = json.loads(path.read_text())  # strict JSON: no NaN
    assert doc["fit"] == {"r2": None, "n_records": 1} and doc["from_base"] == [] and doc["base"] is None


def test_calibrate_result_round_trips_through_the_file(tmp_path):
    from hdp.packing.calibrate import calibrate, group_seconds

    true = cost_model("dense-8b", "h100-nvlink")
    recs = [{"lengths": [n, n // 3], "group_size": k, "seconds": group_seconds(true, [n, n // 3], k)}
            for k in (1, 2, 4, 8) for n in (512, 2048, 8192, 30000)]
    res = calibrate(recs, base=true)
    path = tmp_path / "fit.json"
    res.cost.save(path, metadata=res.metadata("dense-8b@h100-nvlink"))
    doc = read_cost_file(path)
    assert CostModel.load(path) == res.cost
    assert doc["fitted"] == list(res.fitted) and doc["from_base"] == list(res.from_base)
    assert doc["fit"]["n_group_records"] == 16 and set(doc["fit"]["reasons"]) == set(res.from_base)
