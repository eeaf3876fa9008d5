"""Idle scheduling priority: CPU time only when nothing else on the core wants it.

TLT trains its drafter on cycles the rollout leaves idle. A thread at SCHED_IDLE runs only when
no ordinary thread is runnable on its core, so a drafter that trains on a drained replica's core
yields it at once to anything else (the other replicas' engines, verl's agent loop and reward);
nice 19 still takes a share (about 1.5% per competitor on CFS, more under contention for memory).
On Linux a scheduling policy belongs to a thread, not the process: the caller alone is lowered.
"""
from __future__ import annotations

import os

IDLE, NICE = "SCHED_IDLE", "nice 19"


def idle_priority() -> str:
    """Lower the calling thread to SCHED_IDLE (else the lowest nice); returns which it got."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return IDLE
    except (AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, 0, 19)
        return NICE


def is_idle(tid: int) -> bool:
    """Whether thread ``tid`` (a native id, or 0 for the caller) runs at SCHED_IDLE."""
    return hasattr(os, "SCHED_IDLE") and os.sched_getscheduler(tid) == os.SCHED_IDLE
