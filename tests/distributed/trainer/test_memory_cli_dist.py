"""The memory model on the command line : ``hdp plan/simulate --memory-gb --shape --layout``
derive B and keep every round's predicted peak within the limit, the what-if report compares with static
CP at the smallest CP size that fits, zero-memory shrinks the group a 32K sample needs, ``hdp calibrate``
fits the memory coefficients into the cost-model file that plan reads back, and bad input is one line."""

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
