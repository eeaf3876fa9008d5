"""Adaptive rollout: the BEG-MAB bandit, the SD policy's schedule, and run-time engine control
(schedule changes, per-step SD records, drafter hot-swap, target/drafter isolation).

The engine tests run one AsyncLLM (started by the rollout server's own `start_engine`: a spawned
engine core that runs its worker) in a subprocess (this file's __main__) on the tiny Llama target of tests/_drafters.py with
its bigram EAGLE-1 drafter, and check what the subprocess reports.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tlt_verl.rollout.policy import AdaptiveSDPolicy, BanditConfig, BucketedEpsilonGreedy, SDPolicyConfig, StepMetric
from tlt_verl.rollout.engine.spec_metrics import counter_delta, spec_decode_counters

K = 3
MAX_SEQS = 8
MAX_TOKENS = [40, 32, 24, 16]  # different lengths: the running batch shrinks 4 -> 1


# ---------------------------------------------------------------------------------------------
# Bandit and policy (no engine)

def _play(bandit, rewards, rounds, bucket=0, noise=0.0, seed=0):
    import random

    rng = random.Random(seed)
    picks = []
    for _ in range(rounds):
        k = bandit.select(bucket)
        bandit.update(bucket, k, rewards[k] + rng.gauss(0, noise))
        picks.append(k)
    return picks


def test_bandit_deterministic_under_seed():
    rewards = {0: 1.0, 1: 1.3, 2: 1.1, 3: 0.7}
    a = _play(BucketedEpsilonGreedy(BanditConfig(seed=7)), rewards, 60, noise=0.2)
    b = _play(BucketedEpsilonGreedy(BanditConfig(seed=7)), rewards, 60, noise=0.2)
    c = _play(BucketedEpsilonGreedy(BanditConfig(seed=8, min_epsilon=0.3, epsilon_decay=1.0)), rewards, 60, noise=0.2)
    assert a == b
    assert a != c


def test_bandit_converges_to_best_arm_per_bucket():
    bandit = BucketedEpsilonGreedy(BanditConfig(seed=0, bucket_edges=(1, 2, 4, 8, 16)))
    # Small batches favour long drafts, large ones no SD: the buckets must learn separately.
    best = {0: 3, 4: 0}
    for bucket, k_best in best.items():
        rewards = {k: 1.0 - 0.15 * abs(k - k_best) for k in bandit.config.arms}
        picks = _play(bandit, rewards, 200, bucket=bucket, noise=0.1, seed=bucket)
        assert bandit.best(bucket) == k_best
        assert picks[-50:].count(k_best) >= 40, picks[-50:]
    assert bandit.epsilon(0) == bandit.config.min_epsilon
    assert bandit.bucket_of(1) == 0 and bandit.bucket_of(3) == 1 and bandit.bucket_of(16) == 4
    assert bandit.bucket_of(1000) == 4


def test_bandit_starts_on_the_largest_arm_and_still_finds_a_cheaper_best():
    """The default start plays the largest k first, alone, where "each" spends a pull on every
    arm; exploration still reaches the other arms, so a bucket where SD does not pay learns k=0."""
    arms = BanditConfig().arms
    largest, each = BucketedEpsilonGreedy(BanditConfig(seed=0)), BucketedEpsilonGreedy(BanditConfig(seed=0, start="each"))
    pays = {k: 1.0 + 0.2 * k for k in arms}  # SD pays: the largest k is the best arm
    first = _play(largest, pays, len(arms), noise=0.05)
    assert first[0] == max(arms) and first.count(max(arms)) >= len(arms) - 1, first
    assert _play(each, pays, len(arms), noise=0.05) == list(arms)
    # SD loses: k=0 is best by 40%. It is found, and played most of the time once found.
    loses = {k: 1.0 - 0.1 * k for k in arms}
    bandit = BucketedEpsilonGreedy(BanditConfig(seed=1))
    picks = _play(bandit, loses, 150, noise=0.05, seed=1)
    assert picks[0] == max(arms) and bandit.best(0) == 0
    assert picks[-50:].count(0) >= 40, picks[-50:]


def test_adjacent_exploration_plays_the_greedy_arms_neighbours():
    """With k=3 greedy an exploring pull plays k=2, never the far cheaper arms; with k=1 greedy, k=0
    or k=2. Uniform exploration plays all four arms."""
    rewards = {0: 1.0, 1: 1.2, 2: 1.3, 3: 1.5}
    for explore, greedy, expect in (("adjacent", 3, {2, 3}), ("adjacent", 1, {0, 1, 2}), ("uniform", 3, {0, 1, 2, 3})):
        r = dict(rewards) if greedy == 3 else {**rewards, 1: 2.0}
        bandit = BucketedEpsilonGreedy(BanditConfig(seed=5, epsilon=0.5, min_epsilon=0.5, epsilon_decay=1.0,
                                                    explore=explore, start="each", explore_floor=0.0))
        picks = _play(bandit, r, 400)
        assert bandit.best(0) == greedy
        assert set(picks[4:]) == expect, (explore, sorted(set(picks[4:])))
    # k=0 is no neighbour of k=3, but is explored until it has a value: once here, as k=1 never is.
    bandit = BucketedEpsilonGreedy(BanditConfig(seed=5, epsilon=0.5, min_epsilon=0.5, epsilon_decay=1.0,
                                                start="largest", explore_floor=0.0))
    picks = _play(bandit, rewards, 400)
    assert picks.count(0) == 1 and picks.count(1) == 0 and picks.count(2) > 50, picks
    with pytest.raises(ValueError, match="ascending"):
        BanditConfig(arms=(3, 0, 1))


def test_exploration_skips_arms_valued_far_below_the_greedy_one():
    """With k=0 greedy and k=1 worth 0.6 of it, an exploring pull plays k=0 (the random stream
    drawn all the same); with k=1 worth 0.9 of it, or with the floor at 0, it plays k=1."""
    for worth, floor, explored in ((0.6, 0.8, False), (0.9, 0.8, True), (0.6, 0.0, True)):
        bandit = BucketedEpsilonGreedy(BanditConfig(seed=5, epsilon=0.5, min_epsilon=0.5, epsilon_decay=1.0,
                                                    explore_floor=floor))
        picks = _play(bandit, {0: 1.0, 1: worth, 2: worth * 0.9, 3: worth * 0.8}, 300)
        assert bandit.best(0) == 0
        assert (picks[2:].count(1) > 30) is explored, (worth, floor, picks[2:].count(1))
    with pytest.raises(ValueError, match="bandit.explore_floor"):
        BanditConfig(explore_floor=1.5)


def test_the_floor_holds_an_arm_back_only_after_its_second_pull():
    """k=1 valued at 0.6 of the greedy k=0 after one pull is explored once more; once its second
    pull says the same, exploring pulls play k=0 (one cold or neighbour-priced pull cannot shut an
    arm out for good)."""
    bandit = BucketedEpsilonGreedy(BanditConfig(seed=5, epsilon=0.5, min_epsilon=0.5, epsilon_decay=1.0,
                                                start="each"))
    for k, value in {0: 1.0, 1: 0.6, 2: 0.5, 3: 0.4}.items():
        bandit.update(0, k, value)
    picks = []
    for _ in range(300):
        arm = bandit.select(0)
        picks.append(arm)
        bandit.update(0, arm, {0: 1.0, 1: 0.6, 2: 0.5, 3: 0.4}[arm])
    assert picks.count(1) == 1, picks.count(1)
    assert bandit.estimates(0)[1] == (2, 0.6)
    assert set(picks) == {0, 1}  # adjacent exploration from k=0 reaches only k=1


def test_bandit_state_restore_continues_identically():
    rewards = {0: 1.0, 1: 1.2, 2: 1.25, 3: 0.9}
    ref = BucketedEpsilonGreedy(BanditConfig(seed=3))
    _play(ref, rewards, 25, noise=0.3, seed=1)
    state = json.loads(json.dumps(ref.state_dict()))  # JSON round trip, as a checkpoint would
    restored = BucketedEpsilonGreedy(BanditConfig(seed=999))
    restored.load_state_dict(state)
    assert _play(ref, rewards, 40, noise=0.3, seed=2) == _play(restored, rewards, 40, noise=0.3, seed=2)
    # The seed in the config only starts the stream; the restored stream is the saved one.
    assert {k: v for k, v in ref.state_dict().items() if k != "config"} == \
        {k: v for k, v in restored.state_dict().items() if k != "config"}
    with pytest.raises(ValueError, match="arms"):
        BucketedEpsilonGreedy(BanditConfig(arms=(0, 2))).load_state_dict(state)


def test_bandit_config_errors_name_the_option():
    for kwargs, option in [({"arms": (2,)}, "bandit.arms"), ({"arms": (1, 1)}, "bandit.arms"),
                           ({"bucket_edges": (2, 4)}, "bandit.bucket_edges"),
                           ({"bucket_edges": (1, 4, 4)}, "bandit.bucket_edges"),
                           ({"epsilon": 1.5}, "bandit.epsilon"), ({"epsilon_decay": 0}, "bandit.epsilon_decay"),
                           ({"step_size": 2.0}, "bandit.step_size")]:
        with pytest.raises(ValueError) as e:
            BanditConfig(**kwargs)
        assert str(e.value).startswith(option) and "\n" not in str(e.value)
    with pytest.raises(ValueError) as e:
        BanditConfig(start="first")
    assert str(e.value) == "bandit.start='first': one of ['each', 'ends', 'largest']"
    with pytest.raises(ValueError) as e:
        BanditConfig(explore="all")
    assert str(e.value) == "bandit.explore='all': one of ['adjacent', 'uniform']"
    # A bandit in every bucket: each bucket plays every arm (at least two) on its own, not one
    # arm per bucket, nor arms shared with the other buckets' counts.
    default = BucketedEpsilonGreedy(BanditConfig(start="each"))
    for bucket in range(default.config.num_buckets):
        played = []
        for _ in default.config.arms:
            played.append(default.select(bucket))
            default.update(bucket, played[-1], 1.0)
        assert len(set(played)) >= 2 and sorted(played) == sorted(default.config.arms), (bucket, played)
        assert all(n == 1 for n, _ in default.estimates(bucket).values()), default.estimates(bucket)
    with pytest.raises(ValueError, match="sd.threshold"):
        SDPolicyConfig(threshold=0)
    with pytest.raises(ValueError) as e:
        SDPolicyConfig(values="mean")
    assert str(e.value) == "sd.values='mean': one of ['paired', 'pull']"
    with pytest.raises(ValueError, match="bucket_edges"):
        SDPolicyConfig(threshold=4, bandit=BanditConfig(bucket_edges=(1, 2, 8)))
    with pytest.raises(ValueError, match="num_speculative_tokens=2"):
        AdaptiveSDPolicy(SDPolicyConfig(), max_k=2, max_batch=64)


def test_policy_schedule_shape():
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    cfg = SDPolicyConfig(threshold=16, bandit=BanditConfig(bucket_edges=(1, 2, 4, 8), arms=(0, 1, 2, 3)))
    policy = AdaptiveSDPolicy(cfg, max_k=3, max_batch=64)
    sched = policy.schedule()
    assert [(s, e) for s, e, _ in sched] == [(1, 1), (2, 3), (4, 7), (8, 16), (17, 64)]
    assert sched[-1][2] == 0  # SD off above the threshold
    assert all(k == max(cfg.bandit.arms) for _, _, k in sched[:-1])  # every bucket starts on its largest k
    lookup = build_dynamic_sd_schedule_lookup([list(x) for x in sched], 64, 3)  # vLLM accepts it
    assert lookup[16] == sched[3][2] and lookup[17] == 0 and len(lookup) == 65
    # Threshold at max_batch: no SD-off range.
    assert AdaptiveSDPolicy(SDPolicyConfig(threshold=16), max_k=3, max_batch=16).schedule()[-1][1] == 16


def _step(batch, k, emitted, step_s, t=0.0, **kw):
    """A decode step; its accepted drafts per position fill the first positions first (a chain)."""
    per_pos, extra = [], emitted - batch
    for _ in range(max(k, 1)):
        per_pos.append(min(batch, extra) if k else 0)
        extra -= per_pos[-1]
    return StepMetric(batch=batch, k=k, prefill_reqs=kw.get("prefill", 0), drafted_reqs=batch if k else 0,
                      draft_tokens=kw.get("drafts", k * batch), accepted_per_pos=tuple(per_pos),
                      emitted=emitted, step_s=step_s, t=t)


def test_policy_learns_from_steps_and_skips_unsteady_ones():
    cfg = SDPolicyConfig(threshold=8, steps_per_pull=4,
                         bandit=BanditConfig(bucket_edges=(1, 4), arms=(0, 2), seed=1, start="each"))
    policy = AdaptiveSDPolicy(cfg, max_k=2, max_batch=16)
    assert policy.arm(0) == 0
    # Prefill, transition (drafts of another length) and above-threshold steps are not rewards.
    assert not policy.observe([_step(2, 0, 2, 0.01, prefill=1), _step(2, 0, 2, 0.01, drafts=4), _step(12, 0, 12, 0.01)])
    assert policy.bandit.estimates(0)[0][0] == 0
    assert policy.observe([_step(2, 0, 2, 0.01)] * 4)  # k=0: 100 tokens per request-second; next the untried k=2
    assert policy.arm(0) == 2 and policy.schedule()[0] == (1, 3, 2)
    policy.observe([_step(2, 2, 6, 0.012)] * 4)  # k=2: 250
    assert policy.bandit.estimates(0)[2] == (1, pytest.approx(250.0))
    for _ in range(20):
        k = policy.arm(0)
        policy.observe([_step(2, k, 2 if k == 0 else 6, 0.01 if k == 0 else 0.012)] * 4)
    assert policy.bandit.best(0) == 2
    state = json.loads(json.dumps(policy.state_dict()))
    other = AdaptiveSDPolicy(cfg, max_k=2, max_batch=16)
    other.load_state_dict(state)
    assert other.schedule() == policy.schedule() and other.state_dict() == policy.state_dict()
    # A saved state is a copy, and so is what a policy loads: learning on changes neither.
    saved = policy.state_dict()
    before = json.dumps(saved)
    policy.observe([_step(2, policy.arm(0), 6, 0.012)] * 8)
    assert json.dumps(saved) == before != json.dumps(policy.state_dict())
    policy.observe([_step(2, policy.arm(0), 6, 0.012)])  # a pull in progress, in the state
    saved = policy.state_dict()
    other.load_state_dict(saved)
    before = json.dumps(saved)
    other.observe([_step(2, other.arm(0), 6, 0.012)])
    assert json.dumps(saved) == before


def test_reward_does_not_favour_the_arm_that_met_the_larger_batch():
    """The tail drains during a pull: the arm tried first in a bucket sees the larger batches. With
    step costs of this machine's plain decoding (8 ms + 0.25 ms a request), k=2 emitting 2.2 tokens
    a request in 1.8x a plain step is the better arm however the batch falls."""
    cfg = SDPolicyConfig(threshold=64, steps_per_pull=4,
                         bandit=BanditConfig(bucket_edges=(1, 16), arms=(0, 2), seed=0, start="each"))
    policy = AdaptiveSDPolicy(cfg, max_k=2, max_batch=64)
    plain = lambda b: 0.008 + 0.00025 * b
    assert policy.arm(1) == 0
    policy.observe([_step(60, 0, 60, plain(60))] * 4)           # k=0 first, at batch 60
    assert policy.arm(1) == 2
    policy.observe([_step(18, 2, 18 * 2.2, 1.8 * plain(18))] * 4)  # k=2 later, at batch 18
    est = policy.bandit.estimates(1)
    assert est[2][1] > est[0][1] and policy.bandit.best(1) == 2
    # Engine tokens/s would have ranked them the other way round.
    assert 60 / plain(60) > 18 * 2.2 / (1.8 * plain(18))



def test_paired_values_price_smaller_arms_from_the_incumbents_drafts():
    """A k=3 pull says what k=1 and k=2 would have emitted (its accepted drafts per position); an
    adjacent k=1 pull gives k=1's cost; a pull after a rollout-sized gap is not compared."""
    cfg = SDPolicyConfig(threshold=8, steps_per_pull=2, bandit=BanditConfig(bucket_edges=(1,), arms=(0, 1, 3), seed=0))
    policy = AdaptiveSDPolicy(cfg, max_k=3, max_batch=8)

    def pull(k, per_pos, step_s, t0):
        emitted = 4 + sum(per_pos[:k])
        step = StepMetric(batch=4, k=k, prefill_reqs=0, drafted_reqs=4 if k else 0, draft_tokens=4 * k,
                          accepted_per_pos=tuple(per_pos), emitted=emitted, step_s=step_s, t=t0)
        policy._arm[0] = k  # the arm the test plays next, as if the bandit had picked it
        policy.observe([step, StepMetric(**{**vars(step), "t": t0 + step_s})])

    pull(3, (4, 3, 2), 0.020, 0.0)       # 13 tokens a step: k=1 would have emitted 8, k=0 4
    assert policy.bandit.estimates(0) == {0: (0, None), 1: (0, None), 3: (1, pytest.approx(13 / 4 / 0.020))}
    pull(1, (2, 0, 0), 0.010, 0.1)       # k=1's own pull: 6 tokens, half the cost
    est = policy.bandit.estimates(0)
    # k=1: tokens per request (8 + 6) / 8 over its cost (0.010); k=3 priced at the same conditions.
    assert est[1] == (1, pytest.approx(14 / 8 / 0.010)) and est[3] == (1, pytest.approx(13 / 4 / 0.020))
    pull(0, (0, 0, 0), 0.005, 10.0)      # k=0 after a gap: counted, but not compared with anything
    est = policy.bandit.estimates(0)
    # k=1 and k=3 keep the values of their own group (priced at k=1's pull, the group's latest).
    assert est[0] == (1, pytest.approx(1 / 0.005)) and est[1][1] == pytest.approx(14 / 8 / 0.010)
    assert est[3][1] == pytest.approx(13 / 4 / 0.020)
    assert policy.bandit.best(0) == 0
    pull(3, (4, 4, 4), 0.012, 10.02)     # linked to k=0 now; k=1 stays linked through its old pair
    est = policy.bandit.estimates(0)
    assert est[3][1] == pytest.approx((13 + 16) / 8 / 0.012) and est[1][1] is not None
    assert est[0][1] == pytest.approx(1 / 0.005)
    # A pull does not run across a rollout boundary: the last rollout's lone step is dropped.
    policy.observe([StepMetric(batch=4, k=3, prefill_reqs=0, drafted_reqs=4, draft_tokens=12,
                               accepted_per_pos=(0, 0, 0), emitted=4, step_s=0.03, t=20.0)])
    pull(3, (4, 4, 4), 0.012, 40.0)
    assert policy.bandit.estimates(0)[3] == (3, pytest.approx((13 / 4 + 16 / 4 + 16 / 4) / 3 / 0.012))


