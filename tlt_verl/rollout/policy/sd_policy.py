"""The adaptive SD policy: off above a running-batch threshold, the bandit's arm below it.

Its output is the schedule vLLM 0.30 reads (`num_speculative_tokens_per_batch_size`: inclusive
`(start, end, k)` ranges starting at 1, k=0 allowed), which the engine takes at run time
(`patches/vllm_sd/runtime.py`). Its input is the engine's per-step records: each decode step
under a bucket's current arm adds its tokens and its request-seconds (batch x step time) to that
arm's pull; after `steps_per_pull` steps the pull values the bucket's arms (`sd.values`: by default
every arm from its own tokens and cost and the smaller arms' tokens the pull's accepted drafts
imply, arm_values.py; or the pull's tokens per request-second as its arm's reward) and the bucket
moves on to the bandit's next choice.

Why per request: a pull runs while the long tail drains, so the batch shrinks under it, and a
bucket spans a range of batch sizes (the last one is open). Engine tokens/s grow almost in
proportion to the batch, so with them as the reward an arm wins by where in the bucket it happened
to be pulled (on the long-tail bench, the arms first tried at batch 64 led bucket 16-64 by up to
1.6x). How fast each request advances depends on the batch far less (a plain step at batch 16 is
1.5x the cost of one at batch 1 here, not 16x), and it is what ends the tail.
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Iterable, Mapping, Optional

from tlt_verl.rollout.policy.arm_values import ROLLOUT_GAP_S, VALUES, Pull
from tlt_verl.rollout.policy.bandit import BanditConfig, BucketedEpsilonGreedy

# Running batch above which SD is off. Measured on the workload it serves, the long-tail rollout of
# the default target and warm drafter (EAGLE-3, parallel drafting: all k drafts from one forward),
# bench/longtail_rollout.py, 64 prompts: fixed k=3 decoded faster than plain between 33 and 64
# running requests (64: the CPU recipe's max_num_seqs) in all seven runs made, 1.21-1.53x. With
# the threshold at 32 the adaptive policy decoded that bin plainly and came to 0.95x and 0.89x
# fixed k=3 (two runs, in git history before this value); at 64, 0.94-1.00x in five
# (bench/results/longtail_rollout.json, _r1, _t64_each_*). The short-context bench
# (bench/sd_threshold.py, sd_threshold_parallel*.json) put it at 32 in two runs of three, from 48
# tokens after a task prompt, where the tail decodes near 1,000 tokens of context. With the EAGLE-1
# drafter, whose k drafts were k forwards, it was 8. Within the threshold the bandit's arms
# decide, k=0 (free, see catch_up.py) among them. GPU recipes set their own (the reference: 32).
DEFAULT_THRESHOLD = 64


@dataclass(frozen=True)
class StepMetric:
    """One engine step as the scheduler saw it (see patches/vllm_sd/runtime.py)."""
    batch: int            # requests scheduled in the step
    k: int                # speculative tokens the schedule gave this batch size (drafted at the step's end)
    prefill_reqs: int     # requests that were (partly) prefilling
    drafted_reqs: int     # requests whose drafts were verified in the step
    draft_tokens: int     # drafts verified
    accepted_per_pos: tuple[int, ...]  # accepted drafts at each draft position
    emitted: int          # tokens the step added to all requests (accepted + bonus)
    step_s: float         # seconds the step took
    t: float = 0.0        # when it ended (time.time())

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> "StepMetric":
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in record.items() if k in names}
        values["accepted_per_pos"] = tuple(values.get("accepted_per_pos", ()))
        return cls(**values)

    @property
    def steady(self) -> bool:
        """A decode-only step whose verified drafts were all drafted under this step's k.

        The step after a schedule change verifies drafts of the old length but drafts with the
        new one; a prefill costs more than a decode. Neither says what the arm is worth.
        """
        return self.prefill_reqs == 0 and self.step_s > 0 and self.draft_tokens == self.k * self.batch


@dataclass(frozen=True)
class SDPolicyConfig:
    threshold: int = DEFAULT_THRESHOLD
    steps_per_pull: int = 8
    # How a pull values the arms (arm_values.VALUES): "paired", every arm from tokens implied by any
    # pull and costs from adjacent pulls; "pull", each pull's own reward for its arm.
    values: str = "paired"
    bandit: BanditConfig = field(default_factory=BanditConfig)

    def __post_init__(self) -> None:
        if isinstance(self.bandit, Mapping):
            object.__setattr__(self, "bandit", BanditConfig(**self.bandit))
        if self.threshold < 1:
            raise ValueError(f"sd.threshold={self.threshold}: must be >= 1")
        if self.steps_per_pull < 1:
            raise ValueError(f"sd.steps_per_pull={self.steps_per_pull}: must be >= 1")
        if self.values not in VALUES:
            raise ValueError(f"sd.values={self.values!r}: one of {sorted(VALUES)}")
        if self.bandit.bucket_edges[-1] > self.threshold:
            raise ValueError(f"bandit.bucket_edges={list(self.bandit.bucket_edges)}: a bucket starting above "
                             f"sd.threshold={self.threshold} would never be played")


class AdaptiveSDPolicy:
    def __init__(self, config: SDPolicyConfig, *, max_k: int, max_batch: int) -> None:
        if max(config.bandit.arms) > max_k:
            raise ValueError(f"bandit.arms={list(config.bandit.arms)}: k={max(config.bandit.arms)} exceeds the "
                             f"engine's num_speculative_tokens={max_k} (start it with the largest arm)")
        self.config = config
        self.max_k = max_k
        self.max_batch = max_batch
        self.bandit = BucketedEpsilonGreedy(config.bandit)
        n = config.bandit.num_buckets
        self.values = VALUES[config.values](config.bandit.arms, n, config.bandit.step_size)
        self._arm = [self.bandit.select(b) for b in range(n)]
        self._acc: list[Optional[_PullSoFar]] = [None] * n  # the current pull's steps, per bucket
        # Per bucket: [end of its latest pull, per arm index the seconds of its latest steps].
        self._recent: list[Optional[list]] = [None] * n
        self._drafter: Optional[str] = None  # sha256 of the drafter pushed last (None: the one started with)

    def arm(self, bucket: int) -> int:
        return self._arm[bucket]

    def schedule(self) -> list[tuple[int, int, int]]:
        out = []
        for b in range(self.config.bandit.num_buckets):
            start, end = self.config.bandit.bucket_range(b, self.max_batch)
            end = min(end, self.config.threshold, self.max_batch)
            if start <= end:
                out.append((start, end, self._arm[b]))
        if self.config.threshold < self.max_batch:
            out.append((self.config.threshold + 1, self.max_batch, 0))
        return out

    def observe(self, records: Iterable[StepMetric | Mapping[str, Any]]) -> bool:
        """Feed engine steps; True when an arm changed (push `schedule()` to the engine again)."""
        changed = False
        for rec in records:
            m = rec if isinstance(rec, StepMetric) else StepMetric.from_record(rec)
            if m.batch > self.config.threshold or not m.steady:
                continue
            b = self.bandit.bucket_of(m.batch)
            if m.k != self._arm[b]:
                continue  # ran under an older schedule
            acc = self._acc[b]
            if acc is None or m.t - m.step_s - acc.t_end > ROLLOUT_GAP_S:
                acc = self._acc[b] = _PullSoFar(self._arm[b])  # a pull's steps come from one rollout
            acc.add(m)
            if acc.steps >= self.config.steps_per_pull:
                self.values.learn(self.bandit, b, acc.pull(self._reference(b, acc)))
                new = self.bandit.select(b)
                changed |= new != self._arm[b]
                self._arm[b] = new
                self._acc[b] = None
        return changed

    def drafter_pushed(self, sha256: str) -> bool:
        """The engine now serves drafter `sha256`; True when the arms changed (push `schedule()`).

        What an SD arm emits is the drafter's: a different drafter's tokens are measured again, by
        one pull of the largest k in every bucket (it says what every smaller k emits), while the
        step costs are kept. Without it a bucket that had turned SD off for a poor drafter would
        meet the better one only through an exploring pull of k=1 (on the toy it never came back:
        bench/results/longtail_never_lose_toy.json). The same drafter pushed again (a resume pushes
        the one its saved state learned with) changes nothing."""
        if sha256 == self._drafter:
            return False
        self._drafter = sha256
        drafted = tuple(k for k in self.config.bandit.arms if k > 0)
        self.values.forget_drafts(drafted)
        self.bandit.forget(drafted)
        before = list(self._arm)
        # Not a bandit selection: the bucket's pull in progress (the old drafter's) is dropped and
        # this one replaces it, as a restart of that pull would.
        self._arm = [max(self.config.bandit.arms)] * self.config.bandit.num_buckets
        self._acc = [None] * self.config.bandit.num_buckets
        return self._arm != before

    def _reference(self, bucket: int, acc: "_PullSoFar") -> list[float]:
        """The step seconds the pull's outlier rule takes its median over: the pull's own, topped up
        to REFERENCE_STEPS with its arm's latest steps in the bucket from earlier pulls of this
        rollout (the same arm: arms' step costs differ; this rollout: contexts, so costs, move
        between rollouts). Records the pull's steps for the pulls after it."""
        i = self.config.bandit.arms.index(acc.arm)
        recent = self._recent[bucket]
        if recent is None or acc.t_start - recent[0] > ROLLOUT_GAP_S:
            recent = self._recent[bucket] = [0.0, [[] for _ in self.config.bandit.arms]]
        own = [t for _, t in acc.step_s]
        missing = max(REFERENCE_STEPS - len(own), 0)
        earlier = recent[1][i][max(len(recent[1][i]) - missing, 0):] if missing else []
        recent[0] = acc.t_end
        recent[1][i] = (recent[1][i] + own)[-REFERENCE_STEPS:]
        return earlier + own

    def state_dict(self) -> dict[str, Any]:
        return {"config": {"threshold": self.config.threshold, "steps_per_pull": self.config.steps_per_pull,
                           "values": self.config.values, "bandit": asdict(self.config.bandit)},
                "bandit": self.bandit.state_dict(), "values": self.values.state_dict(), "arms": list(self._arm),
                "acc": [None if a is None else asdict(a) for a in self._acc],
                "recent": copy.deepcopy(self._recent), "drafter": self._drafter}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        state = copy.deepcopy(state)  # the policy learns on in place; the caller's state stays as saved
        saved = state["config"]
        if saved["threshold"] != self.config.threshold:
            raise ValueError(f"sd policy state: threshold={saved['threshold']} does not match "
                             f"sd.threshold={self.config.threshold}")
        # States saved before sd.values existed valued arms by each pull's reward.
        if saved.get("values", "pull") != self.config.values:
            raise ValueError(f"sd policy state: values={saved.get('values', 'pull')} does not match "
                             f"sd.values={self.config.values}")
        self.bandit.load_state_dict(state["bandit"])
        self.values.load_state_dict(state.get("values", {}))
        self._arm = [int(a) for a in state["arms"]]
        # A pull in progress saved in another layout is dropped: the bucket starts its pull again.
        keys = {f.name for f in fields(_PullSoFar)}
        self._acc = [_PullSoFar(**a) if isinstance(a, Mapping) and set(a) == keys else None for a in state["acc"]]
        # States saved before the outlier rule looked across pulls: each bucket's reference starts empty.
        self._recent = state.get("recent") or [None] * self.config.bandit.num_buckets
        self._drafter = state.get("drafter")


