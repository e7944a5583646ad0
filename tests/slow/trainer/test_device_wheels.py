"""tools/device_wheels.py: the folder a bare GPU machine gets (<= 64 MiB) and the one command it runs.

The first test downloads the GPU machine's wheels (Python 3.12) from the package index and skips, naming
the reason, when the index cannot be reached.  The second fills the folder for this machine's Python and
runs the printed command (with ``--dry-run``) in a fresh venv that sees only what the GPU machine has —
torch and its own dependencies, numpy, numba, einops — so the wheels carried are all the bench imports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "tools" / "device_wheels.py"
DEVICE_HAS = ("torch", "filelock", "typing-extensions", "setuptools", "sympy", "mpmath", "networkx", "jinja2",
              "MarkupSafe", "fsspec", "numpy", "numba", "llvmlite", "einops")
"""The distributions a bare GPU machine has (torch with its requirements, numpy, numba, einops)."""


def _prepare(out: Path, python_version: str) -> dict:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--python-version", python_version,
                           "--json"], capture_output=True, text=True, timeout=900)
    if proc.returncode == 2 and "downloading" in proc.stderr:
        pytest.skip(f"the package index is not reachable from here: {proc.stderr.strip()[-300:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_folder_for_the_gpu_machine_fits_and_names_the_command(tmp_path):
    info = _prepare(tmp_path / "wheels", "3.12")
    names = list(info["wheels"])
    assert any(n.startswith("hdp_engine-") and n.endswith("py3-none-any.whl") for n in names), names
    assert any(n.startswith("megatron_core-0.16.1-cp312-cp312-manylinux") for n in names), names
    assert any(n.startswith("psutil-") for n in names) and any(n.startswith("packaging-") for n in names), names
    assert not any(n.startswith(("numba-", "llvmlite-", "torch-", "rich-")) for n in names), names
    total = sum(p.stat().st_size for p in (tmp_path / "wheels").iterdir())
    assert total == info["total_bytes"] <= 64 * 2**20 and info["fits"]
    cmd = info["command"]
    for part in ("--no-index", "--no-deps", "--target", "PYTHONPATH=", "bench device --json", '"$OUT/device.json"'):
        assert part in cmd, (part, cmd)
    assert len(cmd) < 2000  # the device tool takes a command line of at most 2,000 characters


def _bare_venv(where: Path) -> Path:
    """A venv that sees only `DEVICE_HAS` of this test venv's packages (links in a folder named by a .pth)."""
    venv.create(where / "venv", with_pip=False)
    py = where / "venv" / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    site = where / "device_site"
    site.mkdir()
    for name in DEVICE_HAS:
        dist = metadata.distribution(name)
        for top in {f.parts[0] for f in dist.files or () if f.parts and not f.parts[0].endswith(".data")}:
            src = Path(dist.locate_file(top))
            if src.exists() and not (site / top).exists() and top not in ("..", "bin", "__pycache__"):
                (site / top).symlink_to(src)
    (Path(purelib) / "device_site.pth").write_text(str(site) + "\n")
    return py


def test_the_command_runs_the_dry_run_where_only_the_gpu_machines_packages_are(tmp_path):
    info = _prepare(tmp_path / "wheels", f"{sys.version_info.major}.{sys.version_info.minor}")
    py = _bare_venv(tmp_path)
    probe = subprocess.run([str(py), "-c", "import torch, numba, einops; import megatron"], capture_output=True,
                           text=True)
    assert "No module named 'megatron'" in probe.stderr  # the venv really lacks what the folder carries
    out = tmp_path / "out"
    # the rows that need what the folder carries (Megatron-core for the engine; the kernel adapters): every
    # row's dry run through the CLI is tests/unit/trainer/test_bench_device.py
    # tests/distributed/trainer/test_bench_device_dist.py tests/slow/trainer/test_bench_device_slow.py's
    cmd = info["command"].replace("bench device --json", "bench device --dry-run --rows kernel_exactness,engine_pp1 --json")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OUT=str(out), PATH=f"{py.parent}:{env.get('PATH', '')}", PYTHONWARNINGS="ignore")
    proc = subprocess.run(["bash", "-c", cmd], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    log = (out / "device.log").read_text() if (out / "device.log").exists() else ""
    result = json.loads((out / "device.json").read_text())
    rows = {r["row"]: r for r in result["rows"]}
    assert proc.returncode == 0, proc.stdout[-2000:] + log[-3000:]
    assert result["environment"]["packages"]["megatron-core"] == "0.16.1"
    for name in ("kernel_exactness", "engine_pp1"):
        assert rows[name]["status"] == "ok", (name, rows[name].get("reason"), log[-3000:])
    assert all(r["status"] != "error" for r in rows.values()), [(r["row"], r.get("reason")) for r in rows.values()]
    assert "kernel_exactness" in proc.stdout  # the table printed at the end
