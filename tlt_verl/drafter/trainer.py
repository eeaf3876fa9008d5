"""DrafterTrainer: trains a drafter on DataBuffer samples, preemptibly, on one or many ranks.

One optimizer step = ``grad_accum`` micro-steps (forward + backward of one packed micro-batch)
then one AdamW step. The step's gradient is the mean, over ranks and micro-steps, of each
micro-batch's token-mean loss gradient. Gradients are summed unscaled (autograd accumulation,
then one all-reduce SUM) and divided once: with two ranks this is bit-for-bit what one process
computes accumulating the same two micro-batches, which is what makes data parallel testable.

Preemption is cooperative: the stop signal is checked before every micro-step. A stop in the
middle of an accumulation discards the partial gradients and rewinds the data cursor to the
step's start, so weights, optimizer state, schedule and cursor always describe a completed
step (the optimizer step itself is never interrupted).

Collectives go through a ``Reducer`` (``reducer.py``): by default the torch.distributed default
group when one is initialised, else none; a ``SpotSession`` trains on a subset of the ranks.
Before every micro-step the ranks agree, in one all-reduce SUM of two flags, on whether any of
them was told to stop (one rank leaving alone would hang the others in the gradient all-reduce)
and on how many of them have data. A rank whose buffer is still empty runs no micro-step and
adds zero gradients; the step's gradient is divided by the number of micro-steps actually run
across ranks. When no rank has any data at the start of a step, ``train`` returns with
``idle=True`` instead of waiting inside a collective.
"""
from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from .config import DrafterConfig, LossConfig
from .loss import drafter_loss
from .packing import pack
from .reducer import Reducer, default_reducer


PRECISIONS = ("auto", "bf16", "fp32")


def autocast_bf16(precision: str, device: torch.device) -> bool:
    return precision == "bf16" or (precision == "auto" and device.type == "cuda")


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
    # "auto": bf16 autocast on CUDA, fp32 on CPU; "bf16" / "fp32" force one (bf16 runs on CPU too).
    precision: str = "auto"
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
        need(self.precision in PRECISIONS, f"precision={self.precision!r}: must be one of {', '.join(PRECISIONS)}")

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
    idle: bool = False          # True: it ended because no rank had data at the start of a step


StopSignal = threading.Event | Callable[[], bool] | None


def _stop_fn(stop: StopSignal) -> Callable[[], bool]:
    if stop is None:
        return lambda: False
    if isinstance(stop, threading.Event):
        return stop.is_set
    return stop


