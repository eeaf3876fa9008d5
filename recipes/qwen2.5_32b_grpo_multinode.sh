#!/usr/bin/env bash
# Qwen2.5-32B GRPO across NNODES 8-GPU nodes (default 4) with the vLLM rollout and TLT. Start the
# Ray cluster first (docker/launch.sh head / worker), then run this on the head node:
#   docker/launch.sh submit --address HEAD:6379 --nodes 4 -- bash recipes/qwen2.5_32b_grpo_multinode.sh
# with MODEL / TRAIN / VAL / DRAFTER set as for recipes/qwen2.5_7b_grpo_8gpu.sh. Not run here (no
# GPU was lent to this project yet).
# Choices:
#   - FSDP2 with parameter and optimizer offload: 32B of bf16 weights plus Adam state do not fit
#     next to a sleeping vLLM engine otherwise;
#   - TP 8: one replica per node, so a node whose replica drained trains the drafter on its own
#     eight ranks, data-parallel with the other drained nodes (over Gloo: a drained subset);
#   - the drafter's buffer is bounded per rank and spills nothing: at 5120 hidden x bf16 a 16k
#     response is 160 MiB of hidden states.
set -euo pipefail
: "${MODEL:?path of the HF model dir}" "${TRAIN:?train parquet}" "${VAL:?val parquet}"
: "${DRAFTER:=scratch}" "${STEPS:=200}" "${NNODES:=4}"

exec python -m verl.trainer.main_ppo \
  algorithm.adv_estimator=grpo \
  algorithm.use_kl_in_reward=False \
  data.train_files="$TRAIN" \
  data.val_files="$VAL" \
  data.train_batch_size=512 \
  data.max_prompt_length=1024 \
  data.max_response_length=20480 \
  data.filter_overlong_prompts=True \
  actor_rollout_ref.model.path="$MODEL" \
  actor_rollout_ref.model.use_remove_padding=True \
  actor_rollout_ref.model.enable_gradient_checkpointing=True \
  actor_rollout_ref.actor.strategy=fsdp2 \
  actor_rollout_ref.actor.fsdp_config.param_offload=True \
  actor_rollout_ref.actor.fsdp_config.optimizer_offload=True \
  actor_rollout_ref.actor.optim.lr=1e-6 \
  actor_rollout_ref.actor.ppo_mini_batch_size=128 \
  actor_rollout_ref.actor.use_dynamic_bsz=True \
  actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384 \
  actor_rollout_ref.actor.use_kl_loss=True \
  actor_rollout_ref.actor.kl_loss_coef=0.001 \
  actor_rollout_ref.actor.entropy_coeff=0 \
  actor_rollout_ref.rollout.name=tlt_vllm \
  actor_rollout_ref.rollout.n=8 \
  actor_rollout_ref.rollout.temperature=1.0 \
  actor_rollout_ref.rollout.tensor_model_parallel_size=8 \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
  actor_rollout_ref.rollout.max_num_seqs=256 \
  actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True \
  actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=16384 \
  actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True \
  actor_rollout_ref.ref.fsdp_config.param_offload=True \
  trainer.n_gpus_per_node=8 \
  trainer.nnodes="$NNODES" \
  trainer.total_training_steps="$STEPS" \
  trainer.save_freq=10 \
  trainer.test_freq=-1 \
  trainer.logger='[console,file]' \
  trainer.project_name=tlt \
  trainer.experiment_name=qwen2.5_32b_grpo_tlt \
  +tlt.enable=true \
  +tlt.drafter.init="$DRAFTER" \
  +tlt.drafter.buffer.budget_bytes=8589934592 \
  +tlt.sd.threshold=32 \
  "$@"
