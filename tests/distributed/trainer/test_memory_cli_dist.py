"""The distributed tier (other processes) of the tests tests/unit/trainer/test_memory_cli.py describes: its docstring says what they check and how."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from helpers.memory_cli import ISSUE, _check_plan_within_limit

"""The command the memory model's checks run."""


def test_issue_command_through_the_installed_entry_point():
    exe = Path(sys.executable).with_name("hdp")
    assert exe.exists(), exe
    done = subprocess.run([str(exe), *ISSUE, "--zero-memory", "level1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    d = json.loads(done.stdout)
    _check_plan_within_limit(d, 64)
    done = subprocess.run([str(exe), *ISSUE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("error: ") and "Traceback" not in done.stderr
