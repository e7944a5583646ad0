"""The recipe's configuration as a test: the verl overrides of the Ascend Qwen3-235B RL recipe (docs/design.md, "The
workload we were built from"; each flag's handling in docs/verl.md, "The recipe's flags") on a tiny Qwen3-MoE built
the way verl builds it (vanilla mbridge, grouped-GEMM experts), on CPU ranks.

The flags (:func:`recipe_overrides`): MoE zero-memory with grouped-GEMM experts (``moe_grouped_gemm``,
``hdp.zero_memory``), fused log-probs (``model.use_fused_kernels``), Megatron's distributed optimizer for actor and
reference, ``expert_tensor_parallel_size=1``, the fusion flags of RMSNorm / SwiGLU / RoPE (Megatron's
``apply_rope_fusion`` / ``bias_activation_fusion`` and MindSpeed's ``use_fused_rotary_pos_emb`` / ``use_fused_swiglu``
/ ``use_fused_rmsnorm``, as the NPU example passes them), ``use_remove_padding``, dynamic batch sizes and the token
budgets (``ppo_max_token_len_per_gpu``, ``log_prob_max_token_len_per_gpu``); layout PP 2 x EP 2 (4 ranks, a domain
of 2 per stage).

* fast: every flag of the recipe and of both example scripts is classified (honoured by hdp, by Megatron as verl
  passes it, or a documented no-op where its device kernel does not exist); Megatron-LM's names are refused;
* dist: verl's ``ActorRolloutRefWorker`` (EP 2 x a domain of 2 on 2 ranks; slow: PP 2 x EP 2 on 4) builds actor
  and reference with the recipe's flags and the NPU example's MindSpeed-only keys (before: ``TransformerConfig``
  refused them, and ``apply_rope_fusion`` without TransformerEngine), and runs the reference and old log-probs and
  an update; CPU stand-ins of the fused RoPE and SwiGLU kernels are registered and must be called by hdp's RoPE
  and the zero-memory experts; everything equals the HF model (fp32; tolerances of
  tests/distributed/verl/test_verl_worker_path.py tests/slow/verl/test_verl_worker_path_slow.py:
  log-probs and entropies 2e-5 absolute, loss 1e-5 relative, grad norm 1e-4 relative);
* slow: ``main_ppo`` with ``model_engine=hdp``, two steps, equal to stock verl's Megatron engine running the flags
  stock runs on CPU.

The fused kernels of NPUs and GPUs are not run on hardware here.
"""

from __future__ import annotations

import pytest

from helpers.verl_recipe import _check_recipe_worker

pytest.importorskip("verl")
pytest.importorskip("mbridge")

"""The recipe's fusion flags: Megatron's two, then MindSpeed's three (the NPU example's keys)."""


def test_recipe_flags_through_verls_worker_equal_hf_and_take_the_fused_kernels(tmp_path) -> None:
    """The recipe's flags (and the NPU example's MindSpeed keys) through verl's worker on EP 2 x a domain of 2
    (2 ranks): built, the fused-kernel stand-ins called by hdp's RoPE and the zero-memory experts on every rank,
    log-probs, entropies, the reference's log-probs, loss and grad norm equal to HF's."""
    _check_recipe_worker(1, tmp_path)


"""verl's own step metrics both engines report: the update (losses, grad norm, entropy), the rollouts and rewards."""
