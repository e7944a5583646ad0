"""``hdp plan`` starts no process and needs no torch: it must not import it (about 2.4 s of a 4 s run)."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import contextlib, io, json, sys
from hdp.trainer.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    rc = main(sys.argv[1:])
heavy = sorted(m for m in ("torch", "megatron.core", "hdp.trainer.launch") if m in sys.modules)
print(json.dumps({"rc": rc, "imported": heavy}))
"""


def test_hdp_plan_imports_no_torch() -> None:
    for args in (["plan", "--workload", "rl", "--samples", "2000", "-N", "1", "-B", "40960"],
                 ["plan", "--workload", "rl", "--samples", "64", "-N", "1", "-B", "40960", "--json"]):
        out = subprocess.run([sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        got = json.loads(out.stdout.strip().splitlines()[-1])
        assert got == {"rc": 0, "imported": []}, (args, got)
