#!/usr/bin/env bash
# Qwen2.5-32B GRPO across NNODES 8-GPU nodes (default 4) with the vLLM rollout and TLT. Start the
# Ray cluster first (docker/launch.sh head / worker), then run this on the head node:
#   docker/launch.sh submit --address HEAD:6379 --nodes 4 -- bash recipes/qwen2.5_32b_grpo_multinode.sh
# with MODEL / TRAIN / VAL / DRAFTER set as for recipes/qwen2.5_7b_grpo_8gpu.sh. Not run here (no
# GPU was lent to this project yet).
# Choices:
#   - FSDP2 with parameter and optimizer offload: without them the actor's fp32 shards and Adam
#     moments (11.4 GiB per GPU over 32 GPUs) stay on the GPU through the rollout, next to vLLM's
#     0.6 share and the drafter, and the rollout phase comes to 75.1 of 79.1 GiB: the 4 GiB
#     headroom and no more, for estimates that have not met a GPU (table below);
#   - Ulysses sequence parallelism 2 (actor and ref): a 1k prompt + 20k response is 21504 tokens,
#     more than a 16384-token micro-batch holds, and verl asserts every micro-batch budget holds the
#     longest sequence. SP 2 splits each micro-batch over two GPUs, 16384 tokens per GPU and 32768
#     per micro-batch. Raising the budgets to 21504 tokens per GPU with SP 1 also fits now that the
#     drafter holds the target's embedding and LM head once, in bf16 (training phase 66.6 of 79.1
#     GiB, against 60.7 with SP 2);
#   - the memory table below is for NNODES=4: the actor's shards grow as the nodes shrink, and
#     below 3 nodes the training phase no longer fits;
#   - TP 8: one replica per node, so a node whose replica drained trains the drafter on its own
#     eight ranks, data-parallel with the other drained nodes (over Gloo: a drained subset);
#   - the drafter's buffer is bounded per rank and spills nothing: at 5120 hidden x bf16 a 16k
#     response is 160 MiB of hidden states.
# memory-plan: model=Qwen2.5-32B card=H100-80GB
# >>> memory plan (python -m tlt_verl.launch.memory_plan --write recipes/qwen2.5_32b_grpo_multinode.sh; tests/test_recipe_memory.py checks it) >>>
# Per GPU, GiB (2^30 B), on an H100 80GB: 79.10 GiB as CUDA reports it (docs/memory.md: where each term comes from).
# Qwen2.5-32B: 32.764B params (embedding 0.779B + LM head 0.779B + 64 layers x 0.4876B).
# FSDP2 over 32 GPUs (4 nodes x 8), Ulysses SP 2; vLLM TP 8 (4 replicas), sleep level 2 while the actor trains.
#
#                                                    training  rollout
# actor params, fp32, 1/32 shard                         3.81        -  param_offload=True
# actor grads, fp32, 1/32 shard                          3.81        -  set to None when the update ends
# actor Adam moments, fp32, 1/32 shard                   7.63        -  optimizer_offload=True
# actor activations, largest pass: update               27.21        -  layer inputs 10.00 + max(LM head 16.90, layer 11.60) + capture 0.31
# vLLM                                                   2.00    47.46  0.6 x 79.10; asleep: CUDA graphs + NCCL stay
#   weights, bf16 1/8 TP shard + drafter                    -     7.75
#   KV cache: 1,163,477 tokens                              -    36.06  33,280 B/token = 2 x 65 layers x 1 KV heads/GPU x 128 x bf16
#   activations (8192 tokens), graphs, NCCL                 -     3.64  graphs 1.50 + NCCL 0.50 assumed
# drafter process (eagle, every rank)                   13.94    13.94  reserved in both phases
#   target embedding + LM head, bf16 x 1                 2.90     2.90  one shared segment, rewritten in place at a sync
#   weights + grads + AdamW, fp32 (540M params)          8.05     8.05
#   training, 4096 tokens/micro-batch                    2.99     2.99
# CUDA contexts, 3 processes                             2.25     2.25  0.75 each assumed: actor, vLLM worker, drafter
# total                                                 60.66    63.65
# headroom                                              18.44    15.45  required >= 4.00
#
# Peak: rollout, 63.65 of 79.10 GiB; headroom 15.45 GiB (required >= 4.00).
# KV cache: 54 sequences of the longest (21504 tokens) at once; all max_num_seqs=256 while their mean length is <= 4,544.
# Host RAM per node (not in the table): actor params 30.51, actor Adam 61.03, ref params 30.51, drafter buffers 64.00 GiB.
# An EAGLE-3 drafter (DRAFTER naming one) adds 19.13 GiB at the peak: it does not fit; headroom below 4.00 GiB.
# With trainer.nnodes < 3 this does not fit.
# Overrides appended when the recipe is run ("$@") are not in this table.
# <<< memory plan <<<
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
  actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=2 \
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
  actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size=2 \
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
