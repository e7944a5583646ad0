"""The distributed tier (other processes) of the tests tests/unit/verl/test_verl_config.py describes: its docstring says what they check and how."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from helpers.verl_config import BASE, _compose, _engine_cls, _ref_config, _validate

pytest.importorskip("verl")
warnings.filterwarnings("ignore", message=".*engine is not available.*")

from verl.utils.config import omega_conf_to_dataclass

from hdp.integrations.verl.config import HdpActorConfig
from hdp.integrations.verl.engine import HdpMegatronEngine  # noqa: E402


def test_strategy_hdp_on_megatron_config_names_the_override():
    """ppo_megatron_trainer + actor.strategy=hdp used to run verl's stock Megatron engine silently."""
    from hydra.errors import InstantiationException

    cfg = _compose("ppo_megatron_trainer", BASE + ["actor_rollout_ref.actor.strategy=hdp"])
    with pytest.raises((ValueError, InstantiationException), match=r"model_engine=hdp"):
        _validate(cfg)  # the driver's check, before Ray starts (main_ppo calls validate_config)
    # the override the message names works on the same config: actor and ref on hdp
    cfg = _compose("ppo_megatron_trainer", BASE + ["model_engine=hdp"])
    for c in (omega_conf_to_dataclass(cfg.actor_rollout_ref.actor), _ref_config(cfg)):
        assert isinstance(c, HdpActorConfig) and _engine_cls(c.engine) is HdpMegatronEngine
    _validate(cfg)


def test_the_cli_never_imports_the_verl_integration():
    """The verl bench is this project's CI's (`benchmarks.verl.bench`, ``python -m benchmarks verl``); the ``hdp``
    command never imports the verl integration, and trainer/ never names it."""
    from benchmarks.verl.bench import BASELINE, BASELINE_POLICY

    assert BASELINE_POLICY in BASELINE and BASELINE_POLICY != "hdp"  # the baseline is a planner policy the step runs
    code = "import sys, hdp.trainer.cli; print(any(m.startswith('hdp.integrations') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
    src = Path(__file__).resolve().parents[3] / "trainer"
    assert not any("hdp.integrations" in p.read_text() for p in src.rglob("*.py")), "trainer/ must not import hdp.integrations"
