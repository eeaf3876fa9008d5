"""DrafterTrainer: trains a drafter on DataBuffer samples, preemptibly, on one or many ranks.

One optimizer step = ``grad_accum`` micro-steps (forward + backward of one packed micro-batch)
then one AdamW step. The step's gradient is the mean, over ranks and micro-steps, of each
micro-batch's token-mean loss gradient. Gradients are summed unscaled (autograd accumulation,
then one all-reduce SUM) and divided once: with two ranks this is bit-for-bit what one process
computes accumulating the same two micro-batches, which is what makes data parallel testable.

Preemption is cooperative: the stop signal is checked before every micro-step. A stop in the
middle of an accumulation discards the partial gradients and rewinds the data cursor to the
step's start, so weights, optimizer state, schedule and cursor always describe a completed
step (the optimizer step itself is never interrupted). Under torch.distributed the ranks agree
on stopping (an all-reduce MAX of the flag), since one rank leaving alone would hang the others
in the gradient all-reduce.
"""
from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from .config import DrafterConfig, LossConfig
from .loss import drafter_loss
from .packing import pack


@dataclass(frozen=True)
class TrainerConfig:
    lr: float = 3e-4
    min_lr_ratio: float = 0.1          # cosine floor, as a fraction of lr
    warmup_steps: int = 20
    total_steps: int = 2000            # cosine horizon; lr stays at the floor after it
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0             # max global grad norm; 0 disables clipping
    grad_accum: int = 1
    tokens_per_micro: int = 4096       # training slots per micro-batch
    row_len: int = 2048                # packed row length (longer samples are cut)
    recency_decay: float = 0.5         # DataBuffer.sample_batches: weight per RL step of age
    max_age_steps: int | None = None
    seed: int = 0
    loss: LossConfig = field(default_factory=LossConfig)

    def __post_init__(self):
        def need(cond: bool, msg: str):
            if not cond:
                raise ValueError(f"TrainerConfig.{msg}")

        need(self.lr > 0, f"lr={self.lr}: must be > 0")
        need(0 <= self.min_lr_ratio <= 1, f"min_lr_ratio={self.min_lr_ratio}: must be in [0, 1]")
        need(self.warmup_steps >= 0, f"warmup_steps={self.warmup_steps}: must be >= 0")
        need(self.total_steps >= 1, f"total_steps={self.total_steps}: must be >= 1")
        need(self.weight_decay >= 0, f"weight_decay={self.weight_decay}: must be >= 0")
        need(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, f"beta1/beta2={self.beta1}/{self.beta2}: must be in [0, 1)")
        need(self.grad_clip >= 0, f"grad_clip={self.grad_clip}: must be >= 0")
        for name in ("grad_accum", "tokens_per_micro", "row_len"):
            need(getattr(self, name) >= 1, f"{name}={getattr(self, name)}: must be >= 1")
        need(0 <= self.recency_decay <= 1, f"recency_decay={self.recency_decay}: must be in [0, 1]")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainerConfig":
        return cls(**{**d, "loss": LossConfig(**d["loss"])})