# A step slower than this many times its arm's median step (the pull's; see REFERENCE_STEPS) is
# costed as the median step: its time was another process's burst on the shared cores, not the
# arm's (its tokens still count). A cap
# at this factor instead would still leave one such step in eight adding a quarter to the pull's
# cost. Measured in a 6-step TLT run on CPU: batch-1 steps at k=3 had a median of 6.0 ms, a mean
# of 8.3 ms and a maximum of 183 ms; one such step makes its pull's mean cost 4x. In 20-step runs
# without this rule a replica's batch-1 bucket played k=2 in 25 of 27 pulls and fixed k=3 ran the
# tail 1.07-1.10x faster than the policy; with it, 0.94-1.01x (bench/results/tlt_e2e_fixed_k3.json,
# tlt_e2e.json). Within a pull the batch moves the cost far less than 3x.
STEP_OUTLIER = 3.0
# The median is taken over at least this many steps (`AdaptiveSDPolicy._reference`): a pull's own
# median cannot tell its burst at steps_per_pull <= 2, where it contains the burst (of two steps
# the median is their mean, which a burst never exceeds 1.5x). Over five of the arm's latest
# steps two bursts still leave a normal step in the middle. Of an even count the lower middle is
# taken: the arm's first pull of two steps in a rollout, one of them a burst, has the other.
REFERENCE_STEPS = 5