def _pull(policy, k, per_pos, step_s, t0, batch=4, steps=2):
    """`steps` steady steps of arm k in the bucket of `batch` (the arm set as if the bandit chose it)."""
    emitted = batch + sum(per_pos[:k])
    policy._arm[policy.bandit.bucket_of(batch)] = k
    policy.observe([StepMetric(batch=batch, k=k, prefill_reqs=0, drafted_reqs=batch if k else 0,
                               draft_tokens=batch * k, accepted_per_pos=tuple(per_pos), emitted=emitted,
                               step_s=step_s, t=t0 + i * step_s) for i in range(1, steps + 1)])


def test_the_start_prices_every_arm_from_the_largest_k_and_k0():
    """The default start plays the largest k, then k=0; the arms between are priced from those two
    pulls (their tokens from the largest k's drafts, their costs on the line between), so a drafter
    that accepts nothing costs no pull of k=1 or k=2, and a good one is used at once."""
    cfg = SDPolicyConfig(threshold=8, steps_per_pull=2, bandit=BanditConfig(bucket_edges=(1,), seed=0))
    for per_pos, best in (((0, 0, 0), 0), ((4, 3, 3), 3)):
        policy = AdaptiveSDPolicy(cfg, max_k=3, max_batch=8)
        assert policy.arm(0) == 3
        _pull(policy, 3, per_pos, 0.020, 0.0)   # an SD step costs 2x a plain one
        assert policy.arm(0) == 0             # the start's second arm, whatever k=3 earned
        _pull(policy, 0, (0, 0, 0), 0.010, 0.05)
        est = policy.bandit.estimates(0)
        assert est[1][0] == est[2][0] == 0 and None not in [v for _, v in est.values()], est
        # k=1 at 2^(1/3) x k=0's cost, emitting what k=3's drafts at position 0 say.
        assert est[1][1] == pytest.approx((4 + per_pos[0]) / 4 / (0.010 * 2 ** (1 / 3)))
        assert policy.bandit.best(0) == best
    # Without a k=0 pull nothing prices the arms below the largest: they stay unvalued.
    policy = AdaptiveSDPolicy(SDPolicyConfig(threshold=8, steps_per_pull=2,
                                             bandit=BanditConfig(bucket_edges=(1,), start="largest")), max_k=3, max_batch=8)
    _pull(policy, 3, (0, 0, 0), 0.020, 0.0)
    assert [v is None for _, v in policy.bandit.estimates(0).values()] == [True, True, True, False]


