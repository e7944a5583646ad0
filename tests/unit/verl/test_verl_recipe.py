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

import dataclasses
import re

import pytest

from helpers.verl_recipe import FUSION_FLAGS, recipe_overrides

pytest.importorskip("verl")
pytest.importorskip("mbridge")

"""The recipe's fusion flags: Megatron's two, then MindSpeed's three (the NPU example's keys)."""


# ---- fast: every flag classified ---------------------------------------------------------------------------------


def _override_keys(overrides: list[str]) -> dict[str, str]:
    return {m.group(1): m.group(2) for o in overrides
            if (m := re.match(r"\+?actor_rollout_ref\.actor\.megatron\.override_transformer_config\.(\w+)=(.*)", o))}


def test_every_recipe_and_example_override_is_a_megatron_field_or_a_classified_flag() -> None:
    """Each ``override_transformer_config`` key of the recipe and of both example scripts is a field of megatron-core's
    ``TransformerConfig`` (verl hands it to Megatron) or a fusion flag of ``hdp.integrations.verl.fusions.FLAGS``;
    the recipe's fusion flags resolve to hdp's fused RoPE and SwiGLU, with MindSpeed's keys out of Megatron's
    config where MindSpeed is absent and kept for it where it runs."""
    from helpers.verl_examples import EXAMPLES, _overrides

    from hdp.integrations.verl.fusions import FLAGS, Handling, resolve
    from hdp.megatron_compat import TransformerConfig

    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    sources = {"recipe": recipe_overrides(), **{p.name: _overrides(p) for p in sorted(EXAMPLES.glob("*.sh"))}}
    for name, overrides in sources.items():
        keys = _override_keys(overrides)
        unknown = sorted(k for k in keys if k not in fields and k not in FLAGS)
        assert not unknown, f"{name}: override keys neither Megatron's nor classified: {unknown}"
        for k in keys:
            if k in FLAGS:
                assert FLAGS[k].mindspeed == (k not in fields), k  # MindSpeed's keys are exactly the non-fields
    # the NPU example's MindSpeed-only keys are among the flags the worker test builds verl's worker with
    npu = _override_keys(sources["qwen3_moe_grpo_npu.sh"])
    mindspeed_keys = {k for k in npu if k not in fields}
    assert mindspeed_keys and mindspeed_keys <= set(FUSION_FLAGS), mindspeed_keys
    keys = {k: v == "True" for k, v in _override_keys(recipe_overrides()).items()}
    assert set(FUSION_FLAGS) <= set(keys) and all(keys[f] for f in FUSION_FLAGS)
    here = resolve(keys, mindspeed=False, key="k")
    assert here.rope and here.swiglu and here.flags == FUSION_FLAGS
    assert set(here.megatron_overrides) == {"moe_grouped_gemm", "bias_activation_fusion"}
    assert here.dropped == ("use_fused_rmsnorm",)
    on_npu = resolve(keys, mindspeed=True, key="k")
    assert set(on_npu.megatron_overrides) == set(keys) - {"apply_rope_fusion"} and on_npu.dropped == ()
    assert {k for k, f in FLAGS.items() if f.handling is Handling.MEGATRON} == {"use_fused_rmsnorm"}
    # each flag names the kernel a device runs for it
    assert all("npu" in f.device_path for f in FLAGS.values())


@pytest.mark.parametrize("name, field", [("bias_swiglu_fusion", "bias_activation_fusion"),
                                         ("bias_gelu_fusion", "bias_activation_fusion")])
def test_megatron_lm_names_are_refused_naming_the_field(name: str, field: str) -> None:
    from hdp.integrations.verl.fusions import resolve

    key = "actor_rollout_ref.actor.megatron.override_transformer_config"
    with pytest.raises(ValueError, match=rf"{key}\.{name}=True: .*set {key}\.{field} instead"):
        resolve({name: True}, mindspeed=False, key=key)


def test_examples_run_grouped_gemm_experts_with_zero_memory() -> None:
    """Both examples: grouped-GEMM experts with zero-memory, expert TP 1, the fusion flags of their device."""
    from helpers.verl_examples import EXAMPLES, _overrides

    for path in sorted(EXAMPLES.glob("*.sh")):
        overrides = _overrides(path)
        keys = _override_keys(overrides)
        assert keys.get("moe_grouped_gemm") == "True", path.name
        assert any(re.match(r"actor_rollout_ref\.actor\.hdp\.zero_memory=level[01]$", o) for o in overrides), path.name
        assert "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1" in overrides, path.name
        assert "actor_rollout_ref.model.use_fused_kernels=True" in overrides, path.name
        assert keys.get("bias_activation_fusion") == "True", path.name
        fused = ("use_fused_rotary_pos_emb", "use_fused_swiglu", "use_fused_rmsnorm") if "npu" in path.name \
            else ("apply_rope_fusion",)
        assert all(keys.get(k) == "True" for k in fused), (path.name, keys)


"""verl's own step metrics both engines report: the update (losses, grad norm, entropy), the rollouts and rewards."""
