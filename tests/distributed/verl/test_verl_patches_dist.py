"""The distributed tier (other processes) of the tests tests/unit/verl/test_verl_patches.py describes: its docstring says what they check and how."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("verl")

from hdp.integrations.verl.patches import PATCHES, Scope  # noqa: E402

HOOKED = ("verl.utils.config", "verl.trainer.ppo.ray_trainer", "verl.trainer.ppo.v1.trainer_base",
          "verl.experimental.separation.engine_workers")
"""The verl modules the plugin patches right after their import (plugin._HOOKS, less the engine registry)."""


def test_a_fresh_process_with_every_hooked_module_holds_exactly_the_import_rows():
    """A driver-side process (the plugin loaded by ``import verl`` through its entry point): the patches found in
    verl's and Hydra's modules are the ``import`` rows, each in the one place the table names, and no hdp function
    or object is anywhere else in an installed library (the import hook's loader only on hooked modules)."""
    from hdp.integrations.verl import plugin

    assert set(HOOKED) == set(plugin._HOOKS) - {"verl.workers.engine.base"}
    code = ("import json, verl\n"
            f"for m in {HOOKED!r}: __import__(m)\n"
            "from hdp.integrations.verl import patches\n"
            "print('FOUND', json.dumps(patches.installed()))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("FOUND "))[6:])
    undocumented = found.pop("undocumented", [])
    assert undocumented == [], undocumented
    assert set(found.pop("import hook", [])) <= set(plugin._HOOKS)  # those imported after `import verl`
    assert found == {p.name: [p.name] for p in PATCHES if p.scope is Scope.IMPORT}
