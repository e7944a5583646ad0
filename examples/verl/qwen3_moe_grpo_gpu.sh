#!/usr/bin/env bash
# NOT RUN ON HARDWARE.
# Written against verl 0.9.1 + hdp (integrations/verl). Its overrides compose with verl 0.9.1's
# ppo_trainer and pass validate_config on CPU (placeholder paths); no GPU run has happened yet.
#
# GRPO on Qwen3-30B-A3B (MoE, 128 experts, top-8) with the actor and the reference model on hdp's
# engine: 1 node x 8 GPUs (H100/H200 80+ GB), EP = 8, TP = PP = CP = 1 (hdp supplies CP per sample,
# sized to each sample's length, inside attention), long-tail responses up to 16K tokens.
#
# Needs: verl==0.9.1 installed without its [megatron] extra, megatron-core 0.16.x, Megatron-Bridge
# (verl's Megatron engine builds the model through it), vLLM for rollout, and
#   pip install "hdp-engine[verl]"        # registers the 'hdp' engine through verl.plugins
# The switch is `actor_rollout_ref.actor.strategy=hdp`; `model_engine=hdp` additionally gives the
# actor and the ref verl's full `megatron.*` block (EP, offload, overrides), which a MoE model needs.
set -xeuo pipefail

MODEL_PATH=${MODEL_PATH:-$HOME/models/Qwen3-30B-A3B}
TRAIN_FILES=${TRAIN_FILES:-$HOME/data/dapo-math-17k/train.parquet}
VAL_FILES=${VAL_FILES:-$HOME/data/aime-2024/test.parquet}
NNODES=${NNODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
EP=${EP:-8}
MAX_PROMPT=${MAX_PROMPT:-2048}
MAX_RESPONSE=${MAX_RESPONSE:-16384}
# hdp's token budget per GPU and round (bounds activation memory; long samples get CP groups)
TOKENS_PER_GPU=${TOKENS_PER_GPU:-24576}

# verl sets CUDA_DEVICE_MAX_CONNECTIONS=1 only for strategy == "megatron"; hdp runs TP = 1 and does
# not need it. Router replay (R2/R3) is verl-megatron only and stays off under strategy=hdp.

python3 -m verl.trainer.main_ppo \
    model_engine=hdp \
    actor_rollout_ref.actor.strategy=hdp \
    algorithm.adv_estimator=grpo \
    algorithm.use_kl_in_reward=False \
    data.train_files="$TRAIN_FILES" \
    data.val_files="$VAL_FILES" \
    data.train_batch_size=64 \
    data.max_prompt_length=$MAX_PROMPT \
    data.max_response_length=$MAX_RESPONSE \
    data.filter_overlong_prompts=True \
    data.truncation=error \
    actor_rollout_ref.model.path="$MODEL_PATH" \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=16 \
    actor_rollout_ref.actor.use_dynamic_bsz=True \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=$TOKENS_PER_GPU \
    actor_rollout_ref.actor.loss_agg_mode=token-mean \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1 \
    actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1 \
    actor_rollout_ref.actor.megatron.context_parallel_size=1 \
    actor_rollout_ref.actor.megatron.expert_model_parallel_size=$EP \
    actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1 \
    actor_rollout_ref.actor.megatron.param_offload=True \
    actor_rollout_ref.actor.megatron.optimizer_offload=True \
    +actor_rollout_ref.actor.megatron.override_transformer_config.moe_router_dtype=fp32 \
    +actor_rollout_ref.actor.megatron.override_transformer_config.moe_token_dispatcher_type=alltoall \
    actor_rollout_ref.actor.hdp.max_tokens_per_rank=$TOKENS_PER_GPU \
    actor_rollout_ref.actor.hdp.policy=hdp \
    actor_rollout_ref.actor.hdp.group_shape=any \
    actor_rollout_ref.actor.hdp.cp_algorithm=ring \
    actor_rollout_ref.actor.hdp.zero_memory=none \
    actor_rollout_ref.actor.hdp.cost_model=qwen3-235b-a22b \
    actor_rollout_ref.actor.hdp.hardware_profile=h100-nvlink \
    actor_rollout_ref.ref.megatron.expert_model_parallel_size=$EP \
    actor_rollout_ref.ref.megatron.param_offload=True \
    actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True \
    actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=$TOKENS_PER_GPU \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=4 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True \
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=$TOKENS_PER_GPU \
    trainer.logger='["console"]' \
    trainer.project_name=hdp_verl \
    trainer.experiment_name=qwen3_30b_a3b_grpo_hdp_gpu \
    trainer.nnodes=$NNODES \
    trainer.n_gpus_per_node=$GPUS_PER_NODE \
    trainer.save_freq=-1 \
    trainer.test_freq=10 \
    trainer.total_epochs=1 "$@"
