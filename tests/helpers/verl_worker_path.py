"""Definitions more than one test module needs (a test module never imports another), moved out of
test_verl_worker_path.py; used by tests/distributed/verl/test_verl_worker_path.py,
tests/slow/verl/test_verl_worker_path_slow.py, tests/unit/verl/test_verl_fused_logprobs.py,
tests/unit/verl/test_verl_recipe.py."""

from __future__ import annotations

LENGTHS = [(5, 9), (3, 90), (7, 12), (4, 20), (6, 4), (2, 30)]  # (prompt, response); 93 > budget 64
BUDGET = 64
ENTROPY_COEFF = 0.01  # the update differentiates through the entropy too (vocab-parallel under TP)


def _compose(model_path: str, *, moe: bool, ckpt_dir: str, tp: int = 1, pp: int = 1, vpp: int = 1,
             budget: int = BUDGET, grouped: bool = False) -> object:
    """The scaffolding's verl config (ppo_trainer, model_engine=hdp, a tiny fp32 model on CPU) with this
    test's loss, layout and checkpoint settings."""
    from hdp.integrations.verl.scaffolding.worker import compose

    overrides = [
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_coef=0.1",
        f"actor_rollout_ref.actor.entropy_coeff={ENTROPY_COEFF}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={len(LENGTHS)}",
        f"actor_rollout_ref.ref.megatron.dtype={'bfloat16' if moe else 'float32'}",
        "actor_rollout_ref.actor.optim.lr=1e-2",
        "actor_rollout_ref.actor.optim.total_training_steps=10",
        "actor_rollout_ref.actor.hdp.cost_model=cpu-tiny@cpu-gloo",
        "actor_rollout_ref.actor.hdp.auto_calibrate=false",
        "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra]",
    ]
    for role in ("actor", "ref"):  # verl's own Megatron layout keys; the ref's are read separately
        overrides += [
            f"actor_rollout_ref.{role}.megatron.tensor_model_parallel_size={tp}",
            f"actor_rollout_ref.{role}.megatron.pipeline_model_parallel_size={pp}",
        ]
        if vpp > 1:
            overrides.append(f"actor_rollout_ref.{role}.megatron.virtual_pipeline_model_parallel_size={vpp}")
    if moe:
        overrides += [
            "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
            "actor_rollout_ref.ref.megatron.expert_model_parallel_size=2",
            "actor_rollout_ref.actor.hdp.zero_memory=level1",
            "actor_rollout_ref.actor.megatron.param_offload=true",
            "actor_rollout_ref.actor.megatron.optimizer_offload=true",
        ]
    if grouped:  # grouped-GEMM experts (TEGroupedMLP, as mbridge builds them on GPUs) with zero-memory
        overrides.append("+actor_rollout_ref.actor.megatron.override_transformer_config.moe_grouped_gemm=True")
    return compose(model_path, budget=budget, records=f"{ckpt_dir}/records/actor.jsonl", overrides=overrides)


def _hf_reference(model_path: str, samples, padded, extra, actor_cfg):
    """fp32 HF: per-sample input-aligned log-probs and entropies [L_i] and (loss, grad norm) of verl's
    ppo_loss (with the entropy bonus), dp_size 1."""
    from functools import partial

    import torch
    from transformers import AutoModelForCausalLM

    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss
    from hdp.integrations.verl.scaffolding import batches as B

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    logps, ents = [], []
    for p, r in samples:
        ids = torch.tensor(p + r)[None]  # [1, L]
        logits = model(input_ids=ids).logits[0].float()  # [L, V]
        full = torch.log_softmax(logits, dim=-1)  # [L, V]
        lp = full[:-1].gather(-1, ids[0, 1:, None])[:, 0]  # [L-1]
        logps.append(torch.cat([lp, lp.new_zeros(1)]))  # input-aligned: p predicts p+1
        ents.append(-(full.exp() * full).sum(-1))  # [L]
    data = B.update_batch(padded, extra, mini_batch_size=len(samples), calculate_entropy=True)
    mask = data["loss_mask"]
    n_tok = int(mask.values().sum() if mask.is_nested else mask.sum())
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=n_tok)
    out = {"log_probs": torch.nested.as_nested_tensor(logps, layout=torch.jagged),
           "entropy": torch.nested.as_nested_tensor(ents, layout=torch.jagged)}
    loss, _ = partial(ppo_loss, config=actor_cfg)(model_output=out, data=data)
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))
    return [x.detach() for x in logps], [x.detach() for x in ents], float(loss), float(norm)
