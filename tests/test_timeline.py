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


def test_seconds_in_flight_split_the_window_by_how_many_requests_run():
    # in flight: 0-1 s one, 1-2 two, 2-3 three, 3-4 two, 4-5 one, 5-6 two, 6-7 one
    events = [_ev(0, 0, 0.0, 4.0, 9), _ev(0, 0, 1.0, 3.0, 9), _ev(1, 0, 2.0, 6.0, 9), _ev(1, 0, 5.0, 7.0, 9)]
    w = timeline.rollout_windows(events)[1]
    assert [w.seconds_in_flight(n) for n in (1, 2, 3, 4)] == pytest.approx([7.0, 4.0, 1.0, 0.0])
    assert w.crowded_seconds() == pytest.approx(7.0)  # a quarter of 4 requests: one
    many = [_ev(0, 0, 0.0, 1.0, 5) for _ in range(7)] + [_ev(1, 0, 0.0, 9.0, 500)]
    assert timeline.rollout_windows(many)[1].crowded_seconds() == pytest.approx(1.0)  # 2+ of 8 until t=1


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


def test_bench_report_from_a_finished_run(tmp_path):
    """`tlt bench --from-run` turns a run folder into the JSON report and its two plots."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.run_recipe import main

    run_dir = tmp_path / "run"
    (run_dir / "timeline").mkdir(parents=True)
    events = [_ev(0, 0, 0.0, 2.0, 20), _ev(1, 0, 0.0, 10.0, 400), _ev(0, 1, 20.0, 21.0, 30), _ev(1, 1, 20.0, 25.0, 300)]
    for r in (0, 1):
        (run_dir / "timeline" / f"replica_{r}.jsonl").write_text(
            "".join(json.dumps(e) + "\n" for e in events if e["replica"] == r))
    steps = [dict(step=i + 1, reward_mean=0.1 * i, gen_s=g, step_s=g + 3.0, rollout_window_s=g,
                  replica_idle_fraction=0.4) for i, g in enumerate((10.0, 5.0))]
    (run_dir / "steps.json").write_text(json.dumps({"summary": {**summarize(steps), "run_dir": str(run_dir)},
                                                    "steps": steps}))
    out = tmp_path / "out" / "report.json"
    assert main(["--from-run", str(run_dir), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["response_length"]["max"] == 400 and report["response_length"]["n"] == 4
    assert report["summary"]["rollout_share"] == pytest.approx(5 / 8)
    for png in (out.with_suffix(".png"), out.with_name("report_steps.png")):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
