"""`hdp bench train`'s job description, checked before any rank starts: the model (presets, Hugging Face and
Megatron config.json), the lengths (files, recorded runs), the model FLOPs behind MFU, and the paired figures'
intervals.  The runs themselves: tests/unit/trainer/test_bench_train.py
tests/distributed/trainer/test_bench_train_dist.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hdp.trainer.bench.job import model_shape, peak_tflops, train_flops
from hdp.trainer.bench.lengths import read_batches
from hdp.trainer.bench.stats import median_ci95, paired
from hdp.trainer.bench.train import TrainBenchSpec, batch_lengths, job_config


def test_lengths_files_recorded_runs_and_their_errors(tmp_path: Path) -> None:
    text = tmp_path / "batches.txt"
    text.write_text("# two batches\n100 200, 300\n\n7\n")
    assert [b.lengths for b in read_batches(text)] == [(100, 200, 300), (7,)]
    js = tmp_path / "batches.json"
    js.write_text(json.dumps([[5, 6], [7]]))
    assert [b.lengths for b in read_batches(js)] == [(5, 6), (7,)]
    # a run's records: naming the records file reads the lengths beside it (hdp.core.planning.lengths_path)
    records = tmp_path / "engine.jsonl"
    records.write_text('{"kind": "round"}\n')
    rec = {"step": 3, "policy": "hdp", "num_ranks": 2, "max_tokens_per_rank": 256, "lengths": [40, 300, 12],
           "checksum": "abc"}
    with pytest.raises(ValueError, match="a calibration record .'round'., not a step's lengths"):
        read_batches(records)  # no lengths beside it yet: the records alone do not say each step's batch
    (tmp_path / "engine.lengths.jsonl").write_text(json.dumps(rec) + "\n")
    (got,) = read_batches(records)
    assert got.lengths == (40, 300, 12) and got.checksum == "abc" and got.max_tokens_per_rank == 256
    spec = TrainBenchSpec(ranks=2, lengths=str(records), policies=("hdp",))
    assert spec.steps == 2 and spec.max_tokens_per_rank == 256  # one timed step per recorded batch; its budget
    assert batch_lengths(spec, 0) == batch_lengths(spec, 1) == [40, 300, 12]
    bad = tmp_path / "bad.txt"
    for content, match in (("1 2 x\n", "line 1: '1 2 x' is not a list of integers"), ("3 0\n", "length 0 is not"),
                           ("# nothing\n", "holds no batch"), ('{"lengths": []}\n', "non-empty list")):
        bad.write_text(content)
        with pytest.raises(ValueError, match=match):
            read_batches(bad)
    with pytest.raises(ValueError, match="--lengths"):
        read_batches(tmp_path)  # a directory
    bad.write_text("5000\n")
    with pytest.raises(ValueError, match=r"a sample of 5000 tokens does not fit the domain of 2 ranks"):
        TrainBenchSpec(ranks=2, lengths=str(bad), max_tokens_per_rank=1024)


def test_models_from_presets_and_config_files(tmp_path: Path) -> None:
    tiny = model_shape(TrainBenchSpec())
    assert (tiny.num_layers, tiny.hidden_size, tiny.vocab_size, tiny.gated) == (4, 256, 1024, False)
    dense = model_shape(TrainBenchSpec(model="dense-8b", layers=2))
    assert (dense.num_layers, dense.hidden_size, dense.num_kv_heads) == (2, 4096, 8)
    hf = tmp_path / "hf" / "config.json"
    hf.parent.mkdir()
    hf.write_text(json.dumps({"model_type": "qwen3_moe", "num_hidden_layers": 4, "hidden_size": 64,
                              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                              "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 4,
                              "num_experts_per_tok": 2, "vocab_size": 256, "hidden_act": "silu"}))
    cfg = job_config(TrainBenchSpec(model=str(hf.parent), ranks=2, ep=2), "hdp", None).model  # the model's folder
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size, cfg.num_query_groups) == (4, 2, 32, 2)
    assert cfg.activation == "swiglu" and cfg.params_dtype == "float32"
    mega = tmp_path / "megatron.json"
    mega.write_text(json.dumps({"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 128}))
    cfg = job_config(TrainBenchSpec(model=str(mega), dtype="bfloat16"), "hdp", None).model
    assert (cfg.num_layers, cfg.ffn_hidden_size, cfg.activation, cfg.params_dtype) == (2, 256, "gelu", "bfloat16")
    with pytest.raises(ValueError, match="--model='nope': no such file and no shape preset"):
        model_shape(TrainBenchSpec(model="nope"))
    shared = tmp_path / "shared.json"
    shared.write_text(json.dumps({"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 128,
                                  "num_moe_experts": 4, "moe_shared_expert_intermediate_size": 64}))
    with pytest.raises(ValueError, match="shared experts"):
        model_shape(TrainBenchSpec(model=str(shared)))
    with pytest.raises(ValueError, match="tp=3: model.num_attention_heads=4"):  # the layout, before any rank
        job_config(TrainBenchSpec(ranks=3, tp=3), "hdp", None)


def test_model_flops_by_hand() -> None:
    """2 layers, H 8, 2 heads of 4, GELU MLP of 32, vocabulary 16: per token 2 x (L x (4 H^2 + 2 H x 32) + H V)
    FLOPs of matrix products forward, and causal attention's 2 L Hq (d + d) n(n+1)/2; a step is 3 x forward."""
    shape = model_shape(TrainBenchSpec(num_layers=2, hidden_size=8, num_attention_heads=2, vocab_size=16))
    per_token = 2 * (2 * (4 * 8 * 8 + 2 * 8 * 32) + 8 * 16)
    attention = sum(2 * 2 * 2 * (4 + 4) * n * (n + 1) / 2 for n in (3, 5))
    assert train_flops(shape, [3, 5]) == pytest.approx(3 * (8 * per_token + attention))
    assert peak_tflops("NVIDIA H100 80GB HBM3", None) == (989.0, "datasheet bf16 dense (H100)")
    assert peak_tflops("NVIDIA H100 PCIe", None)[0] == 756.0
    assert peak_tflops("AMD EPYC", None)[0] is None and peak_tflops("AMD EPYC", 2.5) == (2.5, "--peak-tflops")


def test_paired_ratios_and_their_interval() -> None:
    base = [2.0, 2.2, 1.8, 2.4, 2.0, 2.1, 1.9, 2.0]
    fast = [1.0, 1.1, 0.9, 1.2, 1.0, 1.05, 0.95, 1.0]  # every step exactly 2x faster: no spread at all
    got = paired(base, fast)
    assert got["median"] == pytest.approx(2.0) and got["ci95"] == pytest.approx([2.0, 2.0]) and got["n"] == 8
    noisy = paired(base, [1.0, 1.3, 0.8, 1.1, 1.0, 0.9, 1.2, 1.0])
    low, high = noisy["ci95"]
    assert low <= noisy["median"] <= high and noisy["half_width"] > 0
    assert median_ci95([1.0, 2.0, 3.0]) == median_ci95([1.0, 2.0, 3.0])  # seeded
    with pytest.raises(ValueError, match="pass one figure per step"):
        paired([1.0], [1.0, 2.0])