@pytest.mark.parametrize("values", ["paired", "pull"])
def test_a_pushed_drafter_is_measured_again_and_sd_comes_back(values):
    """With a drafter that accepts nothing every bucket turns SD off; a different drafter pushed puts
    every bucket on the largest k for one pull, and if its drafts are accepted SD stays on. The same
    drafter pushed again (a resume) changes nothing; the drafter a state learned with is saved."""
    cfg = SDPolicyConfig(threshold=8, steps_per_pull=2, values=values,
                         bandit=BanditConfig(bucket_edges=(1, 4), seed=0, start="each"))
    policy = AdaptiveSDPolicy(cfg, max_k=3, max_batch=8)
    t = 0.0
    for _ in range(12):  # k costs (1 + k/3) x a plain step; nothing is accepted
        for batch in (2, 4):
            k = policy.arm(policy.bandit.bucket_of(batch))
            _pull(policy, k, (0, 0, 0), 0.010 * (1 + k / 3), t, batch=batch)
            t += 0.05
    assert [policy.bandit.best(b) for b in (0, 1)] == [0, 0]
    assert policy.drafter_pushed("c" * 64) and [policy.arm(b) for b in (0, 1)] == [3, 3]
    assert policy.drafter_pushed("c" * 64) is False
    assert all(v is None for b in (0, 1) for k, (_, v) in policy.bandit.estimates(b).items() if k > 0)
    assert all(policy.bandit.estimates(b)[0][1] is not None for b in (0, 1))  # k=0 keeps its value
    saved = json.loads(json.dumps(policy.state_dict()))
    assert saved["drafter"] == "c" * 64
    for batch in (2, 4):  # the new drafter: 3 of 3 drafts accepted
        _pull(policy, 3, (batch,) * 3, 0.020, t + 10, batch=batch)
        # What k=3 emits is the new drafter's alone: 4 tokens a request-step, at 2x k=0's cost.
        assert policy.bandit.estimates(policy.bandit.bucket_of(batch))[3][1] == pytest.approx(4 / 0.020)
    t += 10.1
    for _ in range(6):
        for batch in (2, 4):
            k = policy.arm(policy.bandit.bucket_of(batch))
            _pull(policy, k, (batch,) * 3, 0.010 * (1 + k / 3), t, batch=batch)
            t += 0.05
    assert [policy.bandit.best(b) for b in (0, 1)] == [3, 3]
    resumed = AdaptiveSDPolicy(cfg, max_k=3, max_batch=8)
    resumed.load_state_dict(saved)
    arms = [resumed.arm(b) for b in (0, 1)]
    assert resumed.drafter_pushed("c" * 64) is False and [resumed.arm(b) for b in (0, 1)] == arms