@dataclass
class _PullSoFar:
    arm: int
    tokens: list[int] = field(default_factory=list)  # what arms 0..arm emitted or would have
    t_start: float = 0.0
    t_end: float = 0.0
    step_s: list[list] = field(default_factory=list)  # [batch size, seconds] of each step

    @property
    def steps(self) -> int:
        return len(self.step_s)

    def add(self, m: StepMetric) -> None:
        if not self.step_s:
            self.tokens = [0] * (self.arm + 1)
            self.t_start = m.t - m.step_s
        self.t_end = m.t
        self.step_s.append([m.batch, m.step_s])
        # Arm k' < arm: every request emits its verified token plus its accepted drafts before k'.
        for k in range(self.arm):
            self.tokens[k] += m.batch + sum(m.accepted_per_pos[:k])
        self.tokens[self.arm] += m.emitted

    def pull(self, reference: Iterable[float]) -> Pull:
        """The finished pull, its outliers (against the median of `reference`) costed as that median."""
        ordered = sorted(reference)
        median = float(ordered[(len(ordered) - 1) // 2])
        by_batch: dict[int, tuple[int, float]] = {}
        for b, t in self.step_s:
            n, total = by_batch.get(b, (0, 0.0))
            by_batch[b] = (n + 1, total + (t if t <= STEP_OUTLIER * median else median))
        return Pull(self.arm, tuple(self.tokens), self.t_start, self.t_end, by_batch)


def sd_policy_pulls(state: Mapping[str, Any]) -> int:
    """How many bandit pulls a saved SD policy state holds: a resumed policy starts from it."""
    return sum(int(p) for p in state["bandit"]["pulls"])
