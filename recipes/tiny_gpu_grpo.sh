#!/usr/bin/env bash
# Tiny GRPO with TLT on one GPU: the tiny CPU recipe's task, model and batch (16 prompts x 4
# responses), moved to one NVIDIA GPU shared by the one trainer rank and the one vLLM replica.
# bench/gpu_check.py runs it for 3 steps through `./tlt run --recipe tiny_gpu_grpo --steps 3`;
# not run on a GPU yet (none was lent to this project).
#   MODEL=... TRAIN=... VAL=... bash recipes/tiny_gpu_grpo.sh [hydra overrides]
# Choices:
#   - rollout.name=tlt_vllm with TP 1: the replica shares the rank's GPU, sleeps (vLLM level 1)
#     while the actor trains and wakes for the next rollout; gpu_memory_utilization 0.4 leaves
#     the actor room while it is awake;
#   - verl's GPU defaults otherwise (bf16 rollout, FSDP2 mixed precision, CUDA graphs); ATTN is
#     the actor's attention, flash_attention_2 unless flash-attn is not installed (ATTN=sdpa);
#   - one replica: TLT's Spot trainer only trains the drafter on replicas that drained while
#     another still generates, so here the drafter is served, pushed and measured but not
#     trained in the rollout; harvesting needs two replicas or more;
#   - the CPU recipe's replay buffer polled every 0.1 s (tlt_verl/launch/sampler.py), not 2 s;
#   - TLT on (+tlt.enable=true, drafter from scratch); an override of the same key given on the
#     command line (as `./tlt run` passes them, or +tlt.enable=false) replaces the recipe's.
set -euo pipefail
: "${MODEL:?path of the HF model dir}" "${TRAIN:?train parquet}" "${VAL:?val parquet}"
: "${STEPS:=3}" "${DRAFTER:=scratch}" "${ATTN:=flash_attention_2}"
: "${REWARD_FN:=$(python -c 'import tlt_verl.task.reward as r; print(r.__file__)')}"

# Hydra refuses to add one key twice, so the recipe's TLT switch steps aside for the caller's.
tlt=()
for own in "+tlt.enable=true" "+tlt.drafter.init=$DRAFTER"; do
  key=${own#+}; key=${key%%=*}; given=0
  for arg in "$@"; do arg=${arg#"~"}; arg=${arg#+}; arg=${arg#+}; [[ ${arg%%=*} == "$key" ]] && given=1; done
  ((given)) || tlt+=("$own")
done

exec python -m verl.trainer.main_ppo \
  algorithm.adv_estimator=grpo \
  algorithm.use_kl_in_reward=False \
  algorithm.norm_adv_by_std_in_grpo=False \
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
  +actor_rollout_ref.model.override_config.attn_implementation="$ATTN" \
  actor_rollout_ref.actor.strategy=fsdp2 \
  actor_rollout_ref.actor.optim.lr=5e-5 \
  actor_rollout_ref.actor.optim.lr_warmup_steps=2 \
  actor_rollout_ref.actor.ppo_mini_batch_size=4 \
  actor_rollout_ref.actor.use_dynamic_bsz=True \
  actor_rollout_ref.actor.ppo_max_token_len_per_gpu=8192 \
  actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean \
  actor_rollout_ref.actor.use_kl_loss=False \
  actor_rollout_ref.actor.entropy_coeff=0 \
  actor_rollout_ref.rollout.name=tlt_vllm \
  actor_rollout_ref.rollout.n=4 \
  actor_rollout_ref.rollout.temperature=1.0 \
  actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.4 \
  actor_rollout_ref.rollout.max_num_seqs=64 \
  actor_rollout_ref.rollout.agent.num_workers=2 \
  actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True \
  actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=8192 \
  reward.custom_reward_function.path="$REWARD_FN" \
  reward.custom_reward_function.name=compute_score \
  reward.num_workers=1 \
  trainer.n_gpus_per_node=1 \
  trainer.nnodes=1 \
  trainer.total_training_steps="$STEPS" \
  trainer.total_epochs=100 \
  trainer.val_before_train=False \
  trainer.test_freq=-1 \
  trainer.save_freq=-1 \
  trainer.logger='[console,file]' \
  trainer.project_name=tlt \
  trainer.experiment_name=tiny_gpu_grpo \
  ray_kwargs.ray_init.num_cpus=16 \
  transfer_queue.backend.SimpleStorage.num_data_storage_units=2 \
  trainer.v1.sampler.custom_sampler.path=pkg://tlt_verl.launch.sampler \
  trainer.v1.sampler.custom_sampler.name=FastPollReplayBuffer \
  "${tlt[@]}" \
  "$@"
