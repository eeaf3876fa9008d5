"""What each SD arm is worth in a bucket, from pulls of any arm: tokens per step over step cost.

A pull's own tokens per request-second (the plain bandit reward) drifts with where in the tail the
pull ran: contexts grow and the batch shrinks while the tail drains, so a cheap arm tried early in a
bucket looks better than the incumbent's mean over the whole tail, and the bandit keeps going back
to it (on the long-tail bench, 16 of 60 pulls of the 4-7 bucket went to arms other than the best
one, where exploration alone accounts for about 4). So the value of arm k is split in two:

- tokens per request-step, A_k. A step under arm k also says what every smaller arm would have
  emitted: draft i does not depend on how many drafts follow it (a chain, or parallel drafting
  under a causal mask), so arm k' < k would have emitted batch + accepted drafts at positions
  < k'. Every pull of the incumbent thus keeps the smaller arms' A up to date, no exploration needed.
- step cost, as log-cost differences between arms measured by adjacent pulls: a pull of arm k right
  after a pull of arm j (same bucket, no gap) ran at nearly the same contexts, and their steps at
  the batch sizes both ran give log C_k - log C_j with the drift taken out. Where the two share
  batch sizes only those count: a bucket spans several, and a step at batch 3 costs 15% more than
  one at batch 2 here, so a cheap arm tried just after the batch fell would be credited with the
  fall, and kept (measured: k=2 held the 2-3 bucket where k=3's steps were both cheaper and
  emitted more). Pulls with no batch size in common (in a wide bucket the batch can fall at every
  step) compare their mean step costs less what the batch difference explains: log cost grows with
  log batch at a slope fitted, per bucket, to the steps within each pull (one arm, a few batch
  sizes, nearly the same contexts), clamped to [0, 1]. Without it the arm tried second in a falling
  batch is credited with the fall. (In the end-to-end recipe's 8+ bucket the fitted slope came out
  negative, so 0: there steps got slower as the batch fell, while finished requests' work shared
  the two cores; that bucket still moved from k=3 to k=0 and k=1 in some runs.) Per-arm log costs
  are the least-squares fit to those differences.

An arm's value is A_k / C_k with every C taken at the latest pull's conditions (tokens per
request-second, as the plain reward). An arm with no pull of its own has no cost, and no value,
unless it lies between two priced arms: then its log cost is interpolated between theirs (see
`values`), so that after the bandit's start (the largest k, then k=0) every arm has a value and
a drafter that accepts nothing costs no pull of the arms in between.
Arms not linked to the latest pull by pairs (their pulls sat across rollout boundaries from it) keep
a value at the conditions of their own group's latest pull: stale, but without it the first pull of
a new rollout's tail, often an exploring one, was the bucket's only valued arm and so its greedy
one, and the bucket climbed back one exploring pull at a time (seen end to end: a replica's batch-1
bucket on k=0, k=1, then k=2 for most of a run, k=3 unvalued after two pulls).
Against per-pull rewards on the long-tail bench, side by side in eight runs: no difference beyond
the bench's noise (README, "Adaptive SD in the rollout").
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from tlt_verl.rollout.policy.bandit import BucketedEpsilonGreedy, mean_step

# A pause between steps this long is a rollout boundary (the RL step's training ran in it), after
# which batch and contexts start over: pulls on either side of one are not compared, and a pull
# does not run across one.
ROLLOUT_GAP_S = 1.0


@dataclass
class Pull:
    """One finished pull of `arm` in a bucket: its steady steps summed."""
    arm: int
    tokens: tuple[int, ...]       # tokens arm k' = 0..arm would have emitted (the last: what it did emit)
    t_start: float
    t_end: float
    by_batch: dict[int, tuple[int, float]]  # batch size -> (steps, seconds) of its steps at that size

    @property
    def request_steps(self) -> int:
        """Sum of batch over its steps."""
        return sum(b * n for b, (n, _) in self.by_batch.items())

    @property
    def request_seconds(self) -> float:
        """Sum of batch x step time over its steps."""
        return sum(b * t for b, (_, t) in self.by_batch.items())


def _log_cost_difference(new: dict[int, tuple[int, float]], old: dict[int, tuple[int, float]],
                         slope: float) -> float:
    """Log step cost of `new` minus `old`: over the batch sizes both ran, else over all their steps
    with `slope` x (the difference of their mean log batch) taken out."""
    total = weight = 0.0
    for b in new.keys() & old.keys():
        (n1, s1), (n0, s0) = new[b], old[b]
        w = min(n1, n0)
        total += w * (math.log(s1 / n1) - math.log(s0 / n0))
        weight += w
    if weight:
        return total / weight

    def mean_log(steps: dict[int, tuple[int, float]]) -> float:
        return math.log(sum(s for _, s in steps.values()) / sum(n for n, _ in steps.values()))

    return mean_log(new) - mean_log(old) - slope * (_mean_log_batch(new) - _mean_log_batch(old))


def _mean_log_batch(steps: dict[int, tuple[int, float]]) -> float:
    return sum(n * math.log(b) for b, (n, _) in steps.items()) / sum(n for n, _ in steps.values())


def _within_pull_moments(steps: dict[int, tuple[int, float]]) -> tuple[float, float]:
    """(Sxy, Sxx) of log step cost on log batch over one pull's steps, about the pull's own means."""
    x_bar = _mean_log_batch(steps)
    n_all = sum(n for n, _ in steps.values())
    y = {b: math.log(s / n) for b, (n, s) in steps.items()}
    y_bar = sum(n * y[b] for b, (n, _) in steps.items()) / n_all
    sxy = sum(n * (math.log(b) - x_bar) * (y[b] - y_bar) for b, (n, _) in steps.items())
    sxx = sum(n * (math.log(b) - x_bar) ** 2 for b, (n, _) in steps.items())
    return sxy, sxx


class PullRewards:
    """sd.values=pull: each pull's own tokens per request-second is its arm's reward (BEG-MAB as
    published), a running mean per arm kept by the bandit (which also forgets it, `bandit.forget`)."""

    def __init__(self, arms: tuple[int, ...], num_buckets: int, step_size: Optional[float] = None) -> None:
        pass

    def learn(self, bandit: BucketedEpsilonGreedy, bucket: int, pull: Pull) -> None:
        bandit.update(bucket, pull.arm, pull.tokens[-1] / pull.request_seconds)

    def forget_drafts(self, arms: tuple[int, ...]) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class ArmValues:
    """sd.values=paired: per bucket, A_k (running or exponential mean, `step_size` as the bandit's)
    and the log-cost differences of adjacent pulls; after each pull the bandit gets every arm's value."""

    def __init__(self, arms: tuple[int, ...], num_buckets: int, step_size: Optional[float] = None) -> None:
        self.arms = tuple(arms)
        self.step_size = step_size
        m = len(self.arms)
        self._acc = [[[0, 0.0] for _ in range(m)] for _ in range(num_buckets)]      # [n, mean A]
        self._diff = [[[[0, 0.0] for _ in range(m)] for _ in range(m)] for _ in range(num_buckets)]  # i<j: log C_j - log C_i
        self._last: list[Optional[list]] = [None] * num_buckets  # [arm index, by_batch] of the latest pull
        self._moments = [[0.0, 0.0] for _ in range(num_buckets)]  # within-pull Sxy, Sxx of log cost on log batch
        self._latest: list[list[Optional[list]]] = [[None] * m for _ in range(num_buckets)]  # per arm: [log cost, t_end]

    def _mean(self, cell: list, x: float) -> None:
        cell[0] += 1
        cell[1] = mean_step(cell[1], x, cell[0], self.step_size)

    def learn(self, bandit: BucketedEpsilonGreedy, bucket: int, pull: Pull) -> None:
        self.add(bucket, pull)
        bandit.record(bucket, pull.arm, self.values(bucket))

    def add(self, bucket: int, pull: Pull) -> None:
        i = self.arms.index(pull.arm)
        for k, tokens in enumerate(pull.tokens):
            if k in self.arms:
                self._mean(self._acc[bucket][self.arms.index(k)], tokens / pull.request_steps)
        log_cost = math.log(pull.request_seconds / pull.request_steps)
        sxy, sxx = _within_pull_moments(pull.by_batch)
        self._moments[bucket][0] += sxy
        self._moments[bucket][1] += sxx
        last = self._last[bucket]
        if last is not None and last[0] != i and pull.t_start - self._latest[bucket][last[0]][1] <= ROLLOUT_GAP_S:
            d = _log_cost_difference(pull.by_batch, last[1], self.batch_slope(bucket))
            a, b = sorted((last[0], i))
            self._mean(self._diff[bucket][a][b], d if b == i else -d)
        self._last[bucket] = [i, dict(pull.by_batch)]
        self._latest[bucket][i] = [log_cost, pull.t_end]

    def batch_slope(self, bucket: int) -> float:
        """d log(step cost) / d log(batch) in `bucket`, from the steps within its pulls; 0 until they vary."""
        sxy, sxx = self._moments[bucket]
        return min(1.0, max(0.0, sxy / sxx)) if sxx > 0 else 0.0

    def _log_costs(self, bucket: int, anchor: int) -> dict[int, float]:
        """Arm index -> log cost relative to arm index `anchor`, for the arms linked to it by pairs."""
        m = len(self.arms)
        edges = [(a, b, n, d) for a in range(m) for b in range(a + 1, m)
                 for n, d in [self._diff[bucket][a][b]] if n > 0]
        linked, grew = {anchor}, True
        while grew:
            grew = False
            for a, b, _, _ in edges:
                if (a in linked) != (b in linked):
                    linked |= {a, b}
                    grew = True
        nodes = sorted(linked)
        if len(nodes) == 1:
            return {anchor: 0.0}
        col = {a: c for c, a in enumerate(nodes)}
        rows, rhs = [], []
        for a, b, n, d in edges:
            if a in linked:
                w = math.sqrt(n)
                row = [0.0] * len(nodes)
                row[col[b]], row[col[a]] = w, -w
                rows.append(row)
                rhs.append(w * d)
        pin = [0.0] * len(nodes)
        pin[col[anchor]] = 1.0
        rows.append(pin)
        rhs.append(0.0)
        theta = np.linalg.lstsq(np.array(rows), np.array(rhs), rcond=None)[0]
        return {a: float(theta[col[a]] - theta[col[anchor]]) for a in nodes}

    def _anchors(self, bucket: int) -> list[int]:
        """Pulled arm indices, latest pull first: each group of arms linked by pairs is priced at
        the first of its members here (its latest pull's conditions)."""
        pulled = [i for i, x in enumerate(self._latest[bucket]) if x is not None]
        return sorted(pulled, key=lambda i: -self._latest[bucket][i][1])

    def values(self, bucket: int) -> dict[int, float]:
        """{k: estimated tokens per request-second} for every arm with tokens and a cost: the latest
        pull's arm and those linked to it by pairs at the latest conditions, any other group at its
        own latest; an arm never pulled between two priced ones at an interpolated cost."""
        log_cost: dict[int, float] = {}
        for anchor in self._anchors(bucket):
            if anchor in log_cost:
                continue
            base = self._latest[bucket][anchor][0]
            group = {i: base + rel for i, rel in self._log_costs(bucket, anchor).items()}
            # An arm never pulled between two priced ones of the same group (the same conditions) is
            # priced on the straight line of log cost against k between them. Its tokens are known
            # from the larger arm's pulls, and its cost lies between theirs (one more draft verified
            # a request per k; the drafter's forward is paid from k=1 on, so the line is low for the
            # arm just above k=0, which makes it a greedy choice, and so pulled and priced, whenever
            # its tokens could make it one).
            priced = sorted(group)
            for i in range(priced[0] + 1, priced[-1]):
                if i not in group and self._latest[bucket][i] is None:  # never pulled
                    lo = max(j for j in priced if j < i)
                    hi = min(j for j in priced if j > i)
                    f = (self.arms[i] - self.arms[lo]) / (self.arms[hi] - self.arms[lo])
                    group[i] = group[lo] + f * (group[hi] - group[lo])
            for i, c in group.items():
                log_cost.setdefault(i, c)
        return {self.arms[i]: self._acc[bucket][i][1] / math.exp(c) for i, c in log_cost.items()
                if self._acc[bucket][i][0] > 0}

    def forget_drafts(self, arms: tuple[int, ...]) -> None:
        """A different drafter drafts for `arms` now: the tokens they emit start over; their step
        costs, the engine's and not the drafter's weights', are kept."""
        for acc in self._acc:
            for k in arms:
                acc[self.arms.index(k)] = [0, 0.0]

    def state_dict(self) -> dict[str, Any]:
        """A copy: the policy keeps learning after a checkpoint takes it."""
        return copy.deepcopy({"acc": self._acc, "diff": self._diff, "last": self._last, "moments": self._moments,
                              "latest": self._latest})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._acc = [[[int(n), float(v)] for n, v in b] for b in state["acc"]]
        self._diff = [[[[int(n), float(v)] for n, v in row] for row in b] for b in state["diff"]]
        # States saved before the per-arm costs existed: `last` was [arm, log cost, t_end, by_batch]
        # and the latest pull's cost the only one kept (the other arms get one at their next pull).
        latest = state.get("latest") or [[[x[1], x[2]] if x is not None and j == x[0] else None
                                          for j in range(len(self.arms))] for x in state["last"]]
        self._latest = [[None if c is None else [float(c[0]), float(c[1])] for c in b] for b in latest]
        self._last = [None if x is None else [int(x[0]), {int(b): (int(n), float(t)) for b, (n, t) in x[-1].items()}]
                      for x in state["last"]]
        # States saved before the batch slope existed start it over.
        self._moments = [[float(a), float(b)] for a, b in state.get("moments") or [[0.0, 0.0]] * len(self._acc)]


# sd.values -> how a bucket's arms are valued from its pulls.
VALUES = {"paired": ArmValues, "pull": PullRewards}
