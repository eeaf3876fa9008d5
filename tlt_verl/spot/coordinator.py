"""The Spot Trainer coordinator: drafter training on the replicas that drained in the long tail.

It runs in the trainer's driver during each rollout. A thread polls every replica's request
counters (the rollout server's own count of requests routed to it); a replica that got requests
in this rollout and has none left in flight is drained while others still generate, and its
trainer rank(s), idle on the same cores, join drafter training. Each change in the set of idle
ranks starts a new data-parallel session of exactly those ranks, seeded from the member whose
drafter is freshest, so one drafter comes out. A replica that gets a request again leaves. When
the rollout ends every session is preempted (bounded by `preempt_timeout_s`); the driver then
exports the freshest drafter and pushes it to every replica before the next rollout.

States per replica, recorded as a timeline: generating, drained (idle, not training), training,
stopped (the rollout is over).
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import ray

logger = logging.getLogger(__name__)

GENERATING, DRAINED, TRAINING, STOPPED = "generating", "drained", "training", "stopped"


@dataclass
class ReplicaSlot:
    """One replica, its server actor and the trainer workers (ranks) that share its cores."""
    rank: int
    server: Any
    workers: list                         # Ray handles of the TLT actor workers
    worker_ranks: list[int]
    state: str = STOPPED
    started_at_begin: int = 0
    idle_since: Optional[float] = None
    timeline: list = field(default_factory=list)   # (t0, t1, state)
    _state_t0: float = 0.0

    def enter(self, state: str, now: float) -> None:
        if state != self.state:
            if self._state_t0:
                self.timeline.append((self._state_t0, now, self.state))
            self.state, self._state_t0 = state, now


class SpotCoordinator:
    def __init__(self, slots: Sequence[ReplicaSlot], call: Callable[..., Any], spot_config) -> None:
        """``call(worker, method, *args)`` returns an ObjectRef of a TLT worker method."""
        self.slots = list(slots)
        self.call = call
        self.cfg = spot_config
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._session: Optional[dict] = None
        self._train = False
        self.rollout_t0 = 0.0
        self.stats: dict[str, float] = {}
        self.versions: dict[int, int] = {}   # worker rank -> drafter state version

    # ---- one rollout ------------------------------------------------------------------------

    def begin_rollout(self, train: bool) -> None:
        self._train = train
        # harvested_s: seconds ranks spent training (summed over members); session_s: seconds ranks
        # sat in sessions, waiting for data included.
        self.stats = {"harvested_s": 0.0, "session_s": 0.0, "sessions": 0, "train_steps": 0, "preempt_s": 0.0,
                      "train_tokens": 0, "polls": 0}
        self.rollout_t0 = now = time.time()
        # Requests of this rollout may already be routed by now: a replica's work is counted from
        # the last `resync()` (the previous rollout's end, or a validation's), not from here.
        for slot in self.slots:
            slot.timeline = []
            slot._state_t0 = 0.0
            slot.state = STOPPED
            slot.enter(GENERATING, now)
            slot.idle_since = None
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="tlt-spot", daemon=True)
        self._thread.start()

    def end_rollout(self) -> dict[str, Any]:
        """Preempt training, stop following the replicas; returns this rollout's figures."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        t = time.time()
        with self._lock:
            self._end_session(t)
        self.stats["preempt_s"] = time.time() - t
        now = time.time()
        for slot in self.slots:
            slot.enter(STOPPED, now)
        self.resync()
        self.stats["rollout_s"] = now - self.rollout_t0
        return dict(self.stats)

    def resync(self) -> None:
        """Count requests from now on (after a rollout, or requests routed outside one: validation)."""
        counts = ray.get([s.server.request_counts.remote() for s in self.slots])
        for slot, c in zip(self.slots, counts):
            slot.started_at_begin = c["started"]

    def timelines(self) -> dict[int, list]:
        return {s.rank: [(a - self.rollout_t0, b - self.rollout_t0, st) for a, b, st in s.timeline]
                for s in self.slots}

    # ---- following the replicas -------------------------------------------------------------

    def _run(self) -> None:
        # A rollout that trains nothing only needs the timeline, which a slower look keeps.
        interval = self.cfg.poll_interval_s if self._train else self.cfg.observe_interval_s
        while not self._stop.is_set():
            try:
                self._poll()
            except Exception:  # the rollout itself reports real failures; never kill it from here
                logger.exception("tlt spot coordinator: poll failed")
            self._stop.wait(interval)

    def _poll(self) -> None:
        counts = ray.get([s.server.request_counts.remote() for s in self.slots])
        self.stats["polls"] += 1
        now = time.time()
        with self._lock:
            if self._stop.is_set():
                return
            idle = []
            for slot, c in zip(self.slots, counts):
                got_work = c["started"] > slot.started_at_begin
                if c["in_flight"] > 0 or not got_work:
                    slot.idle_since = None
                    slot.enter(GENERATING, now)
                    continue
                slot.idle_since = slot.idle_since or now
                if now - slot.idle_since >= self.cfg.drain_grace_s:
                    idle.append(slot)
                    if slot.state == GENERATING:
                        slot.enter(DRAINED, now)
            # All drained: the rollout is over, and training now would only delay the trainer.
            if len(idle) == len(self.slots):
                self._end_session(now)
                return
            members = sorted(r for s in idle for r in s.worker_ranks)
            current = self._session["ranks"] if self._session else []
            if self._train and members != current:
                self._end_session(now)
                if members:
                    self._start_session(idle, now)

    def _start_session(self, idle: list[ReplicaSlot], now: float) -> None:
        workers = [(r, w) for s in idle for r, w in zip(s.worker_ranks, s.workers)]
        ranks = [r for r, _ in workers]
        # Seed from the freshest drafter so a joining rank never drags the others back.
        source = max(range(len(ranks)), key=lambda i: (self.versions.get(ranks[i], 0), -i))
        host, port = ray.get(self.call(workers[0][1], "tlt_rendezvous"))
        session_id = uuid.uuid4().hex[:12]
        refs = [self.call(w, "tlt_start_session", session_id, i, len(workers), host, port, source)
                for i, (_, w) in enumerate(workers)]
        ray.get(refs)
        self._session = {"ranks": ranks, "workers": workers, "t0": now, "slots": idle}
        self.stats["sessions"] += 1
        for s in idle:
            s.enter(TRAINING, now)

    def _end_session(self, now: float) -> None:
        if self._session is None:
            return
        sess, self._session = self._session, None
        results = ray.get([self.call(w, "tlt_stop_session", self.cfg.preempt_timeout_s)
                           for _, w in sess["workers"]])
        end = time.time()
        for (rank, _), res in zip(sess["workers"], results):
            self.versions[rank] = int(res.get("state_version", 0))
        self.stats["session_s"] += (end - sess["t0"]) * len(sess["workers"])
        # A session whose members had no data yet trained nothing: it harvested nothing.
        self.stats["harvested_s"] += sum(float(r.get("seconds") or 0.0) for r in results if r.get("steps"))
        self.stats["train_steps"] += int(results[0].get("steps", 0)) if results else 0
        self.stats["train_tokens"] += sum(int(r.get("tokens", 0)) for r in results)
        if results and results[0].get("last_loss") is not None:
            self.stats["loss"] = float(results[0]["last_loss"])
        for s in sess["slots"]:
            if s.state == TRAINING:
                s.enter(DRAINED, end)

    # ---- after the rollout ------------------------------------------------------------------

    def freshest_worker(self) -> tuple[int, Any]:
        """(rank, handle) of the worker whose drafter saw the most training."""
        pairs = [(r, w) for s in self.slots for r, w in zip(s.worker_ranks, s.workers)]
        return max(pairs, key=lambda p: (self.versions.get(p[0], 0), -p[0]))
