"""The distributed tier (other processes) of the tests tests/unit/packing/test_planner_kernels.py describes: its docstring says what they check and how."""

from __future__ import annotations

import os
import subprocess
import sys

from hdp.packing import PlannerConfig, plan


_SCRIPT = """
import numpy as np
from hdp.packing import PlannerConfig, plan, workloads
lengths = workloads.WORKLOADS["short-reasoning"](n=512, seed=11)
print(plan(lengths, PlannerConfig(num_ranks=32, max_tokens_per_rank=4096)).checksum())
"""


def _checksum_in_a_new_process(**env: str) -> str:
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=600,
                         env={**os.environ, **env})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def test_plans_are_identical_in_every_process():
    """Each rank plans on its own: a fresh process (kernels loaded from the cache) gets the plan this one
    gets, to the checksum."""
    from hdp.packing import workloads

    lengths = workloads.WORKLOADS["short-reasoning"](n=512, seed=11)
    here = plan(lengths, PlannerConfig(num_ranks=32, max_tokens_per_rank=4096)).checksum()
    assert _checksum_in_a_new_process() == here
    assert _checksum_in_a_new_process() == here


# --- declarations, warm-up, the cache stamp ----------------------------------------------------------

_COMPILED_SCRIPT = """
import sys
from hdp.packing import plan
from hdp.packing.kernels.jit import kernels_of
from hdp.trainer.bench.planner import FAMILIES

def compiled():
    from hdp.packing.policies.hdp import kernels
    return {f"{d.py_func.__module__}.{d.__name__}": (list(d.overloads), [decl])
            for m in kernels.MODULES for d, decl in kernels_of(m)}

mode = sys.argv[1]
if mode == "baseline":
    for fam in FAMILIES[:3]:
        for policy in ("static-cp", "verl-kk"):
            plan(fam.lengths(1024, 0), fam.config(64, policy=policy))
    print(sorted(m for m in sys.modules if m.startswith("hdp.packing.policies.hdp")))
    sys.exit()
import hdp.packing.policies.hdp  # warm-up
print(sorted(k for k, (got, want) in compiled().items() if got != want))
for fam in FAMILIES:
    for ranks, options in ((64, {}), (512, {}), (64, {"group_shape": "pow2"}), (64, {"pipeline_stages": 4})):
        plan(fam.lengths(16 * ranks, 0), fam.config(ranks, **options))
print(sorted(k for k, (got, want) in compiled().items() if got != want))
"""


def _run(mode: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", _COMPILED_SCRIPT, mode], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()


def test_warm_up_compiles_every_declared_kernel_and_planning_compiles_nothing_more():
    """After the hdp policy's import every kernel holds exactly its declared signature, and planning every
    bench family (both sizes, power-of-two groups, a pipeline) adds no other version: the call sites
    pass the declared types, so no plan pays a compilation."""
    after_import, after_plans = _run("hdp")
    assert after_import == "[]" and after_plans == "[]", (after_import, after_plans)


def test_a_baseline_policy_loads_none_of_the_hdp_policy():
    """static-cp and verl-kk (Karmarkar-Karp's kernel) plan without importing the hdp policy, so they never
    pay its compilation."""
    (loaded,) = _run("baseline")
    assert loaded == "[]"
