"""The adaptive SD policy driving a running AsyncLLM engine: read its step records, push arms.

The policy decides on the driver side (the engine core only holds the batch size -> k lookup),
so a background task polls the engine's per-step records every `interval_s`, feeds them to
`AdaptiveSDPolicy.observe` and pushes the new schedule when an arm changed. Polling goes over
the engine core's utility channel, which the core serves between steps, so a short interval
costs a few hundred microseconds a poll and never stalls a step.

The loop also keeps what verl's metrics (and the benchmarks) report: every record it saw, and
a summary (SD share of decode steps, mean acceptance length, arm per bucket).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Optional

from tlt_verl.rollout.engine import sd_control
from tlt_verl.rollout.policy.sd_policy import AdaptiveSDPolicy, StepMetric

logger = logging.getLogger(__name__)


def summarize(records: list[StepMetric]) -> dict[str, float]:
    """SD share of decode steps, mean acceptance length, tokens per second of decode; with the
    counts they come from, so that `pool` can combine replicas."""
    decode = [m for m in records if m.prefill_reqs == 0 and m.batch > 0]
    sd = [m for m in decode if m.draft_tokens > 0]
    counts = {"decode_steps": float(len(decode)), "sd_steps": float(len(sd)),
              "draft_rounds": float(sum(m.drafted_reqs for m in sd)),
              "accepted_drafts": float(sum(sum(m.accepted_per_pos) for m in sd)),
              "decode_tokens": float(sum(m.emitted for m in decode)),
              "decode_s": float(sum(m.step_s for m in decode))}
    return {**counts, **_rates(counts)}


def _rates(c: dict) -> dict[str, float]:
    return {
        "sd_step_share": c["sd_steps"] / c["decode_steps"] if c["decode_steps"] else 0.0,
        # 1 (the verified token) + accepted drafts per draft round, as vLLM counts it.
        "acceptance_length": 1.0 + c["accepted_drafts"] / c["draft_rounds"] if c["draft_rounds"] else 0.0,
        "decode_tokens_per_s": c["decode_tokens"] / c["decode_s"] if c["decode_s"] > 0 else 0.0,
    }


COUNTS = ("decode_steps", "sd_steps", "draft_rounds", "accepted_drafts", "decode_tokens", "decode_s")


def pool(summaries: list[dict]) -> dict[str, float]:
    """Several replicas' `summarize` as one: counts added, then the rates (a replica that drafted
    nothing adds decode steps, not an acceptance of 0)."""
    counts = {key: sum(s.get(key, 0.0) for s in summaries) for key in COUNTS}
    return {**counts, **_rates(counts)}


class AdaptiveSDLoop:
    def __init__(self, engine, policy: Optional[AdaptiveSDPolicy], interval_s: float = 0.02,
                 keep_records: bool = True) -> None:
        if interval_s <= 0:
            raise ValueError(f"sd.poll_interval_s={interval_s}: must be > 0")
        self.engine = engine
        self.policy = policy
        self.interval_s = interval_s
        self.keep_records = keep_records
        self.records: list[StepMetric] = []
        self.schedule_pushes = 0
        self._task: Optional[asyncio.Task] = None
        self._lock = asyncio.Lock()

    async def push_schedule(self) -> None:
        if self.policy is not None:
            await sd_control.set_sd_schedule_async(self.engine, self.policy.schedule())
            self.schedule_pushes += 1

    async def poll(self) -> list[StepMetric]:
        """One round: take the engine's new records, learn from them, push arms that changed."""
        async with self._lock:
            new = await sd_control.take_sd_metrics_async(self.engine)
            if self.keep_records:
                self.records.extend(new)
            if self.policy is not None and new and self.policy.observe(new):
                await self.push_schedule()
            return new

    async def _run(self) -> None:
        while True:
            try:
                await self.poll()
            except asyncio.CancelledError:
                raise
            except Exception:  # a dead engine is reported by generate(); keep the loop quiet
                logger.exception("adaptive SD loop: poll failed")
            await asyncio.sleep(self.interval_s)

    async def start(self) -> None:
        if self._task is None:
            await self.push_schedule()
            self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Stop polling after one last round, so the records end with the last step."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        await self.poll()

    @property
    def running(self) -> bool:
        return self._task is not None

    def cancel(self) -> None:
        """Stop polling now, without a last round (the engine is going away)."""
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def take_records(self) -> list[StepMetric]:
        out, self.records = self.records, []
        return out

    def arms(self) -> dict[str, Any]:
        if self.policy is None:
            return {}
        cfg = self.policy.config.bandit
        return {f"{cfg.bucket_range(b, self.policy.max_batch)[0]}": self.policy.arm(b) for b in range(cfg.num_buckets)}
