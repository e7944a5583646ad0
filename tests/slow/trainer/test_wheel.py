"""The package a user installs: build the wheel, install it (not editable) into a fresh venv, use it from ``/``.

The wheel once shipped without ``hdp.packing.policies.hdp`` (a hand-kept package list; only editable
installs were tested), so ``plan()`` with the default policy could not import.  Here the wheel is
built from this checkout, installed with ``--no-deps`` into a new venv that sees the test venv's
site-packages (torch, numpy, megatron-core, verl: nothing is downloaded) through a ``.pth`` line — a
path added that way does not run that directory's own ``.pth`` files, so the checkout's editable
install stays out of sight — and run from ``/``: ``hdp plan`` with the default policy (its compiled
kernels without a cache directory: the checkout's plan to the checksum), the verl
plugin's import, its Hydra configs and the bundled data file.  Every ``.py`` of the source roots
must be in the wheel, and no CI-only module (benchmarks/ stays outside it).
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SOURCES = {"hdp": "hdp", "packing": "hdp/packing", "trainer": "hdp/trainer", "integrations": "hdp/integrations"}


def test_built_wheel_installs_and_plans_from_outside_the_checkout(tmp_path) -> None:
    dist = tmp_path / "dist"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                            "-q", "-w", str(dist)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert build.returncode == 0, build.stderr[-3000:]
    wheel = next(dist.glob("hdp_engine-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for src, dst in SOURCES.items():
        for py in (ROOT / src).rglob("*.py"):
            rel = py.relative_to(ROOT / src).as_posix()
            assert f"{dst}/{rel}" in names, f"{dst}/{rel} is not in the wheel"
    assert "hdp/packing/data/wikipedia_sample.txt" in names
    # what users run, not this project's CI harness (tests/unit/trainer/test_wheel_contents.py: the same rule on the
    # sources)
    from helpers.wheel_contents import WHEEL_BENCH

    assert not [n for n in names if n.startswith(("benchmarks/", "tests/"))], "CI harness in the wheel"
    assert {Path(n).stem for n in names if n.startswith("hdp/trainer/bench/") and n.endswith(".py")} == WHEEL_BENCH
    assert any(n.startswith("hdp/integrations/verl/conf/") and n.endswith(".yaml") for n in names)

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    py = env_dir / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    (Path(purelib) / "test_venv.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q",
                              str(wheel)], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    hdp = env_dir / "bin" / "hdp"
    # the planner's kernels where numba finds no writable cache directory (its locators all refuse):
    # compiled in the process (seconds), and the plan is this checkout's to the checksum
    out = subprocess.run([str(hdp), "plan", "--workload", "rl", "--samples", "64", "-N", "8", "-B", "8192", "--json"],
                         capture_output=True, text=True, timeout=300, cwd="/",
                         env={**env, "NUMBA_CACHE_LOCATOR_CLASSES": "ZipCacheLocator"})
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout)
    assert doc["policy"] == "hdp" and doc["stats"]["rounds"] >= 1, doc.get("stats")
    from hdp.packing import PlannerConfig, plan, workloads

    here = plan(workloads.WORKLOADS["rl"](n=64, seed=0), PlannerConfig(num_ranks=8, max_tokens_per_rank=8192))
    assert doc["checksum"] == here.checksum() and doc["lengths"] == here.lengths.tolist()
    assert not list(Path(purelib).rglob("*.nbi")), "numba wrote a cache although every locator refused"
    code = (
        "import hdp, hdp.integrations.verl.plugin as plugin, pathlib, json;"
        "from hdp.integrations.verl import config_dir;"
        "from hdp.packing.workloads import get_workload;"
        "conf = sorted(p.name for p in pathlib.Path(config_dir()).rglob('*.yaml'));"
        "print(json.dumps({'file': hdp.__file__, 'conf': conf, 'wiki': len(get_workload('wikipedia')(n=16, seed=0))}))"
    )
    out = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=300, cwd="/", env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["file"].startswith(str(env_dir)), got["file"]  # the installed wheel, not the checkout
    assert {"hdp_ppo_trainer.yaml", "hdp_actor.yaml", "hdp_ref.yaml", "hdp.yaml"} <= set(got["conf"]), got["conf"]
    assert got["wiki"] == 16
