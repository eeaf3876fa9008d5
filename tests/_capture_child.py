"""Child process of tests/test_verl_capture.py: verl's real actor worker on one CPU rank.

Builds ``ActorRolloutRefWorker(role="actor")`` (FSDP2 over gloo, world size 1, gradient
checkpointing on as in verl's recipes) the way verl's trainer configures it, runs ``update_actor``
on rollout batches laid out as trainer v1 and v0 hand them over, with capture off and on, and saves
what came out (training metrics, the weights before each optimizer step and after the last, buffer
samples, hook counts) for the test to check against a direct HF forward of the weights each
sample's forward ran with. The v1 updates run the recipe's layout (recipes/tiny_cpu_grpo.sh: one
epoch of several mini-batches, so every mini-batch after the first runs weights the ones before
it moved) at a learning rate whose single step moves the states past the bf16 tolerance; the v0
update runs two epochs of one mini-batch (only the first is captured). A child, because the worker
leaves a torch.distributed process group behind.

    python tests/_capture_child.py MODEL_DIR OUT_FILE
"""
from __future__ import annotations

import os
import socket
import sys
import time

import numpy as np
import torch

# (prompt, response) lengths, and response positions the policy did not generate (a tool reply):
# unequal lengths, so the packed forward has ragged rows and the budget below splits it.
SAMPLES = [(3, 9, (1, 2)), (7, 4, ()), (5, 12, (4, 5, 6)), (2, 6, ()), (6, 1, ()), (4, 8, (7,))]
STEPS_V1 = [7, 7, 8, 7, 8, 7]          # v1: the dataloader step of each sample
VERSIONS_V0 = [4, 4, 4, 4, 4, 4]       # v0: the weights version each response was sampled with
PAD = 64
# The recipe's layout: one epoch, several mini-batches (its 4 of 8 samples a rank; here 3 of 2).
MINI_BATCH = 2
# One AdamW step at verl's default (1e-6) or the recipe's (5e-5) moves this model's states by
# less than the bf16 storage tolerance the test compares at: a capture of the wrong weights
# (after the update instead of during it) would pass. At 1e-3 one step moves them well past it.
LR = 1e-3


def _env():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), VERL_PLATFORM="cpu")
    torch.set_num_threads(1)


def build_worker(model_dir: str, remove_padding: bool):
    import verl
    from hydra import compose, initialize_config_dir

    from verl.workers.engine_workers import ActorRolloutRefWorker

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=[
            f"actor_rollout_ref.model.path={model_dir}",
            f"actor_rollout_ref.model.use_remove_padding={remove_padding}",
            "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
            "actor_rollout_ref.actor.strategy=fsdp2",
            # fp32 compute: what is left between the engine and HF is the buffer's bf16 storage.
            "actor_rollout_ref.actor.fsdp_config.dtype=float32",
            "+actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
            "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
            "actor_rollout_ref.model.enable_gradient_checkpointing=True",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            f"actor_rollout_ref.actor.optim.lr={LR}",
            "actor_rollout_ref.actor.use_dynamic_bsz=True",
            # 20 tokens a micro-batch: most mini-batches of 2 samples take two forwards, and the
            # single mini-batch of all 6 (67 tokens) at least four.
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=20",
            "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=27",
            "actor_rollout_ref.rollout.name=vllm",
            "trainer.n_gpus_per_node=1",
        ])
    worker = ActorRolloutRefWorker(cfg.actor_rollout_ref, role="actor")
    worker.init_model()
    return worker


def sequences():
    g = torch.Generator().manual_seed(0)
    out = []
    for p, r, holes in SAMPLES:
        prompt = torch.randint(0, PAD, (p,), generator=g)
        response = torch.randint(0, PAD, (r,), generator=g)
        mask = torch.ones(r, dtype=torch.int64)
        mask[list(holes)] = 0
        out.append((prompt, response, mask))
    return out


def batch_v1(seqs):
    """As trainer v1's agent loop stores samples (agent_loop_tq) and the worker reads them back."""
    from verl.utils import tensordict_utils as tu

    fields = [dict(prompts=p, responses=r, response_mask=m, loss_mask=m, input_ids=torch.cat([p, r]),
                   position_ids=torch.arange(len(p) + len(r)), global_steps=step)
              for (p, r, m), step in zip(seqs, STEPS_V1)]
    td = tu.list_of_dict_to_tensordict(fields)
    tu.assign_non_tensor(td, calculate_entropy=True, compute_loss=False, temperature=1.0)
    return td


def batch_v0(seqs, update: bool = False):
    """As trainer v0 hands a rollout batch over: DataProto (left-padded prompts, right-padded
    responses), to_tensordict, left_right_2_no_padding; ``update``: with the advantages and old
    log-probs an update needs, padded as the responses are."""
    from verl import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    P, R, B = max(len(s[0]) for s in seqs), max(len(s[1]) for s in seqs), len(seqs)
    prompts = torch.full((B, P), PAD)
    responses = torch.full((B, R), PAD)
    attention = torch.zeros(B, P + R, dtype=torch.int64)
    response_mask = torch.zeros(B, R, dtype=torch.int64)
    for i, (p, r, m) in enumerate(seqs):
        prompts[i, P - len(p):] = p
        responses[i, : len(r)] = r
        attention[i, P - len(p): P + len(r)] = 1
        response_mask[i, : len(r)] = m
    position_ids = (attention.cumsum(-1) - 1).clamp_min(0)
    extra = {key: torch.full((B, R), value) for key, value in UPDATE_FIELDS} if update else {}
    proto = DataProto.from_dict(
        tensors=dict(prompts=prompts, responses=responses, input_ids=torch.cat([prompts, responses], 1),
                     attention_mask=attention, response_mask=response_mask, position_ids=position_ids, **extra),
        non_tensors={"max_global_steps": np.array(VERSIONS_V0, dtype=object)},
        meta_info={"temperature": 1.0})
    td = left_right_2_no_padding(proto.to_tensordict())
    tu.assign_non_tensor(td, calculate_entropy=True, compute_loss=False)
    return td