def test_paired_values_compare_costs_at_the_batch_sizes_both_pulls_ran():
    """The batch falls from 10 to 5 at the end of a k=3 pull; k=2 is tried next, at batch 5. A step
    at batch 10 costs more than one at 5, so over the pulls' mean step costs k=2 (2.35 tokens a
    request, 9.5 ms) looks cheaper than k=3 (2.6, 9.0 ms at batch 5 but 12 ms at 10) and wins; at
    their common batch size k=3 is the cheaper and better arm."""
    cfg = SDPolicyConfig(threshold=16, steps_per_pull=8, bandit=BanditConfig(bucket_edges=(1,), arms=(0, 2, 3)))
    policy = AdaptiveSDPolicy(cfg, max_k=3, max_batch=16)

    def step(batch, k, per_pos, step_s, t):
        return StepMetric(batch=batch, k=k, prefill_reqs=0, drafted_reqs=batch, draft_tokens=k * batch,
                          accepted_per_pos=per_pos, emitted=batch + sum(per_pos[:k]), step_s=step_s, t=t)

    policy._arm[0] = 3
    policy.observe([step(10, 3, (8, 5, 3), 0.012, 0.1 + 0.01 * i) for i in range(7)] + [step(5, 3, (4, 3, 1), 0.009, 0.2)])
    policy._arm[0] = 2
    policy.observe([step(5, 2, (4, 3, 0), 0.0095, 0.3 + 0.01 * i) for i in range(8)])
    est = policy.bandit.estimates(0)
    a2 = ((7 * 23 + 12) / 75 + 12 / 5) / 2  # k=2's tokens a request: implied by the k=3 pull, then its own
    assert est[2][1] == pytest.approx(a2 / 0.0095) and est[3][1] == pytest.approx(2.6 / 0.009)
    assert policy.bandit.best(0) == 3