class DrafterTrainer:
    def __init__(self, drafter: torch.nn.Module, buffer, cfg: TrainerConfig | None = None,
                 reducer: Reducer | None = None):
        """``buffer``: a ``DataBuffer`` (anything with its ``sample_batches``; one without
        ``__len__`` is taken to always hold data). ``reducer``: the ranks training together;
        ``None`` picks ``default_reducer()`` at each ``train`` call. It may be replaced between
        calls (a new session)."""
        self.drafter = drafter
        self.buffer = buffer
        self.cfg = cfg or TrainerConfig()
        self.reducer = reducer
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

    def _has_data(self) -> bool:
        return len(self.buffer) > 0 if hasattr(self.buffer, "__len__") else True

    @staticmethod
    def _agree(reducer: Reducer, stop: Callable[[], bool], has_data: bool) -> tuple[bool, int]:
        """(any rank stops, how many ranks have data); one collective for both."""
        flags = torch.tensor([1 if stop() else 0, 1 if has_data else 0], dtype=torch.int32)
        if reducer.size > 1:
            reducer.all_reduce_sum_(flags)
        return bool(flags[0] > 0), int(flags[1])

    def _micro_step(self, samples) -> dict:
        c = self.cfg
        cut = min(c.row_len, c.tokens_per_micro) + 1
        batch = pack([s.truncated(cut).aligned() for s in samples], c.row_len, trim=True)
        device = next(self.drafter.parameters()).device
        if device.type != "cpu":
            batch.tensors = {k: v.to(device, non_blocking=True) for k, v in batch.tensors.items()}
            batch.position_ids, batch.seq_ids = batch.position_ids.to(device), batch.seq_ids.to(device)
        # Master weights and optimizer state stay fp32; the forward and loss run in bf16 where asked.
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast_bf16(c.precision, device)):
            loss, metrics = drafter_loss(self.drafter, batch, c.loss)
        loss.backward()
        metrics["samples"] = len(samples)
        return metrics

    def _reduce_and_scale(self, reducer: Reducer, micro_steps: int) -> None:
        """``micro_steps``: run across all ranks this step (the divisor of the summed grads)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        if reducer.size > 1:
            flat = torch.cat([g.reshape(-1) for g in grads])
            reducer.all_reduce_sum_(flat)
            at = 0
            for p, g in zip(self.params, grads):
                n = g.numel()
                p.grad = flat[at: at + n].view_as(p).clone()
                at += n
        else:
            for p, g in zip(self.params, grads):
                p.grad = g
        for p in self.params:
            p.grad.div_(micro_steps)

    def train(self, stop: StopSignal = None, max_steps: int | None = None,
              on_step: Callable[[int, dict], None] | None = None,
              before_micro: Callable[[], None] | None = None) -> TrainResult:
        """Train until ``stop`` (an Event or a callable returning True), ``max_steps`` more
        optimizer steps, or no rank having data (``idle``). ``on_step(step, metrics)`` runs after
        each completed step; ``before_micro()`` before each micro-step's stop check, a point where
        weights, optimizer state, step and cursor describe a completed step (the caller's place to
        swap target tensors or snapshot the state)."""
        should_stop = _stop_fn(stop)
        reducer = self.reducer if self.reducer is not None else default_reducer()
        self.drafter.train()
        start = time.perf_counter()
        done = micro = discarded = 0
        history: list[dict] = []
        batches = None
        stopped = idle = False
        while max_steps is None or done < max_steps:
            self.optimizer.zero_grad(set_to_none=True)
            step_metrics, cursor, t0 = [], self.cursor, time.perf_counter()
            contributed = 0
            for i in range(self.cfg.grad_accum):
                if before_micro is not None:
                    before_micro()
                has_data = self._has_data()
                stopped, with_data = self._agree(reducer, should_stop, has_data)
                if stopped:
                    break
                if i == 0 and with_data == 0:
                    idle = True
                    break
                contributed += with_data
                if not has_data:
                    continue
                if batches is None:
                    # Created on first use: the buffer may have been empty when train() began.
                    batches = self._batches()
                samples, cursor = next(batches)
                step_metrics.append(self._micro_step(samples))
                micro += 1
            if stopped or idle:
                # Partial accumulation: drop it; the cursor stays at this step's start.
                discarded += len(step_metrics)
                self.optimizer.zero_grad(set_to_none=True)
                break
            self._reduce_and_scale(reducer, contributed)
            norm = (torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
                    if self.cfg.grad_clip > 0 else torch.nan)
            lr = lr_at(self.cfg, self.step)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            self.step += 1
            self.cursor = cursor
            done += 1
            # Local metrics: a rank that had no data this step reports no loss (nan), 0 tokens.
            n = len(step_metrics)
            metrics = {
                "step": self.step, "lr": lr, "grad_norm": float(norm),
                "loss": sum(m["loss"] for m in step_metrics) / n if n else math.nan,
                "samples": sum(m["samples"] for m in step_metrics),
                "micro_steps": n, "step_s": time.perf_counter() - t0,
            }
            for key in (step_metrics[0] if n else ()):
                if key not in metrics and key != "tokens":
                    metrics[key] = sum(m[key] for m in step_metrics) / n
            metrics["tokens"] = sum(m.get("tokens", 0) for m in step_metrics)
            history.append(metrics)
            if on_step is not None:
                on_step(self.step, metrics)
        self.optimizer.zero_grad(set_to_none=True)
        return TrainResult(done, stopped, micro, discarded, time.perf_counter() - start, history, idle)
