"""The verl door on a laptop: a few GRPO steps of ``python -m verl.trainer.main_ppo`` with ``model_engine=hdp`` on CPU.

``hdp demo --verl`` (or ``make verl-demo``) runs :func:`run`: :func:`prepare` writes a tiny Qwen3
(built from its config with random weights, ``save_pretrained``), a parquet set of arithmetic prompts
in verl's RLHF format and a reward function; :func:`command` is the ``main_ppo`` command line (GRPO
with 2 responses per prompt, 2 CPU ranks, ``model_engine=hdp``, the ``hf_cpu`` rollout of
:mod:`hdp.integrations.verl.scaffolding.hf_rollout`); :func:`environment` loads hdp's CPU scaffolding in every
Ray process.  verl's own trainer, workers, Hydra config and logger run unchanged; what prints is
verl's console logger, ``actor/hdp/*`` included.  Needs the ``verl`` extra.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Callable, Sequence

logger = logging.getLogger(__name__)


def _log(text: str, *, error: bool = False) -> None:
    logger.log(logging.ERROR if error else logging.INFO, "%s", text)

__all__ = ["prepare", "command", "environment", "run", "main"]

_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """1.0 when the answer's digits appear in the response (a toy reward)."""
    return float(str(ground_truth) in solution_str.replace(" ", ""))
