"""Run-time control of speculative decoding in vLLM 0.30's engine core, and per-step SD records.

vLLM 0.30 reads `speculative_config.num_speculative_tokens_per_batch_size` once, in
`Scheduler.__init__` (v1/core/sched/scheduler.py), into the dense list `Scheduler.dynamic_sd_lookup`
(index = running batch size, value = k, built by `build_dynamic_sd_schedule_lookup` in
v1/spec_decode/dynamic/utils.py). `Scheduler.schedule` puts `dynamic_sd_lookup[len(batch)]` into
`SchedulerOutput.num_spec_tokens_to_schedule`; the model runner drafts that many tokens at the
end of the step (k=0: the drafter still runs its first forward, which keeps its KV cache in step,
but proposes nothing) and the next step verifies them. The scheduler lives in the engine core
process, which the front end reaches only through utility calls: `EngineCoreProc` runs
`getattr(engine_core, name)(*args)` for each one between steps. So this patch adds two utility
methods to `EngineCore` (v1/engine/core.py):

- `tlt_set_sd_schedule(schedule)`: rebuild `dynamic_sd_lookup` from `(start, end, k)` ranges with
  vLLM's own builder (same validation, k clamped to the engine's num_speculative_tokens). The
  engine must have been started with a schedule (and with num_speculative_tokens = the largest
  k): without one the scheduler pads new decodes to the full k, and vLLM drops the schedule
  under data parallelism (`VllmConfig._maybe_disable_dynamic_sd_for_data_parallel`).
- `tlt_take_sd_metrics()`: return and clear the per-step records.

The records come from wrapping `Scheduler.schedule` (start time) and `Scheduler.update_from_output`
(what the step scheduled, drafted, verified and emitted; computed from its arguments, so they do
not depend on vLLM's stats logging). `AsyncScheduler` inherits both methods.
"""
from __future__ import annotations

import collections
import functools
import time
from typing import Any

from tlt_verl.patches._guard import PatchError, require_attr

WHAT = "vLLM run-time speculative decoding control"
# Records kept when nobody reads them (a rollout of a few thousand steps fits).
MAX_RECORDS = 65536
_T0 = "_tlt_sched_t0"


def patch_scheduler(mod) -> None:
    cls = require_attr(mod, "Scheduler", WHAT)
    schedule = require_attr(cls, "schedule", WHAT)
    update = require_attr(cls, "update_from_output", WHAT)
    if getattr(schedule, "_tlt_wrapped", False):
        return

    @functools.wraps(schedule)
    def timed_schedule(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = schedule(self, *args, **kwargs)
        setattr(out, _T0, t0)
        return out

    @functools.wraps(update)
    def recorded_update(self, scheduler_output, model_runner_output):
        record = _step_record(self, scheduler_output, model_runner_output)
        # Tokens the step delivered: what the model emitted, less what stop conditions cut off.
        before = [(r, r.num_output_tokens) for r in map(self.requests.get, scheduler_output.num_scheduled_tokens)
                  if r is not None] if record is not None else []
        result = update(self, scheduler_output, model_runner_output)
        if record is not None:
            record["emitted"] = sum(r.num_output_tokens - n for r, n in before)
            now = time.perf_counter()
            # Under async scheduling the next step is scheduled before this one's output is
            # processed: the step's own time is the gap since the previous step ended, unless
            # the engine sat idle in between (then it starts when it was scheduled).
            start = max(getattr(scheduler_output, _T0, now), getattr(self, "_tlt_last_end", 0.0))
            record["step_s"] = now - start
            record["t"] = time.time()
            self._tlt_last_end = now
            _records(self).append(record)
        return result

    timed_schedule._tlt_wrapped = True
    cls.schedule = timed_schedule
    cls.update_from_output = recorded_update


def _records(scheduler) -> collections.deque:
    rec = getattr(scheduler, "_tlt_records", None)
    if rec is None:
        rec = scheduler._tlt_records = collections.deque(maxlen=MAX_RECORDS)
    return rec


def _step_record(scheduler, so, mro) -> dict[str, Any] | None:
    num_scheduled = so.num_scheduled_tokens
    if not num_scheduled:
        return None
    spec = so.scheduled_spec_decode_tokens
    sampled = mro.sampled_token_ids or []
    index = mro.req_id_to_index or {}
    max_k = max(int(getattr(scheduler, "num_spec_tokens", 0) or 0), 1)
    per_pos = [0] * max_k
    prefill = drafted = drafts = emitted = 0
    for req_id, n in num_scheduled.items():
        drafted_ids = spec.get(req_id) or ()
        if n > 1 + len(drafted_ids):
            prefill += 1
        i = index.get(req_id)
        generated = len(sampled[i]) if i is not None and i < len(sampled) else 0
        emitted += generated
        if drafted_ids and generated:
            drafted += 1
            drafts += len(drafted_ids)
            for p in range(min(generated - 1, len(drafted_ids), max_k)):
                per_pos[p] += 1
    return {"batch": len(num_scheduled), "k": int(so.num_spec_tokens_to_schedule), "prefill_reqs": prefill,
            "drafted_reqs": drafted, "draft_tokens": drafts, "accepted_per_pos": per_pos,
            "model_tokens": emitted, "scheduled_tokens": int(so.total_num_scheduled_tokens)}


def patch_engine_core(mod) -> None:
    cls = require_attr(mod, "EngineCore", WHAT)
    require_attr(cls, "step", WHAT)
    from vllm.v1.spec_decode.dynamic import utils as dyn

    build = require_attr(dyn, "build_dynamic_sd_schedule_lookup", WHAT)

    def tlt_set_sd_schedule(self, schedule: list) -> list:
        """Replace the batch-size -> k lookup; returns the normalised schedule."""
        scheduler = self.scheduler
        if getattr(scheduler, "dynamic_sd_lookup", None) is None:
            raise PatchError(f"{WHAT}: the engine was started without "
                             "speculative_config.num_speculative_tokens_per_batch_size; start it with one")
        lookup = build(list(schedule), vllm_max_batch_size=scheduler.scheduler_config.max_num_seqs,
                       vllm_num_speculative_tokens=scheduler.num_spec_tokens)
        # One assignment: the scheduler reads the list once per step.
        scheduler.dynamic_sd_lookup = lookup
        return [[int(s), int(e), int(k)] for s, e, k in schedule]

    def tlt_get_sd_lookup(self) -> list:
        return list(getattr(self.scheduler, "dynamic_sd_lookup", None) or [])

    def tlt_take_sd_metrics(self) -> list:
        rec = _records(self.scheduler)
        out = list(rec)
        rec.clear()
        return out

    for fn in (tlt_set_sd_schedule, tlt_get_sd_lookup, tlt_take_sd_metrics):
        if hasattr(cls, fn.__name__) and getattr(cls, fn.__name__).__module__ != __name__:
            raise PatchError(f"{WHAT}: EngineCore.{fn.__name__} already exists; refusing to override it")
        setattr(cls, fn.__name__, fn)