class HookCounter:
    """Counts the hooks on every module of the actor while its decoder runs, and between passes."""

    def __init__(self, model):
        from tlt_verl.capture.hooks import find_decoder

        self.model = model
        self.during: list[int] = []
        find_decoder(model).register_forward_pre_hook(lambda *_: self.during.append(self.count()))
        self.stock = self.count()

    def count(self) -> int:
        return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in self.model.modules())


def samples(buffer):
    return [{"input_ids": s.input_ids, "loss_mask": s.loss_mask, "final": s.final_hidden, "aux": s.aux_hidden,
             "step": s.step} for s in (buffer.get(i) for i in buffer.ids())]


UPDATE_FIELDS = (("old_log_probs", -1.0), ("advantages", 0.5))


def for_update(td, seqs, epochs: int = 1, mini_batch: int = MINI_BATCH):
    """A rollout batch as update_actor takes it: advantages and old log-probs added (unless the
    layout added them), mini-batches of ``mini_batch`` samples in order, ``epochs`` passes."""
    from verl.utils import tensordict_utils as tu

    for key, value in UPDATE_FIELDS:
        if key not in td.keys():
            td[key] = torch.nested.as_nested_tensor([torch.full((len(r),), value) for _, r, _ in seqs],
                                                    layout=torch.jagged)
    tu.assign_non_tensor(td, compute_loss=True, calculate_entropy=False, global_batch_size=len(seqs),
                         mini_batch_size=mini_batch, epochs=epochs, seed=0, dataloader_kwargs={"shuffle": False})
    return td


def full_weights(module) -> dict:
    # Full tensors: FSDP2's shards (DTensors) need a process group to be read back.
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in module.state_dict().items()}


def main(model_dir: str, out_file: str):
    _env()
    import verl.workers.engine_workers as ew
    from verl.utils import tensordict_utils as tu

    from tlt_verl.capture import BufferConfig, verl_capture
    from tlt_verl.drafter.config import default_aux_layer_ids

    seqs = sequences()
    res = {"sequences": seqs, "steps_v1": STEPS_V1, "versions_v0": VERSIONS_V0,
           "patched": bool(getattr(ew.ActorRolloutRefWorker.update_actor, "_tlt_capture", False))}

    def update(worker, td):
        module = worker.actor.engine.module
        # The weights each mini-batch's forwards ran: those before each optimizer step.
        before = []
        handle = worker.actor.engine.optimizer.register_step_pre_hook(
            lambda *_: before.append(full_weights(module)))
        try:
            metrics = tu.get(worker.update_actor(td), "metrics")
        finally:
            handle.remove()
        return {"grad_norm": metrics["grad_norm"], "weights": full_weights(module), "before_step": before}

    def hook_count(worker):
        return HookCounter(worker.actor.engine.module)

    # Capture off: the stock update, and the hooks it runs with.
    worker = build_worker(model_dir, remove_padding=True)
    res["aux_layer_ids"] = aux = default_aux_layer_ids(worker.actor.engine.module.config.num_hidden_layers)
    hooks = hook_count(worker)
    res["hooks_stock"] = hooks.stock
    res["off"] = update(worker, for_update(batch_v1(seqs), seqs))
    res["hooks_off"] = hooks.during

    # Capture on, a fresh worker from the same weights: the same update, and its samples. The
    # log-prob pass of the same engine is not captured.
    worker = build_worker(model_dir, remove_padding=True)
    hooks = hook_count(worker)
    buf = verl_capture.enable("eagle3", aux, BufferConfig(kind="eagle3", dtype="bfloat16"))
    t0 = time.perf_counter()
    res["on"] = update(worker, for_update(batch_v1(seqs), seqs))
    res["on_s"] = time.perf_counter() - t0
    res["hooks_on"], hooks.during = hooks.during, []
    res["hooks_after_on"] = hooks.count()
    res["v1"] = samples(buf)
    res["stats"] = vars(verl_capture.stats()).copy()
    worker.compute_log_prob(batch_v1(seqs))
    res["after_log_prob_pass"] = len(buf)
    res["disabled_returns_buffer"] = verl_capture.disable() is buf
    hooks.during = []
    update(worker, for_update(batch_v1(seqs), seqs))
    res["hooks_off_again"] = hooks.during
    res["hooks_after_off"] = hooks.count()

    # Two epochs of one mini-batch: the first epoch's forwards run the weights the rollout sampled
    # with, the second's those the first moved; only the first is captured.
    worker = build_worker(model_dir, remove_padding=True)
    hooks = hook_count(worker)
    buf = verl_capture.enable("eagle", (), BufferConfig(kind="eagle", dtype="bfloat16"))
    res["v0_update"] = update(worker, for_update(batch_v0(seqs, update=True), seqs, epochs=2, mini_batch=len(seqs)))
    res["hooks_v0"] = hooks.during
    res["v0"] = samples(buf)

    padded = build_worker(model_dir, remove_padding=False)
    buf = verl_capture.enable("eagle3", aux, BufferConfig(kind="eagle3", dtype="bfloat16"))
    res["padded_update"] = update(padded, for_update(batch_v1(seqs), seqs))
    res["padded"] = samples(buf)
    verl_capture.disable()
    torch.save(res, out_file)


if __name__ == "__main__":
    main(*sys.argv[1:3])
