"""Definitions more than one test module needs (a test module never imports another), moved out of
test_verl_examples.py; used by tests/distributed/verl/test_verl_examples.py, tests/unit/verl/test_verl_recipe.py."""

from __future__ import annotations

import re
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "verl"


def _overrides(script: Path) -> list[str]:
    text = script.read_text()
    defaults = dict(re.findall(r"^(\w+)=\$\{\w+:-(.*?)\}$", text, flags=re.M))
    body = text.split("python3 -m verl.trainer.main_ppo", 1)[1]
    out = []
    for line in body.splitlines():
        line = line.strip().rstrip("\\").strip()
        if not line or line.startswith('"$@"') or line.endswith('"$@"') and line == '"$@"':
            continue
        line = line.replace(' "$@"', "")
        line = re.sub(r"\$(\w+)", lambda m: defaults.get(m.group(1), m.group(0)), line).replace('"', "")
        line = line.replace("$HOME", "/home/user")
        out.append(line.replace("'", ""))
    return out