def test_paired_values_take_the_batch_fall_out_of_pulls_with_no_common_batch_size():
    """In a wide bucket the batch falls at every step: a k=3 pull runs at batch 24..17, the k=2 pull
    after it at 16..9, no batch size in common. A step costs batch^0.6 x (1 + 0.1 k), so at equal
    batch k=3 is the better arm (2.9 tokens a request for 1.3 against 2.5 for 1.2); over mean step
    costs k=2 looks 25% cheaper than it is and wins. The slope fitted within the pulls takes the
    batch difference out: both arms priced as at the same batch, k=3 kept."""
    def run(slope_fit: bool):
        cfg = SDPolicyConfig(threshold=32, steps_per_pull=8,
                             bandit=BanditConfig(bucket_edges=(1, 8), arms=(0, 2, 3)))
        policy = AdaptiveSDPolicy(cfg, max_k=3, max_batch=32)
        if not slope_fit:
            policy.values.batch_slope = lambda bucket: 0.0
        t = 0.0
        for k, batches in ((3, range(24, 16, -1)), (2, range(16, 8, -1))):
            policy._arm[1] = k
            steps = []
            for b in batches:
                step_s = 0.001 * b ** 0.6 * (1 + 0.1 * k)
                t += step_s
                per_pos = (0.9 * b, 0.6 * b, 0.4 * b)
                steps.append(StepMetric(batch=b, k=k, prefill_reqs=0, drafted_reqs=b, draft_tokens=k * b,
                                        accepted_per_pos=per_pos, emitted=b + sum(per_pos[:k]), step_s=step_s, t=t))
            policy.observe(steps)
        return policy

    policy = run(slope_fit=True)
    assert policy.values.batch_slope(1) == pytest.approx(0.6, abs=1e-6)
    est = policy.bandit.estimates(1)
    # Tokens a request: k=3 2.9 (its pull), k=2 2.5 (implied by the k=3 pull and its own).
    assert est[3][1] / est[2][1] == pytest.approx((2.9 / 1.3) / (2.5 / 1.2), rel=0.01)
    assert policy.bandit.best(1) == 3
    biased = run(slope_fit=False)
    assert biased.bandit.best(1) == 2, biased.bandit.estimates(1)


def test_paired_values_keep_arms_valued_across_a_rollout_boundary():
    """The batch-1 bucket sees a few pulls at the end of each rollout. k=3 and k=2 are compared in
    one tail (k=3 the better); the next tail starts with an exploring pull of k=0, which nothing
    links to them. Were only the arms linked to the latest pull valued, k=0 would be the bucket's
    only valued arm and its greedy one; k=3 keeps its value from its own group and stays greedy."""
    def run(keep_groups: bool):
        cfg = SDPolicyConfig(threshold=8, steps_per_pull=2, bandit=BanditConfig(bucket_edges=(1, 2), arms=(0, 1, 2, 3)))
        policy = AdaptiveSDPolicy(cfg, max_k=3, max_batch=8)
        if not keep_groups:
            latest_only = policy.values._anchors
            policy.values._anchors = lambda bucket: latest_only(bucket)[:1]

        def pull(k, step_s, t0):
            per_pos = (0.9, 0.8, 0.7)
            m = StepMetric(batch=1, k=k, prefill_reqs=0, drafted_reqs=1 if k else 0, draft_tokens=k,
                           accepted_per_pos=per_pos, emitted=1 + sum(per_pos[:k]), step_s=step_s, t=t0)
            policy._arm[0] = k
            policy.observe([m, StepMetric(**{**vars(m), "t": t0 + step_s})])

        pull(3, 0.0060, 0.0)     # 3.4 tokens for 6 ms
        pull(2, 0.0055, 0.02)    # 2.7 tokens for 5.5 ms
        pull(0, 0.0040, 30.0)    # the next rollout: 1 token for 4 ms
        return policy

    policy = run(keep_groups=True)
    est = policy.bandit.estimates(0)
    assert est[3][1] == pytest.approx(3.4 / 0.006) and est[2][1] == pytest.approx(2.7 / 0.0055)
    assert est[0][1] == pytest.approx(1 / 0.004) and est[1][1] is None   # never pulled: no cost
    assert policy.bandit.best(0) == 3
    assert run(keep_groups=False).bandit.best(0) == 0


def _burst_run(values: str, steps_per_pull: int, factor: float, burst_at: int = 7, rule: bool = True):
    """Batch 1, eight steps of k=3 (3.4 tokens a step for 6.0 ms), then eight of k=2 (2.9 for 5.3 ms):
    k=3 is the better arm (567 tokens a second against 547). Step `burst_at` of k=3 takes `factor`
    times as long: another process's burst on the shared cores. `rule=False`: no outlier rule."""
    from tlt_verl.rollout.policy import sd_policy

    cfg = SDPolicyConfig(threshold=8, steps_per_pull=steps_per_pull, values=values,
                         bandit=BanditConfig(bucket_edges=(1, 2), arms=(0, 2, 3)))
    policy = AdaptiveSDPolicy(cfg, max_k=3, max_batch=8)
    t = 0.0
    with pytest.MonkeyPatch.context() as mp:
        if not rule:
            mp.setattr(sd_policy, "STEP_OUTLIER", float("inf"))
        for k, tokens, step_s in ((3, 3.4, 0.006), (2, 2.9, 0.0053)):
            for i in range(8):
                policy._arm[0] = k  # the arm the test plays, as if the bandit had picked it
                s = step_s * (factor if k == 3 and i == burst_at else 1)
                t += s
                policy.observe([_step(1, k, tokens, s, t=t)])
    return policy.bandit


@pytest.mark.parametrize("values", ["paired", "pull"])
@pytest.mark.parametrize("steps_per_pull", [1, 2, 8])
@pytest.mark.parametrize("factor", [4, 30])
def test_a_burst_on_the_shared_cores_does_not_decide_the_arm(values, steps_per_pull, factor):
    """The burst is in k=3's last step, next to k=2's first pull. Costed as it ran, k=3 loses to
    k=2; costed as the median step of k=3 (its pull's, or at steps_per_pull <= 2, where a pull's
    median contains the burst, of its latest steps in the bucket), k=3 keeps its value. A 4x burst
    is just over the rule's 3x factor."""
    bandit = _burst_run(values, steps_per_pull, factor)
    # k=2's tokens a step: its own 2.9 (and, valued in pairs, the 3.0 the k=3 pulls imply, as many
    # steps of each)
    a2 = 2.9 if values == "pull" else (3.0 + 2.9) / 2
    assert bandit.estimates(0)[3][1] == pytest.approx(3.4 / 0.006)
    assert bandit.estimates(0)[2][1] == pytest.approx(a2 / 0.0053) and bandit.best(0) == 3
    burst = _burst_run(values, steps_per_pull, factor, rule=False)
    assert burst.estimates(0)[3][1] < 3.4 / 0.006 and burst.best(0) == 2, burst.estimates(0)


