#!/usr/bin/env bash
# NOT RUN ON HARDWARE (no Ascend NPU was lent to these sessions).  Its overrides compose with verl
# 0.9.1's ppo_trainer and build hdp's actor/ref configs on CPU (tests/distributed/verl/test_verl_examples.py).
#
# GRPO on Qwen3-235B-A22B (MoE) on Ascend NPUs with the actor and the reference model on hdp's engine:
# 4 nodes x 16 NPUs (Atlas 800T A3) = 64 NPUs, TP 1 x PP 4 x EP 16: each stage's 16 NPUs are hdp's
# domain.  94 layers over 4 stages: 23 on the first and the last, 24 on the two in between.  On NPU
# verl registers MindSpeed's engine for backend "megatron"; the hdp plugin registers
# `HdpMindspeedEngine` (HdpMegatronEngine on verl's MindSpeed engine, so MindSpeed's repatch runs
# before Megatron initialises) for device "npu" when MindSpeed is installed.  hdp replaces Megatron's
# core attention, so MindSpeed's flash-attention patch does not reach it: the hdp engine runs hdp's
# pure-torch attention kernel on NPU today (the npu_fusion_attention adapter in hdp.kernels.npu is
# unrun) — expect slow attention.  All-gather CP on aligned power-of-two groups (HCCS full mesh);
# zero-memory level0 with grouped-GEMM experts (moe_grouped_gemm=True; zero-memory runs their GEMMs through
# torch_npu's npu_grouped_matmul, an adapter not run on hardware; whichever of Megatron's expert modules
# MindSpeed builds must be SequentialMLP, GroupedMLP or TEGroupedMLP, or hdp refuses naming the class).
# The recipe's fused kernels (docs/verl.md, "The recipe's flags"): use_fused_rotary_pos_emb makes hdp's own RoPE
# take torch_npu.npu_rotary_mul, use_fused_swiglu with bias_activation_fusion the zero-memory experts' SwiGLU
# torch_npu.npu_swiglu (both adapters not run on hardware), use_fused_rmsnorm goes to MindSpeed (its patch of
# Megatron's RMSNorm); use_fused_kernels=True runs hdp's fused log-probs (no [T, V] logits).
#
# Model building: vanilla_mbridge=True (PyPI mbridge), the path hdp's CPU tests run; verl 0.9.1's default,
# Megatron-Bridge (vanilla_mbridge=False), has never run with hdp (verl warns that mbridge is deprecated).
#
# Needs: CANN + torch_npu matching torch, MindSpeed (core_r0.16-compatible branch), verl==0.9.1 without
# [megatron], megatron-core 0.16.x, PyPI mbridge, vLLM + vllm-ascend, and hdp from a checkout or a built wheel:
#   pip install -e '.[verl,npu]'
set -xeuo pipefail

MODEL_PATH=${MODEL_PATH:-$HOME/models/Qwen3-235B-A22B}
TRAIN_FILES=${TRAIN_FILES:-$HOME/data/dapo-math-17k/train.parquet}
VAL_FILES=${VAL_FILES:-$HOME/data/aime-2024/test.parquet}
NNODES=${NNODES:-4}
NPUS_PER_NODE=${NPUS_PER_NODE:-16}
PP=${PP:-4}
EP=${EP:-16}
MAX_PROMPT=${MAX_PROMPT:-2048}
MAX_RESPONSE=${MAX_RESPONSE:-30720}
TOKENS_PER_NPU=${TOKENS_PER_NPU:-16384}

# Ascend runtime settings commonly used with verl + MindSpeed
export HCCL_CONNECT_TIMEOUT=${HCCL_CONNECT_TIMEOUT:-1800}
export HCCL_EXEC_TIMEOUT=${HCCL_EXEC_TIMEOUT:-3600}
export TASK_QUEUE_ENABLE=${TASK_QUEUE_ENABLE:-2}
export CPU_AFFINITY_CONF=${CPU_AFFINITY_CONF:-1}
export PYTORCH_NPU_ALLOC_CONF=${PYTORCH_NPU_ALLOC_CONF:-expandable_segments:True}
export VLLM_USE_V1=1