'''


def prepare(root: str | Path, *, n_prompts: int = 8, moe: bool = False) -> dict[str, str]:
    """Write model (``moe``: the tiny Qwen3-MoE), data and reward under ``root``; returns their paths."""
    import pandas as pd

    from hdp.integrations.verl.scaffolding.tiny import build_tiny

    root = Path(root)
    model = build_tiny(root / "model", moe=moe)
    rows = []
    for i in range(n_prompts):
        a, b = i + 1, 2 * i + 3
        rows.append({
            "data_source": "toy_sum",
            "prompt": [{"role": "user", "content": f"what is {a} + {b} ?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"index": i},
        })
    data = root / "train.parquet"
    pd.DataFrame(rows).to_parquet(data)
    reward = root / "reward.py"
    reward.write_text(_REWARD)
    return {"model": str(model), "data": str(data), "reward": str(reward), "out": str(root / "out")}


def command(paths: dict[str, str], *, steps: int = 2, ranks: int = 2, critic: bool = False,
            overrides: Sequence[str] = (), engine: str = "hdp") -> list[str]:
    """``python -m verl.trainer.main_ppo`` with the overrides of the tiny CPU GRPO run (``critic``: PPO with
    GAE, the value model on hdp too), then ``overrides`` (verl's ``KEY=VALUE``).  ``engine="megatron"``: verl's
    stock Megatron engine instead (``model_engine=megatron``, no ``hdp.*`` key; the tests' differential runs, with
    :func:`environment` ``(stock=True)``)."""
    if engine not in ("hdp", "megatron"):
        raise ValueError(f"engine={engine!r}: choose 'hdp' or 'megatron'")
    budget = 256
    records = Path(paths["out"]).parent / "hdp_calibration" / "{role}.jsonl"  # actor.jsonl, critic.jsonl
    value = [
        "algorithm.adv_estimator=gae",
        f"critic.model.path={paths['model']}",
        "critic.model.use_remove_padding=True",
        "critic.megatron.dtype=float32",
        f"critic.ppo_max_token_len_per_gpu={budget}",
        "critic.optim.lr=1e-3",
    ] if critic else ["algorithm.adv_estimator=grpo"]
    return [
        sys.executable, "-m", "verl.trainer.main_ppo",
        *value,
        f"model_engine={engine}",
        f"data.train_files={paths['data']}",
        f"data.val_files={paths['data']}",
        "data.train_batch_size=4",
        "data.max_prompt_length=32",
        "data.max_response_length=16",
        "data.filter_overlong_prompts=False",
        "data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={paths['model']}",
        "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.use_dynamic_bsz=True",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={budget}",
        f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={budget}",
        f"actor_rollout_ref.ref.log_prob_max_token_len_per_gpu={budget}",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.actor.megatron.vanilla_mbridge=True",
        *([f"actor_rollout_ref.actor.hdp.calibration_path='{records}'"] if engine == "hdp" else []),
        "actor_rollout_ref.actor.megatron.dtype=float32",
        "actor_rollout_ref.ref.megatron.dtype=float32",
        "actor_rollout_ref.rollout.name=hf_cpu",
        "actor_rollout_ref.rollout.n=2",
        # one rollout replica over the ranks: one HF server generates every sample, seeded per sample, so a run
        # repeats its responses (with a replica per rank verl's load balancer spreads a prompt's samples over
        # servers in any order) and one process fewer starts
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={ranks}",
        "actor_rollout_ref.rollout.free_cache_engine=False",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        f"reward.custom_reward_function.path={paths['reward']}",
        "reward.custom_reward_function.name=compute_score",
        "reward.num_workers=1",  # verl starts 8 reward processes by default: each imports torch and verl
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",  # and 8 storage processes
        "trainer.logger=['console']",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        f"trainer.total_training_steps={steps}",
        f"trainer.n_gpus_per_node={ranks}",
        "trainer.nnodes=1",
        f"trainer.default_local_dir={paths['out']}",
        "trainer.device=cpu",
        "ray_kwargs.ray_init.num_cpus=16",  # logical slots: TaskRunner, TransferQueue, workers, servers
        "+ray_kwargs.ray_init.include_dashboard=False",
        f"+ray_kwargs.ray_init.resources={{NPU:{ranks}}}",  # logical slots (see hdp.integrations.verl.scaffolding.platform)
        *overrides,
    ]


def environment(*, stock: bool = False) -> dict[str, str]:
    """The driver's environment: Ray workers started from it inherit these (CPU platform, autoload; ``stock``: verl's
    stock Megatron engine registered for the CPU platform too, `hdp.integrations.verl.scaffolding.autoload`)."""
    return {
        **os.environ,
        **({"HDP_VERL_STOCK_MEGATRON": "1"} if stock else {}),
        "VERL_PLATFORM": "cpu",
        "VERL_USE_EXTERNAL_MODULES": "hdp.integrations.verl.scaffolding.autoload",
        "RAY_DEDUP_LOGS": "0",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
    }


def run(root: str | Path, *, steps: int = 3, ranks: int = 2, critic: bool = False, overrides: Sequence[str] = (),
        timeout: float = 1800.0, echo: Callable[[str], None] | None = None,
        tail: list[str] | None = None, moe: bool = False, engine: str = "hdp") -> tuple[int, list[str]]:
    """Run the demo under ``root``; returns (exit code, verl's step lines), each also passed to ``echo``;
    ``tail`` (a list) receives the last 200 lines of main_ppo's output (to show when it fails).  ``moe``: the tiny
    Qwen3-MoE; ``engine``: as :func:`command`."""
    import collections
    import re
    import subprocess

    paths = prepare(root, moe=moe)
    proc = subprocess.Popen(command(paths, steps=steps, ranks=ranks, critic=critic, overrides=overrides, engine=engine),
                            env=environment(stock=engine == "megatron"), cwd=str(root),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    steps_seen: list[str] = []
    last: collections.deque[str] = collections.deque(maxlen=200)
    assert proc.stdout is not None
    for line in proc.stdout:
        last.append(line.rstrip())
        if re.search(r"\bstep:\d+ - ", line):
            steps_seen.append(line.rstrip())
            if echo is not None:
                echo(line.rstrip())
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = 124
    if tail is not None:
        tail.extend(last)
    return code, steps_seen


def hdp_metrics(step_line: str) -> dict[str, float]:
    """``actor/hdp/*`` and ``critic/hdp/*`` metrics of one verl console step line (``name:value`` pairs)."""
    import re

    return {m.group(1): float(m.group(2)) for m in re.finditer(r"((?:actor|critic)/hdp/[\w/]+):([-+\w.]+)", step_line)
            if m.group(2) not in ("nan",)}


def main(argv: list[str] | None = None, echo: Callable[..., None] | None = None) -> int:
    """``hdp demo --verl``: run the demo in ``--out`` (default out/verl-demo) and summarise hdp's metrics.

    ``echo(text, error=False)`` shows a line (the CLI passes its console); default: this module's logger."""
    import argparse

    parser = argparse.ArgumentParser(prog="hdp demo --verl")
    parser.add_argument("--out", default="out/verl-demo")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--critic", action="store_true", help="PPO with GAE: the critic (value model) on hdp too")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="one more override of verl's main_ppo (repeatable), e.g. actor_rollout_ref.actor.hdp.skip_old_log_prob=false")
    args = parser.parse_args(argv)
    root = Path(args.out).resolve()
    root.mkdir(parents=True, exist_ok=True)
    show = echo if echo is not None else _log
    algo = "PPO (GAE, critic on hdp)" if args.critic else "GRPO"
    show(f"hdp demo --verl: verl main_ppo, {algo}, tiny Qwen3 on {args.ranks} CPU ranks, {args.steps} steps, "
         f"model_engine=hdp (files under {root})")
    tail: list[str] = []
    code, lines = run(root, steps=args.steps, ranks=args.ranks, critic=args.critic, overrides=args.set, echo=show,
                      tail=tail)
    for i, line in enumerate(lines, 1):
        show(f"step {i}: " + ", ".join(f"{k}={v:.4g}" for k, v in sorted(hdp_metrics(line).items())))
    if code != 0 or not lines:
        for line in tail:
            show(line, error=True)
        show(f"hdp demo --verl: main_ppo exited with {code}; the last {len(tail)} lines of its output are above",
             error=True)
        return code or 1
    return 0