def test_a_burst_in_an_arms_first_two_step_pull_is_told():
    """The arm's first pull in the rollout has no earlier steps to compare with: of its two steps,
    one a 4x burst, the lower one is the reference."""
    bandit = _burst_run("pull", 2, 4, burst_at=0)
    assert bandit.estimates(0)[3][1] == pytest.approx(3.4 / 0.006) and bandit.best(0) == 3
    burst = _burst_run("pull", 2, 4, burst_at=0, rule=False)
    assert burst.estimates(0)[3][1] == pytest.approx((3 * 3.4 / 0.006 + 3.4 / 0.015) / 4) and burst.best(0) == 2


def test_the_outlier_reference_starts_over_at_a_rollout_boundary():
    """Steps of an earlier rollout (other contexts, other costs) are not the reference: a k=3 step
    4x the cost of the last rollout's is costed as it ran when it is the arm's only step since."""
    cfg = SDPolicyConfig(threshold=8, steps_per_pull=1, values="pull",
                         bandit=BanditConfig(bucket_edges=(1, 2), arms=(0, 2, 3)))
    policy = AdaptiveSDPolicy(cfg, max_k=3, max_batch=8)
    t = 0.0
    for step_s in [0.006] * 4 + [None, 0.024]:
        if step_s is None:
            t += 30.0  # the RL step's training between rollouts
            continue
        policy._arm[0] = 3
        t += step_s
        policy.observe([_step(1, 3, 3.4, step_s, t=t)])
    assert policy.bandit.estimates(0)[3][1] == pytest.approx((4 * 3.4 / 0.006 + 3.4 / 0.024) / 5)
    state = json.loads(json.dumps(policy.state_dict()))
    other = AdaptiveSDPolicy(cfg, max_k=3, max_batch=8)
    other.load_state_dict(state)
    assert other.state_dict() == policy.state_dict()


def _tail(values: str, per_pos: tuple[int, ...], rollouts: int, pulls: int = 40, force=None) -> list[int]:
    """Arms played in a bucket at batch 10 through rollouts whose step cost triples from the first pull
    to the last (contexts grow) and starts over at the next; a step of arm k costs (1 + 0.3 k) plain
    steps. `force` maps (rollout, pull) to the arm to play instead of the bandit's. Returns the arms."""
    cfg = SDPolicyConfig(threshold=16, steps_per_pull=4, values=values,
                         bandit=BanditConfig(bucket_edges=(1,), arms=(0, 1, 2, 3), seed=0))
    policy = AdaptiveSDPolicy(cfg, max_k=3, max_batch=16)
    played, t = [], 0.0
    for r in range(rollouts):
        t += 30.0  # the RL step's training between rollouts
        for p in range(pulls):
            k = policy._arm[0] = (force or {}).get((r, p), policy.arm(0))
            played.append(k)
            base = 0.01 * (1 + 2 * p / pulls)
            for _ in range(4):
                t += base
                policy.observe([StepMetric(batch=10, k=k, prefill_reqs=0, drafted_reqs=10 if k else 0,
                                           draft_tokens=10 * k, accepted_per_pos=per_pos,
                                           emitted=10 + sum(per_pos[:k]), step_s=base * (1 + 0.3 * k), t=t)])
    return played, policy.bandit


