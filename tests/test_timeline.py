"""Rollout timeline arithmetic: windows per step, length percentiles, replica idle fraction."""
import pytest

from tlt_verl.launch import timeline
from tlt_verl.launch.runner import summarize


def _ev(replica, step, start, end, n):
    return {"replica": replica, "step": step, "start": start, "end": end, "n_prompt": 10, "n_tokens": n}


def test_idle_fraction_counts_time_a_replica_sat_drained():
    # Step 1 (weights version 0): replica 0 finishes at t=2, replica 1 runs the tail until t=10.
    events = [_ev(0, 0, 0.0, 1.0, 10), _ev(0, 0, 0.0, 2.0, 20), _ev(1, 0, 0.0, 10.0, 400), _ev(1, 0, 0.5, 3.0, 30)]
    w = timeline.rollout_windows(events)[1]
    assert w.seconds == 10.0
    # replica 0 idle 8 of 10 s, replica 1 never: mean 0.4
    assert w.idle_fraction([0, 1]) == pytest.approx(0.4)
    # a replica that got no request at all was idle the whole window
    assert w.idle_fraction([0, 1, 2]) == pytest.approx((0.8 + 0.0 + 1.0) / 3)
    assert w.length_stats()["max"] == 400


def test_windows_are_keyed_by_trainer_step():
    events = [_ev(0, 0, 0, 1, 5), _ev(0, 1, 5, 6, 5), _ev(1, 1, 5, 7, 5)]
    ws = timeline.rollout_windows(events)
    assert sorted(ws) == [1, 2]
    assert ws[2].start == 5 and ws[2].end == 7


def test_summary_skips_warmup_step_for_shares():
    steps = [
        {"reward_mean": -1.0, "gen_s": 1.0, "step_s": 10.0, "rollout_window_s": 1.0, "replica_idle_fraction": 0.0},
        {"reward_mean": 0.0, "gen_s": 8.0, "step_s": 10.0, "rollout_window_s": 4.0, "replica_idle_fraction": 0.5},
        {"reward_mean": 0.5, "gen_s": 6.0, "step_s": 10.0, "rollout_window_s": 2.0, "replica_idle_fraction": 0.2},
    ]
    s = summarize(steps)
    assert s["rollout_share"] == pytest.approx(14 / 20)
    assert s["replica_idle_fraction"] == pytest.approx((0.5 * 4 + 0.2 * 2) / 6)
    assert s["reward_first3"] == pytest.approx(-0.5 / 3)
