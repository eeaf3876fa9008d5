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
#   - CUDA graphs captured only where each SD arm can run (rollout.custom.tlt_sd);
#   - memory (table below): the peak is the rollout, where vLLM's 0.6 share sits beside the
#     actor's fp32 shards and Adam moments (kept on the GPU: 10.6 GiB, no offload) and the drafter
#     process; it leaves 11.0 GiB. A utilization of 0.65 would leave 7.0 GiB; if vLLM needs a
#     larger KV cache still, offload the actor's optimizer (actor.fsdp_config.optimizer_offload=True)
#     and regenerate the table.
# memory-plan: model=Qwen2.5-7B card=H100-80GB
# >>> memory plan (python -m tlt_verl.launch.memory_plan --write recipes/qwen2.5_7b_grpo_8gpu.sh; tests/test_recipe_memory.py checks it) >>>
# Per GPU, GiB (2^30 B), on an H100 80GB: 79.10 GiB as CUDA reports it (docs/memory.md: where each term comes from).
# Qwen2.5-7B: 7.616B params (embedding 0.545B + LM head 0.545B + 28 layers x 0.2331B).
# FSDP2 over 8 GPUs (1 node x 8); vLLM TP 2 (4 replicas), sleep level 2 while the actor trains.
#
#                                                    training  rollout
# actor params, fp32, 1/8 shard                          3.55     3.55  param_offload=False
# actor grads, fp32, 1/8 shard                           3.55        -  set to None when the update ends
# actor Adam moments, fp32, 1/8 shard                    7.09     7.09  optimizer_offload=False
# actor activations, largest pass: old log-prob         26.17        -  24576 tokens: logits, softmax, product 20.88 (update: 23.61)
# vLLM                                                   2.00    47.46  0.6 x 79.10; asleep: CUDA graphs + NCCL stay
#   weights, bf16 1/2 TP shard + drafter                    -     7.33
#   KV cache: 1,301,273 tokens                              -    35.99  29,696 B/token = 2 x 29 layers x 2 KV heads/GPU x 128 x bf16
#   activations (8192 tokens), graphs, NCCL                 -     4.14  graphs 1.50 + NCCL 0.50 assumed
# drafter process (eagle, every rank)                    7.75     7.75  reserved in both phases
#   target embedding + LM head, bf16 x 1                 2.03     2.03  one shared segment, rewritten in place at a sync
#   weights + grads + AdamW, fp32 (259M params)          3.86     3.86
#   training, 4096 tokens/micro-batch                    1.86     1.86
# CUDA contexts, 3 processes                             2.25     2.25  0.75 each assumed: actor, vLLM worker, drafter
# total                                                 52.36    68.10
# headroom                                              26.74    11.00  required >= 4.00
#
# Peak: rollout, 68.10 of 79.10 GiB; headroom 11.00 GiB (required >= 4.00).
# KV cache: 74 sequences of the longest (17408 tokens) at once; all max_num_seqs=256 while their mean length is <= 5,083.
# Host RAM per node (not in the table): ref params 28.37, drafter buffers 2.00 GiB.
# An EAGLE-3 drafter (DRAFTER naming one) adds 13.09 GiB at the peak: it does not fit; headroom below 4.00 GiB.
# Overrides appended when the recipe is run ("$@") are not in this table.
# <<< memory plan <<<
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
