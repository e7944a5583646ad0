"""The slow tier (over ~20 s) of the tests tests/unit/verl/test_verl_recipe.py describes: its docstring says what they check and how."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.verl_recipe import _check_recipe_worker, recipe_overrides

pytest.importorskip("verl")
pytest.importorskip("mbridge")

"""The recipe's fusion flags: Megatron's two, then MindSpeed's three (the NPU example's keys)."""


def test_recipe_flags_under_pp2_through_verls_worker_equal_hf(tmp_path) -> None:
    """As above on PP 2 x EP 2 (4 ranks): every stage rotates q/k and runs zero-memory experts."""
    _check_recipe_worker(2, tmp_path)


# ---- slow: main_ppo, two steps, hdp against stock verl's Megatron engine (PP 2 x EP 2, 4 ranks) -----------------

PPO_STEPS = 2
COMPARED = ("actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/entropy_loss", "actor/grad_norm", "actor/entropy",
            "actor/ppo_kl", "actor/pg_clipfrac",
            "critic/score/mean", "critic/advantages/mean", "response_length/mean", "prompt_length/mean")
"""verl's own step metrics both engines report: the update (losses, grad norm, entropy), the rollouts and rewards."""


def _main_ppo_overrides(engine: str) -> list[str]:
    """The recipe's flags at the demo's scale for ``engine``: stock verl gets the ones its Megatron engine runs on CPU
    (grouped-GEMM experts, the distributed optimizer, expert TP 1, Megatron's fused SwiGLU, packing, dynamic batch
    sizes and the token budgets); hdp gets all of them (plus zero-memory, fused log-probs, the fused RoPE and
    MindSpeed's keys, which stock cannot run here: TransformerEngine, verl's triton fused forward, MindSpeed)."""
    hdp_only = ("use_fused_kernels", "hdp.zero_memory", "apply_rope_fusion", "use_fused_rotary_pos_emb",
                "use_fused_swiglu", "use_fused_rmsnorm")
    common = [o for o in recipe_overrides(budget=256) if not any(k in o for k in hdp_only)]
    common += [
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.entropy_coeff=0.01",
        "actor_rollout_ref.actor.optim.lr=1e-2",  # large: step 2's rollouts come from visibly updated weights
        "actor_rollout_ref.rollout.calculate_log_probs=True",
    ]
    if engine == "megatron":
        return common
    return [*common, *(o for o in recipe_overrides(budget=256) if o not in common),
            "actor_rollout_ref.actor.hdp.max_tokens_per_rank=24",  # hdp's budget: long samples get a CP group
            "actor_rollout_ref.actor.hdp.skip_old_log_prob=false",  # stock runs the pass: so does hdp
            "actor_rollout_ref.actor.hdp.cost_model=cpu-tiny@cpu-gloo"]


def _steps(root: Path, engine: str) -> list[dict[str, float]]:
    """``main_ppo`` (``hdp demo --verl``'s run: 4 prompts x 2 samples per step, the ``hf_cpu`` rollout) of the tiny
    Qwen3-MoE on 4 CPU ranks with ``engine``; each step's metrics."""
    from helpers.verl_main_ppo import _step_metrics

    from hdp.integrations.verl.demo import run

    tail: list[str] = []
    code, lines = run(root, steps=PPO_STEPS, ranks=4, moe=True, engine=engine, overrides=_main_ppo_overrides(engine),
                      timeout=1500, tail=tail)
    assert code == 0 and len(lines) == PPO_STEPS, (engine, code, "\n".join(tail[-80:]))
    return [_step_metrics(line) for line in lines]


def test_main_ppo_two_steps_with_the_recipe_flags_equal_stock_megatron(tmp_path) -> None:
    """``python -m verl.trainer.main_ppo``, GRPO, two steps of the tiny Qwen3-MoE on PP 2 x EP 2 (4 CPU ranks): the
    hdp engine with every recipe flag (``model_engine=hdp``) and stock verl's Megatron engine with the ones it runs
    on CPU (``model_engine=megatron``, `hdp.integrations.verl.scaffolding.stock_megatron`) report the same update
    and rollout metrics at both steps (step 2's rollouts come from each engine's step-1 weights, synced to the
    rollout).  Tolerance: 1e-4 relative plus 1e-6 absolute (fp32; the engines sum in different orders: packed CP
    chunks, DP 2 micro-batches, grouped GEMMs inside or outside zero-memory)."""
    pytest.importorskip("hdp.integrations.verl.scaffolding.stock_megatron",
                        reason="needs verl's stock Megatron engine on CPU: hdp.integrations.verl.scaffolding.stock_megatron, "
                               "the conformance suite's scaffolding, is not in this tree")
    stock = _steps(tmp_path / "stock", "megatron")
    hdp = _steps(tmp_path / "hdp", "hdp")
    worst: dict[str, float] = {}
    for step, (h, s) in enumerate(zip(hdp, stock), start=1):
        assert h["actor/hdp/rounds"] >= 1 and "actor/hdp/rounds" not in s  # each engine is the one asked for
        for key in COMPARED:
            assert key in h and key in s, (step, key, sorted(h), sorted(s))
            diff = abs(h[key] - s[key])
            worst[key] = max(worst.get(key, 0.0), diff)
            assert diff <= 1e-4 * abs(s[key]) + 1e-6, (step, key, h[key], s[key])
    assert any(abs(m["actor/grad_norm"]) > 0 for m in stock), "a step must train (non-zero advantages)"
    print("main_ppo hdp vs stock, max |diff| over both steps: " + ", ".join(f"{k} {v:.3g}" for k, v in worst.items()))
