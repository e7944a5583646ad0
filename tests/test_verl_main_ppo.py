"""``hdp demo --verl --critic``: PPO steps (GAE, a critic) of a tiny Qwen3 through ``python -m verl.trainer.main_ppo ...
model_engine=hdp`` on CPU, actor, ref and critic on hdp, the actor's old-log-prob pass skipped (on-policy).

The whole trainer, as a user runs it: verl's Hydra config and ``validate_config``, Ray, TransferQueue,
verl's v1 sync trainer, ``ActorRolloutRefWorker`` x2 building the hdp engine for actor and ref
(vanilla mbridge), verl's agent loop and reward loop, weight sync from the hdp engine to the rollout
(``get_per_tensor_param``), ref / old log-probs, GRPO advantages and ``update_actor``.  verl 0.9.1 has
no CPU rollout, so generation is hdp's HF ``generate`` server registered through verl's rollout
registries (``hdp.integrations.verl.scaffolding.hf_rollout``); the CPU platform and the Megatron/mbridge CPU
shims are loaded in every Ray process through ``VERL_USE_EXTERNAL_MODULES``
(``hdp.integrations.verl.scaffolding.autoload``).  Through the door users use: the ``hdp`` command.
Checked: exit status 0, the logged training steps, hdp's own metrics in them for the actor and the critic
(the hdp engines ran, timed their rounds and self-calibrate), the critic's value loss, the old-log-prob pass
skipped (``actor_rollout_ref.rollout.calculate_log_probs=False``: nothing reads the old log-probs before the
update) with ``actor/entropy`` still reported, and the calibration records of both roles.  (GRPO, the
demo's default, differs only in the driver's advantages and the absent critic.)
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

pytest.importorskip("verl")
pytest.importorskip("mbridge")
pytest.importorskip("transfer_queue")


@pytest.mark.slow
def test_hdp_demo_verl_runs_ppo_steps_with_a_critic_on_hdp(tmp_path):
    from hdp.trainer.phases import PHASES

    hdp = [sys.executable, "-m", "hdp.trainer"]
    out = subprocess.run([*hdp, "demo", "--verl", "--critic", "--out", str(tmp_path), "--steps", "2",
                          "--set", "actor_rollout_ref.rollout.calculate_log_probs=False"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=1200)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-6000:]
    steps = [line for line in log.splitlines() if re.search(r"\bstep:\d+ - ", line)]
    assert len(steps) == 2, "\n".join(steps) or log[-4000:]
    for line in steps:
        for key in ("actor/pg_loss", "actor/hdp/rounds", "actor/hdp/planner_ms", "actor/hdp/efficiency_planned",
                    "actor/hdp/predicted_over_measured", "actor/hdp/cost_model_version",
                    "actor/hdp/idle_fraction_measured", "actor/hdp/max_tokens_per_rank", "actor/hdp/planner_ms_exposed",
                    "actor/hdp/memory_peak_gb", "actor/hdp/token_budget",
                    *(f"actor/hdp/time/{p}" for p in PHASES),  # the step's phases, the slowest rank's seconds
                    "critic/vf_loss", "critic/hdp/rounds", "critic/hdp/plan_id", "critic/hdp/time/rounds",
                    "actor/entropy"):  # the skipped pass's metric, from the update
            assert key in line, (key, line[:3000])
        assert "actor/hdp/old_log_prob_skipped:1.0" in line, line[:3000]
        old = float(re.search(r"timing_s/old_log_prob:([\d.e+-]+)", line).group(1))
        upd = float(re.search(r"timing_s/update_actor:([\d.e+-]+)", line).group(1))
        assert old < upd, (old, upd)  # a TransferQueue write, not a forward over every sample
    assert "step 2: actor/hdp/" in out.stdout  # the demo's own summary
    assert "actor/hdp/time/rounds=" in out.stdout  # its printed metrics carry the phases
    for role in ("actor", "critic"):
        records = [json.loads(x) for x in (tmp_path / "hdp_calibration" / f"{role}.jsonl").read_text().splitlines()]
        assert {r["kind"] for r in records} == {"group", "round", "memory"}, role
