#!/usr/bin/env bash
# NOT RUN ON HARDWARE (no GPU was lent to these sessions).  Its overrides compose with verl 0.9.1's
# ppo_trainer and build hdp's actor/ref configs on CPU (tests/distributed/verl/test_verl_examples.py); nothing else ran.
#
# GRPO on Qwen3-235B-A22B (MoE: 94 layers, 128 experts, top-8) with the actor and the reference model on
# hdp's engine: 8 nodes x 8 H100/H200 = 64 GPUs, TP 1 x PP 8 x EP 8.  World = TP x PP x domain, so each
# pipeline stage's 8 GPUs form hdp's domain (Megatron's DP group with CP = 1): every long response gets
# a CP group of just enough of those 8 GPUs, short ones run on one GPU.  94 layers over 8 stages:
# 11 on the first and the last, 12 on each of the 6 in between.  MoE zero-memory level1 frees the
# expert path's activations (so a 32K response fits a smaller CP group), with grouped-GEMM experts
# (moe_grouped_gemm=True: mbridge builds TransformerEngine's TEGroupedMLP; zero-memory runs their GEMMs as
# torch's grouped_mm, bf16 on compute capability >= 8.0).  The fusion flags (docs/verl.md, "The recipe's flags"):
# apply_rope_fusion makes hdp's own RoPE take flash-attn's rotary kernel where flash-attn is installed (not run on
# hardware), bias_activation_fusion fuses Megatron's MLP activations (the zero-memory experts' SwiGLU has no CUDA
# kernel in hdp: the plain form); use_fused_kernels=True runs hdp's fused log-probs (no [T, V] logits).
#
# Model building: vanilla_mbridge=True (PyPI mbridge), the path hdp's CPU tests run (there with a CPU
# stand-in of TE's grouped linear, same weight names); verl 0.9.1's default, Megatron-Bridge
# (vanilla_mbridge=False), has never run with hdp (verl warns that mbridge is deprecated).
#
# Needs: verl==0.9.1 installed without its [megatron] extra, megatron-core 0.16.x, PyPI mbridge,
# TransformerEngine, vLLM, and hdp with its verl extra from a checkout or a built wheel:
#   pip install -e '.[verl]'     or     pip install 'dist/hdp_engine-0.1.0-py3-none-any.whl[verl]'
set -xeuo pipefail

MODEL_PATH=${MODEL_PATH:-$HOME/models/Qwen3-235B-A22B}
TRAIN_FILES=${TRAIN_FILES:-$HOME/data/dapo-math-17k/train.parquet}
VAL_FILES=${VAL_FILES:-$HOME/data/aime-2024/test.parquet}
NNODES=${NNODES:-8}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
PP=${PP:-8}
EP=${EP:-8}
MAX_PROMPT=${MAX_PROMPT:-2048}
MAX_RESPONSE=${MAX_RESPONSE:-30720}
# hdp's token budget per GPU and round (bounds activation memory; longer samples get CP groups)
TOKENS_PER_GPU=${TOKENS_PER_GPU:-16384}

python3 -m verl.trainer.main_ppo \
    model_engine=hdp \
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
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=$TOKENS_PER_GPU \
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
    +actor_rollout_ref.actor.megatron.override_transformer_config.num_layers_in_first_pipeline_stage=11 \
    +actor_rollout_ref.actor.megatron.override_transformer_config.num_layers_in_last_pipeline_stage=11 \
    +actor_rollout_ref.actor.megatron.override_transformer_config.moe_grouped_gemm=True \
    +actor_rollout_ref.actor.megatron.override_transformer_config.moe_router_dtype=fp32 \
    +actor_rollout_ref.actor.megatron.override_transformer_config.moe_token_dispatcher_type=alltoall \
    +actor_rollout_ref.actor.megatron.override_transformer_config.apply_rope_fusion=True \
    +actor_rollout_ref.actor.megatron.override_transformer_config.bias_activation_fusion=True \
    actor_rollout_ref.actor.hdp.policy=hdp \
    actor_rollout_ref.actor.hdp.group_shape=any \
    actor_rollout_ref.actor.hdp.cp_algorithm=ring \
    actor_rollout_ref.actor.hdp.zero_memory=level1 \
    actor_rollout_ref.actor.hdp.cost_model=qwen3-235b-a22b@h100-nvlink \
    actor_rollout_ref.actor.hdp.auto_calibrate=True \
    actor_rollout_ref.actor.hdp.calibration_path=hdp_calibration/actor.jsonl \
    actor_rollout_ref.actor.hdp.collective_timeout_s=1800 \
    actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=$PP \
    actor_rollout_ref.ref.megatron.expert_model_parallel_size=$EP \
    actor_rollout_ref.ref.megatron.expert_tensor_parallel_size=1 \
    actor_rollout_ref.ref.megatron.use_distributed_optimizer=True \
    actor_rollout_ref.ref.megatron.param_offload=True \
    actor_rollout_ref.ref.megatron.vanilla_mbridge=True \
    actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True \
    actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=$TOKENS_PER_GPU \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=8 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True \
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=$TOKENS_PER_GPU \
    trainer.logger='["console"]' \
    trainer.project_name=hdp_verl \
    trainer.experiment_name=qwen3_235b_a22b_grpo_hdp_gpu \
    trainer.nnodes=$NNODES \
    trainer.n_gpus_per_node=$GPUS_PER_NODE \
    trainer.save_freq=-1 \
    trainer.test_freq=10 \
    trainer.total_epochs=1 "$@"
