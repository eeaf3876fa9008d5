#!/usr/bin/env bash
# Tiny GRPO on CPU: verl's stock trainer, the long-tail arithmetic task, a tiny Qwen2 target,
# two trainer ranks and two vLLM rollout replicas (one per rank, one per core). `./tlt run` fills
# MODEL/TRAIN/VAL with the locally prepared assets; any extra argument is one more Hydra
# override. Choices:
#   - two ranks, not four: on two cores, each rank and each replica is a few processes that
#     import torch and vLLM; four of each took 280 s to start against about 120 s for two;
#   - fp32 end to end (FSDP mixed precision would otherwise compute in bf16): the engine's
#     log-probs then match the actor's to ~1e-5;
#   - micro-batches of <= 2048 tokens: on CPU, sdpa over packed sequences costs O(tokens^2);
#   - the prompt-affinity router keeps a GRPO group on one replica (one prefix-cache entry);
#   - data.shuffle=False: the prepared train split is already ordered so that each batch of 16
#     prompts has the same length mix (one long-tail prompt, a few mid, many short); the reward
#     curve then follows the policy, not the luck of the draw, and every step has its long tail;
#   - lr 5e-5, four PPO updates per step, advantages not divided by the group's std and each
#     response weighted equally (seq-mean-token-mean): an all-wrong group on a long-tail prompt
#     otherwise turns tiny partial-credit differences into full-size advantages over ~800
#     tokens. Faster settings hurt: lr 1e-4 lowered the reward (0.57 -> 0.44 over 14 steps on
#     a model with an arithmetic slip habit), lr 2e-4 more so. What GRPO removes here is the
#     SFT model's habit of leaving out the answer line (tlt_verl/task/sft.py): reward 0.13 over
#     the first 3 steps -> 0.51 over the last 3;
#   - verl's synchronous replay buffer, polled every 0.1 s (tlt_verl/launch/sampler.py) instead
#     of every 2 s: a step's `gen` was otherwise rounded up to a multiple of 2 s (a 4.0-5.1 s
#     rollout took 6.0 s), for TLT and stock runs alike;
#   - bypass mode takes the engine's log-probs as the old log-probs instead of recomputing
#     them: exact here, since they equal the actor's (tests/test_tlt_e2e.py checks it).
#   MODEL=... TRAIN=... VAL=... bash recipes/tiny_cpu_grpo.sh trainer.total_training_steps=4
set -euo pipefail
: "${MODEL:?path of the HF model dir}" "${TRAIN:?train parquet}" "${VAL:?val parquet}"
: "${STEPS:=14}" "${HERE:=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}" "${REWARD_FN:=$(python -c 'import tlt_verl.task.reward as r; print(r.__file__)')}"

exec python -m verl.trainer.main_ppo \
  algorithm.adv_estimator=grpo \
  algorithm.use_kl_in_reward=False \
  algorithm.norm_adv_by_std_in_grpo=False \
  algorithm.rollout_correction.bypass_mode=True \
  data.train_files="$TRAIN" \
  data.val_files="$VAL" \
  data.train_batch_size=16 \
  data.max_prompt_length=512 \
  data.max_response_length=1024 \
  data.filter_overlong_prompts=True \
  data.dataloader_num_workers=0 \
  data.shuffle=False \
  actor_rollout_ref.model.path="$MODEL" \
  actor_rollout_ref.model.use_remove_padding=True \
  actor_rollout_ref.actor.strategy=fsdp2 \
  actor_rollout_ref.actor.optim.lr=5e-5 \
  actor_rollout_ref.actor.optim.lr_warmup_steps=2 \
  actor_rollout_ref.actor.ppo_mini_batch_size=4 \
  actor_rollout_ref.actor.use_dynamic_bsz=True \
  actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2048 \
  actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean \
  actor_rollout_ref.actor.use_kl_loss=False \
  actor_rollout_ref.actor.entropy_coeff=0 \
  actor_rollout_ref.actor.fsdp_config.dtype=float32 \
  +actor_rollout_ref.actor.fsdp_config.mixed_precision='{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}' \
  actor_rollout_ref.actor.fsdp_config.use_torch_compile=False \
  actor_rollout_ref.rollout.name=vllm \
  actor_rollout_ref.rollout.n=4 \
  actor_rollout_ref.rollout.temperature=1.0 \
  actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
  actor_rollout_ref.rollout.dtype=float32 \
  actor_rollout_ref.rollout.load_format=auto \
  actor_rollout_ref.rollout.max_num_seqs=64 \
  actor_rollout_ref.rollout.agent.num_workers=2 \
  actor_rollout_ref.rollout.router_config_path="$HERE/router_prompt_affinity.yaml" \
  actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True \
  actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=2048 \
  reward.custom_reward_function.path="$REWARD_FN" \
  reward.custom_reward_function.name=compute_score \
  reward.num_workers=1 \
  trainer.n_gpus_per_node=2 \
  trainer.nnodes=1 \
  trainer.total_training_steps="$STEPS" \
  trainer.total_epochs=100 \
  trainer.val_before_train=False \
  trainer.test_freq=-1 \
  trainer.save_freq=-1 \
  trainer.logger='[console,file]' \
  trainer.project_name=tlt \
  trainer.experiment_name=tiny_cpu_grpo \
  ray_kwargs.ray_init.num_cpus=16 \
  transfer_queue.backend.SimpleStorage.num_data_storage_units=2 \
  trainer.v1.sampler.custom_sampler.path=pkg://tlt_verl.launch.sampler \
  trainer.v1.sampler.custom_sampler.name=FastPollReplayBuffer \
  "$@"
