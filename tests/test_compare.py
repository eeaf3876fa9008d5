"""The side-by-side arithmetic of `./tlt run --compare` and bench/tlt_e2e.py."""
import json

import pytest

from tlt_verl.launch.compare import format_comparison, plot_arms, ratio, reward_gap, tlt_vs_baseline


def _steps(step_s, gen_s, rewards, crit=None):
    out = []
    for i, (s, g, r) in enumerate(zip(step_s, gen_s, rewards), start=1):
        rec = {"step": i, "step_s": s, "gen_s": g, "reward_mean": r}
        if crit is not None:
            rec["tlt"] = {"critical_path_s": crit, "acceptance_length": 1.0 + 0.1 * i, "sd_share": 0.5}
        out.append(rec)
    return out


def test_ratios_use_steps_five_to_last():
    # Steps 1-4 are wildly different on purpose: they must not count.
    base = _steps([100, 100, 100, 100, 10, 10, 10], [50, 50, 50, 50, 8, 8, 8], [0.1] * 7)
    tlt = _steps([1, 1, 1, 1, 5, 5, 5], [1, 1, 1, 1, 2, 2, 2], [0.1] * 7, crit=0.1)
    c = tlt_vs_baseline({"tlt": {"steps": tlt}, "baseline": {"steps": base}})
    assert c["measured_steps"] == [5, 6, 7]
    assert c["step_time_ratio"] == pytest.approx(2.0)
    assert c["rollout_time_ratio"] == pytest.approx(4.0)
    assert c["drafter_critical_path_share"] == pytest.approx(0.02)
    # What the drafter costs the actor's own process (capture, hand-overs) is on the path too.
    for s in tlt:
        s["tlt"]["host_s"] = 0.15
    c_host = tlt_vs_baseline({"tlt": {"steps": tlt}, "baseline": {"steps": base}})
    assert c_host["drafter_critical_path_share"] == pytest.approx(0.05)
    assert "step time 2.00x, rollout time 4.00x" in format_comparison(c)
    assert ratio(base, tlt, "step_s", first=1) == pytest.approx(430 / 19)
    assert c["rollout_phase_ratio"] == {}  # runs without request timelines have no phases


def test_rollout_phase_ratios_split_the_window():
    base = _steps([10] * 6, [8] * 6, [0.1] * 6)
    tlt = _steps([6] * 6, [4] * 6, [0.1] * 6, crit=0.0)
    for s in base:
        s.update(rollout_crowded_s=1.0, rollout_tail_s=6.0)
    for s in tlt:
        s.update(rollout_crowded_s=1.0, rollout_tail_s=2.0)
    c = tlt_vs_baseline({"tlt": {"steps": tlt}, "baseline": {"steps": base}})
    assert c["rollout_phase_ratio"] == pytest.approx({"crowded": 1.0, "tail": 3.0})
    assert "crowded rollout 1.00x | tail rollout 3.00x" in format_comparison(c)
    from bench.tlt_e2e import baseline_over_arms

    slow = _steps([12] * 6, [6] * 6, [0.1] * 6, crit=0.0)  # an arm without phases gets none
    r = baseline_over_arms([{"baseline": {"steps": base}, "tlt": {"steps": tlt}, "tlt_fixed_k3": {"steps": slow}}] * 2)
    assert r == {"tlt": pytest.approx({"step": 10 / 6, "rollout": 2.0, "crowded_rollout": 1.0, "tail_rollout": 3.0}),
                 "tlt_fixed_k3": pytest.approx({"step": 10 / 12, "rollout": 8 / 6})}


def test_reward_gap_pairs_steps():
    a = _steps([1] * 4, [1] * 4, [0.5, 0.6, 0.7, 0.8])
    b = _steps([1] * 4, [1] * 4, [0.4, 0.6, 0.6, 0.8])
    g = reward_gap(a, b)
    assert g["mean_diff"] == pytest.approx(0.05)
    assert g["stderr"] == pytest.approx(0.0288675, rel=1e-4)
    assert g["within_2se"] is True
    far = reward_gap(_steps([1] * 4, [1] * 4, [0.9, 0.91, 0.9, 0.92]), b)
    assert far["within_2se"] is False


def test_plot_arms_writes_png(tmp_path):
    res = {"tlt": {"steps": _steps([5] * 6, [2] * 6, [0.1] * 6, crit=0.1)},
           "baseline": {"steps": _steps([6] * 6, [3] * 6, [0.1] * 6)}}
    png = plot_arms(res, tmp_path / "c.png", "t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    json.dumps(tlt_vs_baseline(res))  # the report is JSON as it stands


def test_adaptive_over_frozen_takes_the_arm_that_trains():
    """bench/tlt_e2e.py: where `tlt` does not train its drafter (CPU, train_drafter=auto), the
    adaptive side of adaptive/frozen is `tlt_adaptive`; without it, `tlt`; without a frozen arm, none."""
    from bench.tlt_e2e import pooled, summary

    frozen = _steps([8] * 6, [4] * 6, [0.1] * 6, crit=0.0)
    arms = {"baseline": {"steps": _steps([8] * 6, [4] * 6, [0.1] * 6)},
            "tlt": {"steps": _steps([8] * 6, [4] * 6, [0.1] * 6, crit=0.0)},
            "tlt_adaptive": {"steps": _steps([10] * 6, [5] * 6, [0.1] * 6, crit=0.0)},
            "tlt_frozen_drafter": {"steps": frozen}}
    s = summary(arms)
    assert s["adaptive_vs_frozen_drafter"]["adaptive_arm"] == "tlt_adaptive"
    assert s["adaptive_over_frozen_rollout_speed"] == pytest.approx(0.8)
    assert pooled([arms, arms])["adaptive_over_frozen_rollout_speed"] == pytest.approx(0.8)
    without = {k: v for k, v in arms.items() if k != "tlt_adaptive"}
    assert summary(without)["adaptive_vs_frozen_drafter"]["adaptive_arm"] == "tlt"
    assert summary(without)["adaptive_over_frozen_rollout_speed"] == pytest.approx(1.0)
    no_frozen = {k: v for k, v in arms.items() if k != "tlt_frozen_drafter"}
    assert "adaptive_over_frozen_rollout_speed" not in summary(no_frozen)
    assert "adaptive_over_frozen_rollout_speed" not in pooled([no_frozen])
