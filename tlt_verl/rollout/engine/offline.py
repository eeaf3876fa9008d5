"""An offline vLLM engine configured for this host (tests, benchmarks, offline tools)."""
from __future__ import annotations

import os

from tlt_verl.rollout.engine.server import DEFAULT_CPU_KV_CACHE_BYTES


def offline_llm(model: str, **engine_kwargs):
    from tlt_verl.rollout.engine.replica import engine_env

    # In-process engine core: no spawned child, so callers need no __main__ guard.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    for key, value in engine_env(0).items():
        os.environ.setdefault(key, value)
        if key.endswith(("_PATH", "_ROOT")):
            os.makedirs(value, exist_ok=True)
    from vllm import LLM

    # A large token budget per step keeps prefills whole (see VllmServer.launch).
    kwargs = dict(dtype="float32", enforce_eager=True, seed=0, kv_cache_memory_bytes=DEFAULT_CPU_KV_CACHE_BYTES,
                  disable_log_stats=False, max_num_batched_tokens=16384)
    kwargs.update(engine_kwargs)
    return LLM(model=model, **kwargs)