python3 -m verl.trainer.main_ppo \
    model_engine=hdp \
    trainer.device=npu \
    algorithm.adv_estimator=grpo \
    algorithm.use_kl_in_reward=False \
    data.train_files="$TRAIN_FILES" \
    data.val_files="$VAL_FILES" \
    data.train_batch_size=128 \
    data.max_prompt_length=$MAX_PROMPT \
    data.max_response_length=$MAX_RESPONSE \
    data.filter_overlong_prompts=True \
    data.truncation=error \
    actor_rollout_ref.model.path="$MODEL_PATH" \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.model.use_fused_kernels=True \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=32 \
    actor_rollout_ref.actor.use_dynamic_bsz=True \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=$TOKENS_PER_NPU \
    actor_rollout_ref.actor.loss_agg_mode=token-mean \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1 \
    actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=$PP \
    actor_rollout_ref.actor.megatron.context_parallel_size=1 \
    actor_rollout_ref.actor.megatron.expert_model_parallel_size=$EP \
    actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1 \
    actor_rollout_ref.actor.megatron.use_distributed_optimizer=True \
    actor_rollout_ref.actor.megatron.param_offload=True \
    actor_rollout_ref.actor.megatron.vanilla_mbridge=True \
    actor_rollout_ref.actor.megatron.optimizer_offload=True \
    +actor_rollout_ref.actor.megatron.override_transformer_config.num_layers_in_first_pipeline_stage=23 \
    +actor_rollout_ref.actor.megatron.override_transformer_config.num_layers_in_last_pipeline_stage=23 \
    +actor_rollout_ref.actor.megatron.override_transformer_config.moe_grouped_gemm=True \
    +actor_rollout_ref.actor.megatron.override_transformer_config.moe_router_dtype=fp32 \
    +actor_rollout_ref.actor.megatron.override_transformer_config.bias_activation_fusion=True \
    +actor_rollout_ref.actor.megatron.override_transformer_config.use_fused_rmsnorm=True \
    +actor_rollout_ref.actor.megatron.override_transformer_config.use_fused_swiglu=True \
    +actor_rollout_ref.actor.megatron.override_transformer_config.use_fused_rotary_pos_emb=True \
    actor_rollout_ref.actor.hdp.policy=hdp \
    actor_rollout_ref.actor.hdp.group_shape=pow2 \
    actor_rollout_ref.actor.hdp.cp_algorithm=allgather \
    actor_rollout_ref.actor.hdp.zero_memory=level0 \
    actor_rollout_ref.actor.hdp.cost_model=qwen3-235b-a22b@ascend-910b-hccs \
    actor_rollout_ref.actor.hdp.collective_timeout_s=1800 \
    actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=$PP \
    actor_rollout_ref.ref.megatron.expert_model_parallel_size=$EP \
    actor_rollout_ref.ref.megatron.expert_tensor_parallel_size=1 \
    actor_rollout_ref.ref.megatron.use_distributed_optimizer=True \
    actor_rollout_ref.ref.megatron.param_offload=True \
    actor_rollout_ref.ref.megatron.vanilla_mbridge=True \
    actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True \
    actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=$TOKENS_PER_NPU \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=16 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.enforce_eager=True \
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True \
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=$TOKENS_PER_NPU \
    trainer.logger='["console"]' \
    trainer.project_name=hdp_verl \
    trainer.experiment_name=qwen3_235b_a22b_grpo_hdp_npu \
    trainer.nnodes=$NNODES \
    trainer.n_gpus_per_node=$NPUS_PER_NODE \
    trainer.save_freq=-1 \
    trainer.test_freq=10 \
    trainer.total_epochs=1 "$@"
