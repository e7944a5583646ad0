"""Golden plans: the checksum of every bench family's plan at both bench sizes is the one committed here.

The checksums were computed with the planner as it was before its compiled kernels were split into
modules (the hdp policy at 1,024 samples x 64 ranks and 8,192 x 512, the policy with power-of-two
groups and with four pipeline stages, and the baselines, on the families of ``hdp bench planner``
with their own cost models and token budgets, seed 0).  A change to the planner that changes any
plan fails here; one that means to must say why and record the new checksums.

A checksum covers the lengths, the budget, the policy and every sample's round, group start and
size (`Plan.checksum`), so equal checksums are equal plans.
"""

from __future__ import annotations

import pytest

from hdp.packing import plan
from hdp.packing.suite import SAMPLES_PER_RANK
from hdp.trainer.bench.planner import FAMILIES, SIZES

VARIANTS: dict[str, dict[str, object]] = {
    "hdp": {},
    "hdp-pow2": {"group_shape": "pow2"},
    "hdp-pp4": {"pipeline_stages": 4},
    "static-cp": {"policy": "static-cp"},
    "verl-kk": {"policy": "verl-kk"},
    "megatron-dcp": {"policy": "megatron-dcp"},
    "ascend-hdp": {"policy": "ascend-hdp"},
}
"""Config options of every planned variant (the keys' first part in `GOLDEN`)."""

GOLDEN: dict[str, dict[str, str]] = {
    "lognormal": {
        "hdp/64": "b28a8d12828fc7a0", "hdp/512": "a2a0b6b2ce5b7e8f", "hdp-pow2/64": "dc697a4e3c7ef43c",
        "hdp-pp4/64": "5e51fc3523f0f505", "static-cp/64": "8780805f8b29a427", "verl-kk/64": "7c18c9cc599224a3",
        "verl-kk/512": "6f313fbb1d795aa1", "megatron-dcp/64": "6cb5bed444af390c", "ascend-hdp/64": "e06bdab1c9001953",
    },
    "rl-16k": {
        "hdp/64": "ed924177f4152f66", "hdp/512": "f28afd48b6acf37f", "hdp-pow2/64": "33f70690d2275eaf",
        "hdp-pp4/64": "ed924177f4152f66", "static-cp/64": "cdd93ae50588e3ef", "verl-kk/64": "faa6088d0669086b",
        "verl-kk/512": "0e99681dc13ac3c0", "megatron-dcp/64": "e469d6ea07c8f18b", "ascend-hdp/64": "d72559bccf8a0575",
    },
    "rl-32k": {
        "hdp/64": "90bf299cbd87db59", "hdp/512": "2370465889b8042f", "hdp-pow2/64": "dd92fb7c21ce3058",
        "hdp-pp4/64": "90bf299cbd87db59", "static-cp/64": "e42d9d4d03cb8577", "verl-kk/64": "cc700dbcf272a5fc",
        "verl-kk/512": "570c80eba59883b3", "megatron-dcp/64": "3a054fc27030e53c", "ascend-hdp/64": "b99539d27e363db8",
    },
    "bimodal": {
        "hdp/64": "b52ff2183e108fdc", "hdp/512": "74c8763fcab5d1d8", "hdp-pow2/64": "9a9ccadecd9e27e8",
        "hdp-pp4/64": "67786aec051222e7", "static-cp/64": "aa276b15b6a8d67e", "verl-kk/64": "7af1377de2b26426",
        "verl-kk/512": "53ae79fdd7b3707f", "megatron-dcp/64": "5bc2852f2185fa37", "ascend-hdp/64": "b86e0cfb7a01ebbe",
    },
    "wikipedia": {
        "hdp/64": "becfff7b5eba2eab", "hdp/512": "9738a1955819a941", "hdp-pow2/64": "147093fc55d1a69c",
        "hdp-pp4/64": "f8e96eb08a62a087", "static-cp/64": "5b4b65088aac5b5e", "verl-kk/64": "bf997383623a98d4",
        "verl-kk/512": "784da9b423a68d52", "megatron-dcp/64": "09ae566e9dfa506e", "ascend-hdp/64": "268d2abc43e8ecd9",
    },
    "ascend-short-tail": {
        "hdp/64": "696d336eefd379eb", "hdp/512": "74759f82206896a5", "hdp-pow2/64": "f7d6ffcd4ace9621",
        "hdp-pp4/64": "14ef7527517d8629", "static-cp/64": "221a54e822028bf1", "verl-kk/64": "97b23eea06db9243",
        "verl-kk/512": "185fc5c2fb4a721d", "megatron-dcp/64": "58201cda31e3b81d", "ascend-hdp/64": "7ac0745031f6f273",
    },
    "short-reasoning": {
        "hdp/64": "b2176e20354b463e", "hdp/512": "2f842612b1645f52", "hdp-pow2/64": "61675e29f6f8d876",
        "hdp-pp4/64": "4fdbb8cd20287626", "static-cp/64": "1b7243a65a73abbb", "verl-kk/64": "87744d13ff8e29c7",
        "verl-kk/512": "8fee3d7e55d5f641", "megatron-dcp/64": "69dd34cc2f6cf6b8", "ascend-hdp/64": "8b868bba9e74950f",
    },
    "pareto": {
        "hdp/64": "afc7e311f3d722ef", "hdp/512": "c9b68846943d90ca", "hdp-pow2/64": "8c12f9854d2226ab",
        "hdp-pp4/64": "32c9ad290c2c9df7", "static-cp/64": "9168cfe1b0d3e474", "verl-kk/64": "077918afbd35c68f",
        "verl-kk/512": "4b04152ff2af2122", "megatron-dcp/64": "a158401444862aca", "ascend-hdp/64": "b2e7d9e5686313b8",
    },
    "rl-grouped-16": {
        "hdp/64": "d4ddaadd28d305d0", "hdp/512": "c83e61793ad6d9f4", "hdp-pow2/64": "795582b64e2f127d",
        "hdp-pp4/64": "f019950694c3a248", "static-cp/64": "92d462dcf6a74bcf", "verl-kk/64": "cfd9114b9148165d",
        "verl-kk/512": "1d8b1e97ae8a958e", "megatron-dcp/64": "c68955bd2da3fe38", "ascend-hdp/64": "fdf3bb5fda8d5349",
    },
}
"""Per family, ``"{variant}/{ranks}"`` -> the plan's checksum (16 x ranks samples, seed 0)."""


def test_every_bench_family_at_both_sizes_has_golden_plans():
    assert set(GOLDEN) == {f.name for f in FAMILIES}
    for name, cases in GOLDEN.items():
        assert {f"hdp/{ranks}" for ranks, _ in SIZES} <= set(cases), name
        assert {key.split("/")[0] for key in cases} == set(VARIANTS), name


@pytest.mark.parametrize("fam", FAMILIES, ids=[f.name for f in FAMILIES])
def test_plans_are_the_golden_plans(fam):
    got, want = {}, GOLDEN[fam.name]
    for key in want:
        variant, ranks = key.split("/")
        lengths = fam.lengths(SAMPLES_PER_RANK * int(ranks), 0)
        got[key] = plan(lengths, fam.config(int(ranks), **VARIANTS[variant])).checksum()
    assert got == want
