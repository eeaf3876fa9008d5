"""Driver side of run-time SD control: the engine core utility calls of patches/vllm_sd/runtime.py.

`vllm.LLM` reaches its engine core through one of two clients: in process (`InprocClient`, with
VLLM_ENABLE_V1_MULTIPROCESSING=0) the core object is right there; otherwise a `SyncMPClient`
forwards the call over ZMQ (`call_utility`). `AsyncLLM` always uses `call_utility_async`.
"""
from __future__ import annotations

from typing import Sequence

from tlt_verl.rollout.policy.sd_policy import StepMetric

Schedule = Sequence[Sequence[int]]


def _call(llm, method: str, *args):
    client = llm.llm_engine.engine_core
    if hasattr(client, "call_utility"):
        return client.call_utility(method, *args)
    return getattr(client.engine_core, method)(*args)


def _plain(schedule: Schedule) -> list[list[int]]:
    return [[int(s), int(e), int(k)] for s, e, k in schedule]


def set_sd_schedule(llm, schedule: Schedule) -> list[list[int]]:
    return _call(llm, "tlt_set_sd_schedule", _plain(schedule))


def sd_lookup(llm) -> list[int]:
    """The engine's dense batch size -> k list (index 0 unused)."""
    return _call(llm, "tlt_get_sd_lookup")


def take_sd_metrics(llm) -> list[StepMetric]:
    return [StepMetric.from_record(r) for r in _call(llm, "tlt_take_sd_metrics")]


async def set_sd_schedule_async(engine, schedule: Schedule) -> list[list[int]]:
    return await engine.engine_core.call_utility_async("tlt_set_sd_schedule", _plain(schedule))


async def take_sd_metrics_async(engine) -> list[StepMetric]:
    return [StepMetric.from_record(r) for r in await engine.engine_core.call_utility_async("tlt_take_sd_metrics")]