def test_paired_values_compare_arms_at_the_same_conditions():
    """k=3 is worth 1.79 plain steps' tokens, k=2 1.69 (9, 8, 7 of 10 drafts accepted per position).
    One k=2 pull early in a rollout, k=3 before and after it: as a pull reward, k=2's is measured at
    the cheap start and k=3's over the whole rollout, and k=2 becomes the greedy arm. Paired values
    price k=2 against the k=3 pulls beside it and keep k=3."""
    force = {(0, p): 3 for p in range(40)} | {(0, 1): 2}
    for values, best in (("paired", 3), ("pull", 2)):
        _, bandit = _tail(values, (9, 8, 7), rollouts=1, force=force)
        assert bandit.best(0) == best, (values, bandit.estimates(0))
    # Left to the bandit, paired values stay on k=3 but for exploration; where drafts are mostly
    # rejected (5, 2, 1 of 10: k=1 is worth 1.15, k=3 0.95) they move to k=1.
    for per_pos, best in (((9, 8, 7), 3), ((5, 2, 1), 1)):
        played, _ = _tail("paired", per_pos, rollouts=12)
        later = played[len(played) // 4:]
        assert sum(k == best for k in later) / len(later) >= 0.9, (per_pos, later)


def test_replicas_pool_into_one_summary():
    """verl's metrics pool the replicas' summaries: a replica that only decoded plainly (its tail
    stayed above the threshold) adds decode steps and tokens, not an acceptance length of 0. Found
    in a TLT run: weighting each replica's rate by its decode steps reported 0.96."""
    from tlt_verl.rollout.engine.sd_loop import pool, summarize

    accepted = StepMetric(batch=2, k=2, prefill_reqs=0, drafted_reqs=2, draft_tokens=4, accepted_per_pos=(2, 1),
                          emitted=5, step_s=0.02)
    drafting = summarize([accepted, _step(4, 0, 4, 0.01)])
    plain = summarize([_step(8, 0, 8, 0.01)] * 3)
    assert drafting["acceptance_length"] == pytest.approx(2.5) and plain["acceptance_length"] == 0.0
    both = pool([drafting, plain])
    assert both["acceptance_length"] == pytest.approx(2.5)
    assert both["sd_step_share"] == pytest.approx(1 / 5)
    assert both["decode_tokens_per_s"] == pytest.approx((5 + 4 + 24) / 0.06)
    assert pool([plain])["acceptance_length"] == 0.0 and pool([])["decode_steps"] == 0.0

# ---------------------------------------------------------------------------------------------
# Engine side (runs in the subprocess)

def _counters() -> dict:
    from vllm.v1.metrics.reader import get_metrics_snapshot

    return spec_decode_counters(get_metrics_snapshot())


async def _scenario(target: str, drafter: str, random_drafter: str, bad: dict[str, str], alt_target: str) -> dict:
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from tlt_verl.rollout.engine import sd_control
    from tlt_verl.rollout.engine.drafter_push import DrafterManifest, push_drafter_async
    from tlt_verl.rollout.engine.offline import use_engine_env
    from tlt_verl.rollout.engine.server import DEFAULT_CPU_KV_CACHE_BYTES, start_engine

    use_engine_env()
    spec = {"method": "eagle", "model": drafter, "num_speculative_tokens": K,
            "num_speculative_tokens_per_batch_size": [[1, MAX_SEQS, K]]}
    t0 = time.time()
    engine = start_engine(dict(
        model=target, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, seed=0, max_model_len=128,
        max_num_seqs=MAX_SEQS, max_num_batched_tokens=2048, kv_cache_memory_bytes=DEFAULT_CPU_KV_CACHE_BYTES,
        speculative_config=spec, disable_log_stats=False,
        worker_extension_cls="tlt_verl.rollout.engine.worker_extension.TLTWorkerExtension"))
    res: dict = {"timings": {"engine_start": time.time() - t0}}
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 128, (8,), generator=g).tolist() for _ in MAX_TOKENS]
    calls = 0

    async def one(i, p, n, progress):
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
        final = None
        async for out in engine.generate(TokensPrompt(prompt_token_ids=p), sp, f"r{calls}-{i}"):
            final = out
            progress[i] = len(out.outputs[0].token_ids)
        return list(final.outputs[0].token_ids)

    async def generate(name, during=None):
        nonlocal calls
        calls += 1
        before, t = _counters(), time.time()
        progress = [0] * len(prompts)
        tasks = [asyncio.create_task(one(i, p, n, progress)) for i, (p, n) in enumerate(zip(prompts, MAX_TOKENS))]
        if during is not None:
            while max(progress) < 8:  # mid-generation: every request has started decoding
                await asyncio.sleep(0.002)
            res.setdefault("progress_at_push", {})[name] = list(progress)
            await during()
        tokens = await asyncio.gather(*tasks)
        res["timings"][name] = time.time() - t
        await asyncio.sleep(0.3)  # let the last stats reach the Prometheus logger
        res.setdefault("counters", {})[name] = counter_delta(_counters(), before)
        res.setdefault("steps", {})[name] = [vars(m) for m in await sd_control.take_sd_metrics_async(engine)]
        res.setdefault("tokens", {})[name] = tokens
        return tokens

    async def checksum(which):
        return (await engine.collective_rpc("tlt_weights_checksum", args=(which,)))[0]

    try:
        manifest = DrafterManifest.from_folder(drafter)
        await sd_control.take_sd_metrics_async(engine)  # warm-up steps of the engine start
        await generate("k3")
        res["schedule_k0"] = await sd_control.set_sd_schedule_async(engine, [[1, MAX_SEQS, 0]])
        await generate("k0")
        await sd_control.set_sd_schedule_async(engine, [[1, 2, 2], [3, MAX_SEQS, 1]])
        await generate("k_by_batch")
        await sd_control.set_sd_schedule_async(engine, [[1, MAX_SEQS, K]])

        res["sha_start"] = {"drafter": await checksum("drafter"), "target": await checksum("target")}

        async def push_random():
            t = time.time()
            res["sha_random"] = await push_drafter_async(engine, manifest, os.path.join(random_drafter, "model.safetensors"))
            res["timings"]["push"] = time.time() - t

        await generate("push_during", during=push_random)
        await generate("random_drafter")
        res["sha_back"] = await push_drafter_async(engine, manifest, os.path.join(drafter, "model.safetensors"))
        await generate("bigram_again")

        res["rejected"] = {}
        for name, path in bad.items():
            try:
                await push_drafter_async(engine, manifest, path)
                res["rejected"][name] = None
            except ValueError as e:
                res["rejected"][name] = str(e)
        # The worker's own check, reached without the driver's (a file that changed after it).
        res["worker_refusal"] = (await engine.collective_rpc(
            "tlt_reload_drafter_weights", args=(bad["corrupt"], manifest.tensors)))[0]
        res["sha_after_rejects"] = await checksum("drafter")
        await generate("after_rejects")

        t = time.time()
        from tlt_verl.rollout.engine.weight_sync import send_weights
        from safetensors.torch import load_file

        # Through verl's bucketed transport, as the rollout server's weight sync does.
        await send_weights(engine.collective_rpc, load_file(os.path.join(alt_target, "model.safetensors")).items())
        res["timings"]["target_reload"] = time.time() - t
        res["sha_alt_target"] = {"drafter": await checksum("drafter"), "target": await checksum("target")}
        await generate("alt_target")
        await send_weights(engine.collective_rpc, load_file(os.path.join(target, "model.safetensors")).items())
        res["sha_target_back"] = {"drafter": await checksum("drafter"), "target": await checksum("target")}
        await generate("target_back")
    finally:
        engine.shutdown()
    return res


def _main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    m = json.loads(Path(args.models).read_text())
    res = asyncio.run(_scenario(m["target"], m["drafter"], m["random_drafter"], m["bad"], m["alt_target"]))
    Path(args.out).write_text(json.dumps(res))


# ---------------------------------------------------------------------------------------------
# Engine tests

