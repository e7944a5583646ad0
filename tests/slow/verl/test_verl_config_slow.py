"""The slow tier (over ~20 s) of the tests tests/unit/verl/test_verl_config.py describes: its docstring says what they check and how."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

pytest.importorskip("verl")
warnings.filterwarnings("ignore", message=".*engine is not available.*")


def test_import_verl_is_lazy_and_registers_on_engine_import(tmp_path: Path):
    """`import verl` with hdp's entry point imports neither verl's engines nor Megatron nor hdp's engine;
    importing verl's engine registry (as a training worker does) registers the `hdp` backend."""
    dist_info = tmp_path / "hdp_ep_probe-0.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: hdp-ep-probe\nVersion: 0.0\n")
    (dist_info / "entry_points.txt").write_text("[verl.plugins]\nhdp = hdp.integrations.verl.plugin\n")
    code = textwrap.dedent(
        """
        import sys
        import verl
        heavy = [m for m in ("megatron", "verl.workers.engine", "hdp.integrations.verl.engine", "hdp.trainer")
                 if m in sys.modules]
        print("HEAVY", heavy)
        from verl.workers.engine import EngineRegistry
        cls = EngineRegistry.get_engine_cls("language_model", "hdp")
        print("HEAVY_AFTER_LOOKUP", "hdp.integrations.verl.engine" in sys.modules)
        print(cls.resolve().__name__)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert "HEAVY []" in lines, out.stdout
    assert "HEAVY_AFTER_LOOKUP False" in lines, out.stdout  # the real engine loads only when constructed
    assert lines[-1] == "HdpMegatronEngine"
