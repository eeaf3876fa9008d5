"""An offline vLLM engine configured for this host (tests, benchmarks, offline tools)."""
from __future__ import annotations

import os

from tlt_verl.rollout.engine.engine_dirs import make_engine_dirs
from tlt_verl.rollout.engine.server import DEFAULT_CPU_KV_CACHE_BYTES


def _make_dirs(env: dict) -> None:
    # The folders as this process sees them: a value the caller set wins over `env`'s.
    make_engine_dirs({key: os.environ[key] for key in env})


def use_engine_env() -> None:
    """This host's engine environment in this process, for good (a value already set wins): for
    a process of its own that builds an `AsyncLLM` itself (benchmarks, test children)."""
    from tlt_verl.rollout.engine.replica import engine_env

    env = engine_env(0)
    for key, value in env.items():
        os.environ.setdefault(key, value)
    _make_dirs(env)


def offline_llm(model: str, **engine_kwargs):
    """The engine, built with this host's engine environment (a value the caller set wins). The
    environment is the caller's again once the engine is built: the engine reads it while it
    starts, and the caller's process (a test session, say) goes on to start other things."""
    from tlt_verl.rollout.engine.replica import engine_env

    # In-process engine core: no spawned child, so callers need no __main__ guard.
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **engine_env(0)}
    added = [key for key in env if key not in os.environ]
    for key in added:
        os.environ[key] = env[key]
    _make_dirs(env)
    try:
        from vllm import LLM

        # A large token budget per step keeps prefills whole (see VllmServer.launch).
        kwargs = dict(dtype="float32", enforce_eager=True, seed=0, kv_cache_memory_bytes=DEFAULT_CPU_KV_CACHE_BYTES,
                      disable_log_stats=False, max_num_batched_tokens=16384)
        kwargs.update(engine_kwargs)
        return LLM(model=model, **kwargs)
    finally:
        for key in added:
            os.environ.pop(key, None)