def lr_at(cfg: TrainerConfig, step: int) -> float:
    """Linear warm-up over ``warmup_steps`` then cosine decay to ``min_lr_ratio * lr``;
    ``step`` counts completed optimizer steps (the lr of the step about to run)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.min_lr_ratio * cfg.lr
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass
class TrainResult:
    steps: int                  # optimizer steps completed by this call
    stopped: bool               # True: the stop signal ended it (else max_steps did)
    micro_steps: int            # micro-steps run, including discarded ones
    discarded_micro_steps: int  # of an accumulation cut short by the stop signal
    seconds: float
    history: list[dict]


StopSignal = threading.Event | Callable[[], bool] | None


def _stop_fn(stop: StopSignal) -> Callable[[], bool]:
    if stop is None:
        return lambda: False
    if isinstance(stop, threading.Event):
        return stop.is_set
    return stop


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class DrafterTrainer:
    def __init__(self, drafter: torch.nn.Module, buffer, cfg: TrainerConfig | None = None):
        """``buffer``: a ``DataBuffer`` (anything with its ``sample_batches``)."""
        self.drafter = drafter
        self.buffer = buffer
        self.cfg = cfg or TrainerConfig()
        self.params = drafter.trainable_parameters()
        if not self.params:
            raise ValueError("DrafterTrainer: the drafter has no trainable parameters")
        # Frozen target tensors are buffers, not parameters, so they can never get here.
        self.optimizer = torch.optim.AdamW(self.params, lr=lr_at(self.cfg, 0), betas=(self.cfg.beta1, self.cfg.beta2),
                                           weight_decay=self.cfg.weight_decay)
        self.step = 0
        self.cursor: dict = {}        # data cursor after the last completed step

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """Everything a resume needs besides the buffer's contents (tensors are live references:
        ``checkpoint.snapshot`` copies them)."""
        return {
            "drafter": self.drafter.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "schedule": {"kind": "warmup_cosine", "step": self.step, "lr": lr_at(self.cfg, self.step)},
            "cursor": dict(self.cursor),
            "trainer_config": self.cfg.to_dict(),
            "drafter_config": asdict(self.drafter.cfg),
        }

    def load_state_dict(self, state: dict) -> None:
        d = state["drafter_config"]
        saved = DrafterConfig(**{**d, "aux_layer_ids": tuple(d["aux_layer_ids"])})
        if saved != self.drafter.cfg:
            diff = [k for k in d if getattr(saved, k) != getattr(self.drafter.cfg, k)]
            raise ValueError(f"checkpoint drafter config differs from this drafter's in {', '.join(diff)}")
        self.drafter.load_state_dict(state["drafter"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        self.cursor = dict(state["cursor"])

    # ------------------------------------------------------------------ training

    def _batches(self):
        c = self.cfg
        return self.buffer.sample_batches(c.tokens_per_micro, seed=c.seed, recency_decay=c.recency_decay,
                                          max_age_steps=c.max_age_steps, cursor=self.cursor or None)

    def _stop_agreed(self, stop: Callable[[], bool]) -> bool:
        flag = bool(stop())
        if _distributed():
            t = torch.tensor([1 if flag else 0], dtype=torch.int32)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            flag = bool(t.item())
        return flag

    def _micro_step(self, samples) -> dict:
        c = self.cfg
        cut = min(c.row_len, c.tokens_per_micro) + 1
        batch = pack([s.truncated(cut).aligned() for s in samples], c.row_len)
        device = next(self.drafter.parameters()).device
        if device.type != "cpu":
            batch.tensors = {k: v.to(device, non_blocking=True) for k, v in batch.tensors.items()}
            batch.position_ids, batch.seq_ids = batch.position_ids.to(device), batch.seq_ids.to(device)
        loss, metrics = drafter_loss(self.drafter, batch, c.loss)
        loss.backward()
        metrics["samples"] = len(samples)
        return metrics

    def _reduce_and_scale(self, micro_steps: int) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        world = 1
        if _distributed():
            world = dist.get_world_size()
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            at = 0
            for p, g in zip(self.params, grads):
                n = g.numel()
                p.grad = flat[at: at + n].view_as(p).clone()
                at += n
        else:
            for p, g in zip(self.params, grads):
                p.grad = g
        for p in self.params:
            p.grad.div_(micro_steps * world)

    def train(self, stop: StopSignal = None, max_steps: int | None = None,
              on_step: Callable[[int, dict], None] | None = None) -> TrainResult:
        """Train until ``stop`` (an Event or a callable returning True) or ``max_steps`` more
        optimizer steps. ``on_step(step, metrics)`` runs after each completed step."""
        should_stop = _stop_fn(stop)
        self.drafter.train()
        start = time.perf_counter()
        done = micro = discarded = 0
        history: list[dict] = []
        batches = self._batches()
        stopped = False
        while max_steps is None or done < max_steps:
            self.optimizer.zero_grad(set_to_none=True)
            step_metrics, cursor, t0 = [], self.cursor, time.perf_counter()
            for _ in range(self.cfg.grad_accum):
                if self._stop_agreed(should_stop):
                    stopped = True
                    break
                samples, cursor = next(batches)
                step_metrics.append(self._micro_step(samples))
                micro += 1
            if stopped:
                # Partial accumulation: drop it; the cursor stays at this step's start.
                discarded += len(step_metrics)
                self.optimizer.zero_grad(set_to_none=True)
                break
            self._reduce_and_scale(self.cfg.grad_accum)
            norm = (torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
                    if self.cfg.grad_clip > 0 else torch.nan)
            lr = lr_at(self.cfg, self.step)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            self.step += 1
            self.cursor = cursor
            done += 1
            metrics = {
                "step": self.step, "lr": lr, "grad_norm": float(norm),
                "loss": sum(m["loss"] for m in step_metrics) / len(step_metrics),
                "samples": sum(m["samples"] for m in step_metrics),
                "step_s": time.perf_counter() - t0,
            }
            for key in step_metrics[0]:
                if key not in metrics and key != "tokens":
                    metrics[key] = sum(m[key] for m in step_metrics) / len(step_metrics)
            if "tokens" in step_metrics[0]:
                metrics["tokens"] = sum(m["tokens"] for m in step_metrics)
            history.append(metrics)
            if on_step is not None:
                on_step(self.step, metrics)
        self.optimizer.zero_grad(set_to_none=True)
        return TrainResult(done, stopped, micro, discarded, time.perf_counter() - start, history)
