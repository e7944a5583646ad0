#!/usr/bin/env python3
"""Fill a folder with the wheels a bare GPU machine lacks for ``hdp bench device``; print the command to run there.

The GPU machine this targets has Python 3.12, torch with CUDA, Triton, numba, numpy and einops, and no
network: it gets this checkout and one folder of at most 64 MiB.  The folder holds

* ``hdp_engine`` built from this checkout (pure Python: the one namespace ``hdp`` needs the install's
  package mapping, a bare checkout on ``PYTHONPATH`` has no ``hdp.packing``);
* ``megatron-core`` 0.16.1 (the cp312 manylinux wheel, ~2.6 MB) and what it and the bench import that a
  torch install does not bring: ``packaging`` (megatron-core) and ``psutil`` (hdp's process launcher);
* with ``--numba``: numba 0.68.1 and llvmlite 0.50 (~50 MB) for a machine whose numba is missing or broken;
  not needed by default: hdp takes any numba from 0.59 (the first for Python 3.12) on.

rich and matplotlib (the other CLI's tables and charts) are not carried: ``hdp bench device`` prints a plain
table.  Nothing is installed here; downloads go through pip (``pip download --no-deps --only-binary``
for the target's Python and platform).  Usage::

    python tools/device_wheels.py                 # -> device_wheels/ and the command line
    python tools/device_wheels.py --out DIR --python-version 3.12 --numba

Exit codes: 0 ready, 1 the folder is over the limit, 2 a build or download failed (the message says which).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT_MIB = 64
CARRIED = ("megatron-core==0.16.1", "packaging>=24.2", "psutil>=5.9")
NUMBA = ("numba==0.68.1", "llvmlite==0.50.0")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux_2_12_x86_64", "manylinux2010_x86_64")


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"{what} failed ({' '.join(map(shlex.quote, cmd[:6]))} ...): " + " | ".join(tail))


_MAIN = "import sys; from hdp.trainer.cli import main; sys.exit(main())"
_TABLE = ("import json, sys; from hdp.trainer.bench.device import format_table; "
          "print(format_table(json.load(open(sys.argv[1]))))")


def device_command(folder: str, extra: str = "") -> str:
    """The one command line for the GPU machine, run in the checkout with ``$OUT`` the folder that comes back.

    Installs the folder's wheels into a fresh target directory (``pip --no-index --no-deps``; where the machine
    has no pip, the wheels are unzipped there, which is all a wheel install does for these), runs the bench
    from that directory (so the checkout's own ``hdp/`` folder is not what ``import hdp`` finds) with its JSON
    in ``$OUT/device.json``, its files in ``$OUT/files`` and its log in ``$OUT/device.log``, then prints the
    log's tail and the table.  ``extra``: more flags for ``hdp bench device``.
    """
    flags = f"bench device --json --out \"$OUT/files\"{(' ' + extra) if extra else ''}"
    src = f"\"{folder}\"" if folder.startswith("/") else f"\"$R\"/{folder}"  # relative: to the checkout
    return (f"R=$(pwd) && T=$(mktemp -d) && (python -m pip install -q --no-index --no-deps --target \"$T\" "
            f"{src}/*.whl || for w in {src}/*.whl; do python -m zipfile -e \"$w\" \"$T\"; done) "
            f"&& mkdir -p \"$OUT\" && cd \"$T\" && PYTHONPATH=\"$T\" python -c '{_MAIN}' {flags} "
            f"> \"$OUT/device.json\" 2> \"$OUT/device.log\"; tail -n 15 \"$OUT/device.log\"; "
            f"cd \"$T\" && PYTHONPATH=\"$T\" python -c '{_TABLE}' \"$OUT/device.json\"")


def prepare(out: Path, python_version: str, numba: bool) -> dict:
    """Fill ``out`` (created; older wheels removed) and return what it holds."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.whl"):
        old.unlink()
    _run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)],
         "building the hdp wheel")
    abi = "cp" + python_version.replace(".", "")
    download = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                "--python-version", python_version, "--implementation", "cp", "--abi", abi, "--abi", "abi3",
                "--abi", "none", "-d", str(out)]
    for plat in PLATFORMS:
        download += ["--platform", plat]
    _run(download + list(CARRIED) + (list(NUMBA) if numba else []), "downloading " + ", ".join(CARRIED))
    wheels = sorted(out.glob("*.whl"))
    sizes = {w.name: w.stat().st_size for w in wheels}
    total = sum(sizes.values())
    return {"folder": str(out), "wheels": sizes, "total_bytes": total, "total_mib": total / 2**20,
            "limit_mib": LIMIT_MIB, "fits": total <= LIMIT_MIB * 2**20, "python_version": python_version,
            "numba_carried": numba, "command": device_command(_relative(out))}


def _relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "device_wheels"), help="folder to fill (default device_wheels/)")
    ap.add_argument("--python-version", default="3.12", help="the GPU machine's Python (default 3.12)")
    ap.add_argument("--numba", action="store_true", help="also carry numba 0.68.1 and llvmlite 0.50 (~50 MB)")
    ap.add_argument("--json", action="store_true", help="print what the folder holds as one JSON object")
    args = ap.parse_args(argv)
    try:
        info = prepare(Path(args.out), args.python_version, args.numba)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(info))
    else:
        for name, size in info["wheels"].items():
            print(f"{size / 2**20:8.2f} MiB  {name}")
        print(f"{info['total_mib']:8.2f} MiB  in {info['folder']} (limit {LIMIT_MIB} MiB)")
        print("on the GPU machine, in the checkout, with this folder carried along:")
        print(info["command"])
    if not info["fits"]:
        print(f"error: {info['total_mib']:.1f} MiB is over the {LIMIT_MIB} MiB a run may carry", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