def _write_models(root: Path) -> dict:
    import shutil

    import torch
    from _drafters import write_eagle1_drafter, write_target
    from safetensors.torch import load_file, save_file

    target = write_target(str(root / "target"))
    drafter = write_eagle1_drafter(target, str(root / "drafter"), bigram=True)
    random_drafter = write_eagle1_drafter(target, str(root / "random"), bigram=False)
    w = load_file(os.path.join(drafter, "model.safetensors"))
    bad_dir = root / "bad"
    bad_dir.mkdir()
    bad = {}

    def variant(name, state):
        bad[name] = str(bad_dir / f"{name}.safetensors")
        save_file(state, bad[name])

    variant("wrong_shape", {**w, "fc.weight": torch.zeros(128, 128)})
    variant("wrong_dtype", {k: v.half() for k, v in w.items()})
    variant("missing", {k: v for k, v in w.items() if k != "layers.0.mlp.up_proj.weight"})
    variant("extra", {**w, "layers.1.mlp.up_proj.weight": w["layers.0.mlp.up_proj.weight"].clone()})
    variant("target_owned", {**w, "embed_tokens.weight": torch.zeros(128, 128)})
    variant("nonfinite", {**w, "fc.weight": torch.full_like(w["fc.weight"], float("nan"))})
    raw = Path(drafter, "model.safetensors").read_bytes()
    bad["corrupt"] = str(bad_dir / "corrupt.safetensors")
    Path(bad["corrupt"]).write_bytes(raw[: len(raw) // 2])
    bad["garbage"] = str(bad_dir / "garbage.safetensors")
    Path(bad["garbage"]).write_bytes(b"\xff" * 64)
    # Another target: the same weights with the LM head rows reversed (greedy output changes).
    alt = root / "alt_target"
    shutil.copytree(target, alt)
    tw = load_file(os.path.join(target, "model.safetensors"))
    tw["lm_head.weight"] = tw["lm_head.weight"].flip(0).contiguous()
    save_file(tw, str(alt / "model.safetensors"), metadata={"format": "pt"})
    return {"target": target, "drafter": drafter, "random_drafter": random_drafter, "bad": bad, "alt_target": str(alt)}


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    root = tmp_path_factory.mktemp("adaptive")
    models = _write_models(root)
    (root / "models.json").write_text(json.dumps(models))
    scratch = root / "scratch"
    (scratch / "tmp").mkdir(parents=True)
    env = dict(os.environ, TLT_SCRATCH=str(scratch), TMPDIR=str(scratch / "tmp"), PYTHONUNBUFFERED="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="1")
    t0 = time.time()
    proc = subprocess.run([sys.executable, __file__, "--models", str(root / "models.json"), "--out", str(root / "out.json")],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads((root / "out.json").read_text())
    res["timings"]["subprocess"] = time.time() - t0
    print("\n[adaptive] timings", json.dumps({k: round(v, 2) for k, v in res["timings"].items()}))
    return res


def _decode_steps(res, name):
    return [s for s in res["steps"][name] if s["prefill_reqs"] == 0]


@pytest.mark.slow
def test_schedule_change_changes_k_used(scenario):
    res = scenario
    k3, k0, kb = (_decode_steps(res, n) for n in ("k3", "k0", "k_by_batch"))
    assert k3 and all(s["k"] == K for s in k3) and sum(s["draft_tokens"] for s in k3) > 0
    assert res["counters"]["k3"]["drafts"] > 0
    # k=0: nothing drafted, nothing verified, in our records and in vLLM's own counters.
    assert res["schedule_k0"] == [[1, MAX_SEQS, 0]]
    assert all(s["k"] == 0 for s in res["steps"]["k0"])
    assert sum(s["draft_tokens"] for s in res["steps"]["k0"]) == 0
    assert res["counters"]["k0"]["drafts"] == 0 and res["counters"]["k0"]["draft_tokens"] == 0
    # By batch size: k=1 at 3-4 running requests, k=2 at 1-2.
    assert {s["batch"] for s in kb} >= {1, 2, 3, 4}
    for s in kb:
        assert s["k"] == (1 if s["batch"] >= 3 else 2), s
    steady = [s for s in kb if s["draft_tokens"] == s["k"] * s["batch"]]
    assert len(steady) >= len(kb) - 3  # only the steps where the batch crossed a range differ
    assert all(sum(s["accepted_per_pos"][1:]) == 0 for s in kb if s["k"] == 1)
    # Greedy output never depends on k.
    for name in ("k0", "k_by_batch"):
        assert res["tokens"][name] == res["tokens"]["k3"], name
    # Records add up to what was generated, and feed the policy.
    assert sum(s["emitted"] for s in res["steps"]["k3"]) == sum(MAX_TOKENS)
    assert all(s["step_s"] > 0 for s in res["steps"]["k3"])
    policy = AdaptiveSDPolicy(SDPolicyConfig(threshold=8, steps_per_pull=2,
                                             bandit=BanditConfig(bucket_edges=(1, 2, 4), start="each")),  # k=0 first
                              max_k=K, max_batch=MAX_SEQS)
    policy.observe(res["steps"]["k0"])
    assert policy.bandit.estimates(0)[0][0] + policy.bandit.estimates(1)[0][0] > 0


def _acceptance(counters):
    return counters["accepted_tokens"] / max(counters["draft_tokens"], 1)


@pytest.mark.slow
def test_drafter_push_during_generation(scenario):
    res = scenario
    assert 0 < max(res["progress_at_push"]["push_during"]) < max(MAX_TOKENS)
    assert res["tokens"]["push_during"] == res["tokens"]["k3"]  # temperature 0: unchanged
    assert res["tokens"]["random_drafter"] == res["tokens"]["k3"]
    assert res["sha_random"] != res["sha_start"]["drafter"]
    assert res["sha_back"] == res["sha_start"]["drafter"]  # read back exactly what was loaded
    bigram, rand = _acceptance(res["counters"]["k3"]), _acceptance(res["counters"]["random_drafter"])
    assert bigram > 0.2 and rand < bigram / 2, (bigram, rand)
    assert res["counters"]["bigram_again"] == res["counters"]["k3"]


@pytest.mark.slow
def test_rejected_push_leaves_old_drafter_serving(scenario):
    res = scenario
    for name, err in res["rejected"].items():
        assert err is not None, f"{name} was accepted"
        assert "\n" not in err and err.startswith("drafter weights"), err
    assert "fc.weight" in res["rejected"]["wrong_shape"] and "float16" in res["rejected"]["wrong_dtype"]
    assert "up_proj" in res["rejected"]["missing"] and "layers.1" in res["rejected"]["extra"]
    assert "shares with the target" in res["rejected"]["target_owned"]
    assert "non-finite" in res["rejected"]["nonfinite"] and "truncated" in res["rejected"]["corrupt"]
    assert res["worker_refusal"]["ok"] is False and "\n" not in res["worker_refusal"]["error"]
    assert res["sha_after_rejects"] == res["sha_start"]["drafter"]
    assert res["tokens"]["after_rejects"] == res["tokens"]["k3"]
    assert res["counters"]["after_rejects"] == res["counters"]["k3"]  # same acceptance, to the token


@pytest.mark.slow
def test_target_reload_leaves_drafter_untouched(scenario):
    res = scenario
    start = res["sha_start"]
    assert res["sha_alt_target"]["target"] != start["target"]
    assert res["sha_alt_target"]["drafter"] == start["drafter"]
    assert res["tokens"]["alt_target"] != res["tokens"]["k3"]  # the new target is serving
    assert res["sha_target_back"] == start
    assert res["tokens"]["target_back"] == res["tokens"]["k3"]


def test_manifest_checks_without_engine(tmp_path):
    from tlt_verl.rollout.engine.drafter_push import DrafterManifest

    models = _write_models(tmp_path)
    manifest = DrafterManifest.from_folder(models["drafter"])
    manifest.check(os.path.join(models["random_drafter"], "model.safetensors"))
    for name, path in models["bad"].items():
        with pytest.raises(ValueError) as e:
            manifest.check(path)
        assert "\n" not in str(e.value), name
    with pytest.raises(ValueError, match="no config.json"):
        DrafterManifest.from_folder(tmp_path / "bad")


if __name__ == "__main__":
    _main()
