"""``python -m verl.trainer.main_ppo ... model_engine=hdp``: 2 GRPO steps of a tiny Qwen3 on CPU (2 ranks, Ray).

The whole trainer, as a user runs it: verl's Hydra config and ``validate_config``, Ray, TransferQueue,
verl's v1 sync trainer, ``ActorRolloutRefWorker`` x2 building the hdp engine for actor and ref
(vanilla mbridge), verl's agent loop and reward loop, weight sync from the hdp engine to the rollout
(``get_per_tensor_param``), ref / old log-probs, GRPO advantages and ``update_actor``.  verl 0.9.1 has
no CPU rollout, so generation is a test-only HF ``generate`` server registered through verl's rollout
registries (``tests/verl_support/hf_rollout.py``); the CPU platform and the Megatron/mbridge CPU shims
are loaded in every Ray process through ``VERL_USE_EXTERNAL_MODULES`` (``tests/verl_support/autoload.py``).
Checked: exit status 0, two logged training steps, and hdp's own metrics in them (the hdp engine ran).
"""

from __future__ import annotations

import re
import subprocess

import pytest

pytest.importorskip("verl")
pytest.importorskip("mbridge")
pytest.importorskip("transfer_queue")

from verl_support import ppo_job  # noqa: E402


@pytest.mark.slow
def test_main_ppo_two_grpo_steps_on_hdp(tmp_path):
    paths = ppo_job.prepare(tmp_path)
    cmd = ppo_job.command(paths, steps=2, ranks=2)
    out = subprocess.run(cmd, env=ppo_job.environment(), cwd=tmp_path, capture_output=True, text=True, timeout=900)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-6000:]
    steps = [line for line in log.splitlines() if re.search(r"\bstep:\d+ - ", line)]
    assert len(steps) == 2, "\n".join(steps) or log[-4000:]
    for line in steps:
        assert "actor/pg_loss" in line and "hdp/rounds" in line, line[:2000]
