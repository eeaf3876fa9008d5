"""A rollout engine that dies says so in one line: which replica, which process, how it ended.

vLLM's front end notices a dead engine core (a monitor thread waits on the core processes) and
every later call raises `EngineDeadError`, whose message points at a stack trace elsewhere. The
server turns it into one line naming the replica and the process's end (signal or exit code), so
the run stops at its next generate or weight sync with the cause, instead of hanging or showing
a traceback from inside vLLM.
"""
from __future__ import annotations

import contextlib
import signal


def core_processes(engine) -> list:
    """vLLM's own handles on the engine's core processes (empty for an in-process engine)."""
    manager = getattr(getattr(getattr(engine, "engine_core", None), "resources", None), "engine_manager", None)
    return list(getattr(manager, "processes", None) or [])


def death_cause(engine) -> str:
    """How the engine's core processes ended."""
    ended = []
    for proc in core_processes(engine):
        code = proc.exitcode
        if code is None:
            continue
        if code < 0:
            try:
                how = f"killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"killed by signal {-code}"
        else:
            how = f"exited with code {code}"
        ended.append(f"{proc.name} (pid {proc.pid}) {how}")
    return "; ".join(ended) or "its engine core stopped answering"


@contextlib.asynccontextmanager
async def reporting_death(replica_rank: int, engine, what: str):
    from vllm.v1.engine.exceptions import EngineDeadError

    try:
        yield
    except EngineDeadError:
        raise RuntimeError(f"replica {replica_rank}: its vLLM engine died during {what} ({death_cause(engine)}); "
                           "the rollout cannot go on") from None
