#!/usr/bin/env bash
# Qwen2.5-7B GRPO on one 8-GPU node with the vLLM rollout and TLT: a stock verl recipe plus the
# TLT overrides at the end. Not run here (no GPU was lent to this project yet); the TLT parts
# are the ones the tiny CPU recipe exercises, and the GPU-only ones are marked in README.md.
#   MODEL=/models/Qwen2.5-7B-Instruct TRAIN=train.parquet VAL=val.parquet \
#   DRAFTER=/drafters/qwen2.5-7b-eagle bash recipes/qwen2.5_7b_grpo_8gpu.sh
# DRAFTER: an exported EAGLE drafter folder (`tlt-verl drafter warmup`), or "scratch".
# Choices:
#   - rollout.name=tlt_vllm: TLT's rollout server (drafter, adaptive SD policy, drafter push).
#     On GPU it shares the trainer ranks' devices and sleeps while the actor trains;
#   - TP 2: four replicas of two GPUs, so the long tail leaves whole replicas drained for the
#     drafter while the others still generate;
#   - max_num_seqs 256 and the SD threshold at 32: the policy turns SD on once a replica's running
#     batch is down to 32 (tune with bench/sd_threshold.py on the target GPU);
#   - CUDA graphs captured only where each SD arm can run (rollout.custom.tlt_sd).
set -euo pipefail
: "${MODEL:?path of the HF model dir}" "${TRAIN:?train parquet}" "${VAL:?val parquet}"
: "${DRAFTER:=scratch}" "${STEPS:=200}"

exec python -m verl.trainer.main_ppo \
  algorithm.adv_estimator=grpo \
  algorithm.use_kl_in_reward=False \
  data.train_files="$TRAIN" \
  data.val_files="$VAL" \
  data.train_batch_size=256 \
  data.max_prompt_length=1024 \
  data.max_response_length=16384 \
  data.filter_overlong_prompts=True \
  actor_rollout_ref.model.path="$MODEL" \
  actor_rollout_ref.model.use_remove_padding=True \
  actor_rollout_ref.model.enable_gradient_checkpointing=True \
  actor_rollout_ref.actor.strategy=fsdp2 \
  actor_rollout_ref.actor.optim.lr=1e-6 \
  actor_rollout_ref.actor.ppo_mini_batch_size=64 \
  actor_rollout_ref.actor.use_dynamic_bsz=True \
  actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24576 \
  actor_rollout_ref.actor.use_kl_loss=True \
  actor_rollout_ref.actor.kl_loss_coef=0.001 \
  actor_rollout_ref.actor.entropy_coeff=0 \
  actor_rollout_ref.rollout.name=tlt_vllm \
  actor_rollout_ref.rollout.n=8 \
  actor_rollout_ref.rollout.temperature=1.0 \
  actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
  actor_rollout_ref.rollout.max_num_seqs=256 \
  actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True \
  actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=24576 \
  actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True \
  trainer.n_gpus_per_node=8 \
  trainer.nnodes=1 \
  trainer.total_training_steps="$STEPS" \
  trainer.save_freq=20 \
  trainer.test_freq=-1 \
  trainer.logger='[console,file]' \
  trainer.project_name=tlt \
  trainer.experiment_name=qwen2.5_7b_grpo_tlt \
  +tlt.enable=true \
  +tlt.drafter.init="$DRAFTER" \
  +tlt.sd.threshold=32 \
  +tlt.sd.bandit.bucket_edges='[1,2,4,8,16]' \
  +tlt.sd.bandit.arms='[0,2,3,4]' \
  "$@"
