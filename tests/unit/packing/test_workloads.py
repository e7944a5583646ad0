"""Workload generators and the lengths-file reader."""

from __future__ import annotations

import numpy as np
import pytest

from hdp.packing import workloads as wl


@pytest.mark.parametrize("name", sorted(wl.WORKLOADS))
def test_registry_seeded_int64_positive(name):
    a = wl.WORKLOADS[name](n=500, seed=3)
    b = wl.WORKLOADS[name](n=500, seed=3)
    c = wl.WORKLOADS[name](n=500, seed=4)
    assert a.dtype == np.int64 and a.shape == (500,)
    assert a.min() >= 1
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_lognormal_mean_and_clip():
    x = wl.lognormal(20_000, mean=1000.0, sigma=0.5, max_len=100_000, seed=0)
    assert abs(x.mean() / 1000.0 - 1.0) < 0.03
    assert wl.lognormal(1000, mean=5000.0, sigma=2.0, max_len=4096, seed=1).max() <= 4096


def test_rl_many_responses_hit_the_cap():
    x = wl.rl_prompt_response(5000, prompt_mean=512.0, response_mean=8192.0, response_cap=8192, seed=0)
    # prompt <= prompt_cap, response <= cap; a good share sit at cap + prompt
    assert x.max() <= 4096 + 8192
    resp_hit = np.mean(x >= 8192 + 1)
    assert resp_hit > 0.2


def test_bimodal_long_fraction():
    x = wl.bimodal(20_000, short_mean=1000.0, long_mean=20_000.0, long_frac=0.1, max_len=65_536, seed=0)
    assert 0.08 < np.mean(x > 6000) < 0.12


def test_short_tail_reaches_max_len():
    x = wl.short_tail(1024, mean=1536.0, max_len=32_768, seed=0)
    assert x.max() == 32_768 and 1200 < x.mean() < 2200


def test_wikipedia_sampling_and_clip(tmp_path, monkeypatch):
    f = tmp_path / "w.txt"
    f.write_text("10\n20\n# comment\n50000\n")
    x = wl.wikipedia(1000, max_len=1000, seed=0, path=f)
    assert set(np.unique(x)) <= {10, 20, 1000}
    monkeypatch.setenv(wl.WIKIPEDIA_ENV, str(f))
    np.testing.assert_array_equal(wl.wikipedia(1000, max_len=1000, seed=0), x)
    monkeypatch.setenv(wl.WIKIPEDIA_ENV, str(tmp_path / "missing.txt"))
    with pytest.raises(ValueError, match="not a file"):
        wl.wikipedia(10, seed=0)


def test_read_lengths(tmp_path):
    f = tmp_path / "l.txt"
    f.write_text("# header\n100\n\n  200  # inline\n300\n")
    np.testing.assert_array_equal(wl.read_lengths(f), [100, 200, 300])
    f.write_text("100\n2x0\n")
    with pytest.raises(ValueError, match=r"line 2: '2x0'"):
        wl.read_lengths(f)
    with pytest.raises(ValueError, match="cannot read"):
        wl.read_lengths(tmp_path / "nope.txt")


def test_bad_arguments():
    with pytest.raises(ValueError, match="n=0"):
        wl.lognormal(0)
    with pytest.raises(ValueError, match="long_frac"):
        wl.bimodal(10, long_frac=1.5)
    with pytest.raises(ValueError, match="unknown"):
        wl.get_workload("nope")
