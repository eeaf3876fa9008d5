"""The rollout timeline: per-request records written by each rollout server.

A record is {replica, step, start, end, n_prompt, n_tokens}; `step` is the weights version
the server held, so the rollout of trainer step s carries version s - 1. From them: each
rollout's window, the length distribution, and how long replicas sat drained while another
still generated (the long tail TLT harvests).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class RolloutWindow:
    step: int
    start: float
    end: float
    replica_last_end: dict[int, float] = field(default_factory=dict)
    lengths: list[int] = field(default_factory=list)
    spans: list[tuple[float, float]] = field(default_factory=list)  # each request's (start, end)

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def idle_fraction(self, replicas: list[int]) -> float:
        """Mean over replicas of the share of the window a replica had nothing left to generate."""
        if self.seconds <= 0:
            return 0.0
        idle = [(self.end - self.replica_last_end.get(r, self.start)) / self.seconds for r in replicas]
        return float(np.mean(idle))

    def seconds_in_flight(self, at_least: int) -> float:
        """Seconds of the window with at least `at_least` requests in flight (all replicas)."""
        edges = sorted([(t0, 1) for t0, _ in self.spans] + [(t1, -1) for _, t1 in self.spans])
        total, running, since = 0.0, 0, 0.0
        for t, d in edges:
            if running >= at_least:
                total += t - since
            running += d
            since = t
        return total

    def crowded_seconds(self) -> float:
        """Seconds with a quarter or more of the rollout's requests in flight: the start, where
        every replica decodes a large batch (SD pays least there); the rest is the long tail."""
        return self.seconds_in_flight(max(1, len(self.spans) // 4))

    def length_stats(self) -> dict[str, float]:
        a = np.asarray(self.lengths)
        return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)), "max": float(a.max())}


def load_events(directory: Path) -> list[dict]:
    events = []
    for f in sorted(Path(directory).glob("replica_*.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip():
                events.append(json.loads(line))
    return events


def rollout_windows(events: list[dict]) -> dict[int, RolloutWindow]:
    """Group records by trainer step (weights version + 1)."""
    windows: dict[int, RolloutWindow] = {}
    for e in events:
        step = (e["step"] or 0) + 1
        w = windows.get(step)
        if w is None:
            w = windows[step] = RolloutWindow(step=step, start=e["start"], end=e["end"])
        w.start, w.end = min(w.start, e["start"]), max(w.end, e["end"])
        w.replica_last_end[e["replica"]] = max(w.replica_last_end.get(e["replica"], 0.0), e["end"])
        w.lengths.append(e["n_tokens"])
        w.spans.append((e["start"], e["end"]))
    return windows


def replicas(events: list[dict]) -> list[int]:
    return sorted({e["replica"] for e in events})
