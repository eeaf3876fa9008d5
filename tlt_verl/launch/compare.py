"""Side by side: the same recipe, seed and data run in several arms (TLT, stock verl, a frozen
drafter), one after the other, and the ratios between them.

`./tlt run --compare` runs TLT and the baseline; bench/tlt_e2e.py adds the frozen drafter.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np

from tlt_verl.launch.runner import RunConfig, run

# Steps before this one pay the start-up (first engine steps, lazy imports, a drafter that has
# not seen a long tail yet); the issue's ratios are the mean over steps 5 to the last.
FIRST_MEASURED_STEP = 5


def measured(steps: list[dict], first: int = FIRST_MEASURED_STEP) -> list[dict]:
    sel = [s for s in steps if s["step"] >= first]
    return sel or steps[1:] or steps


def _mean(steps: list[dict], key: str) -> float:
    return float(np.mean([s[key] for s in steps]))


def ratio(slow: list[dict], fast: list[dict], key: str, first: int = FIRST_MEASURED_STEP) -> float:
    """mean(slow[key]) / mean(fast[key]) over the measured steps: > 1 means `fast` is faster."""
    return _mean(measured(slow, first), key) / _mean(measured(fast, first), key)


def reward_gap(a: list[dict], b: list[dict]) -> dict:
    """Mean per-step reward difference a - b and its standard error (steps paired by number)."""
    rb = {s["step"]: s["reward_mean"] for s in b}
    d = np.array([s["reward_mean"] - rb[s["step"]] for s in a if s["step"] in rb])
    se = float(d.std(ddof=1) / np.sqrt(d.size)) if d.size > 1 else float("nan")
    return {"mean_diff": float(d.mean()), "stderr": se, "within_2se": bool(abs(d.mean()) <= 2 * se) if d.size > 1 else None}


def run_arms(base: RunConfig, arms: dict[str, dict], out_dir: Path,
             say: Callable[..., None] = print) -> dict[str, dict]:
    """Run each arm (RunConfig fields to change) in `out_dir/<arm>`, one after the other."""
    results = {}
    for name, changes in arms.items():
        say(f"tlt-verl: --- arm '{name}' ---", flush=True)
        results[name] = run(replace(base, run_dir=out_dir / name, **changes))
    return results


def tlt_vs_baseline(results: dict[str, dict], tlt: str = "tlt", baseline: str = "baseline") -> dict:
    t, b = results[tlt]["steps"], results[baseline]["steps"]
    # On the critical path: stopping the drafter and pushing it, and what it costs the actor's own
    # process (capture in the update, the hand-overs).
    crit = [(s["tlt"]["critical_path_s"] + s["tlt"].get("host_s", 0.0)) / s["step_s"] for s in measured(t) if s.get("tlt")]
    return {
        "measured_steps": [s["step"] for s in measured(t)],
        "step_time_ratio": ratio(b, t, "step_s"),
        "rollout_time_ratio": ratio(b, t, "gen_s"),
        "mean_step_s": {baseline: _mean(measured(b), "step_s"), tlt: _mean(measured(t), "step_s")},
        "mean_gen_s": {baseline: _mean(measured(b), "gen_s"), tlt: _mean(measured(t), "gen_s")},
        "reward": {baseline: [s["reward_mean"] for s in b], tlt: [s["reward_mean"] for s in t],
                   "gap": reward_gap(t, b)},
        "drafter_critical_path_share": float(np.mean(crit)) if crit else 0.0,
        "rollout_phase_ratio": phase_ratios(b, t),
    }


# The rollout window in two phases (timeline.crowded_seconds): where its time is won or lost.
ROLLOUT_PHASES = ("crowded", "tail")


def phase_ratios(slow: list[dict], fast: list[dict], first: int = FIRST_MEASURED_STEP) -> dict[str, float]:
    """`ratio` of each rollout phase's seconds, for the phases both runs' steps record."""
    return {p: ratio(slow, fast, f"rollout_{p}_s", first) for p in ROLLOUT_PHASES
            if all(f"rollout_{p}_s" in s for s in measured(slow, first) + measured(fast, first))}


def format_comparison(c: dict) -> str:
    g = c["reward"]["gap"]
    return (f"tlt-verl: baseline/TLT over steps {c['measured_steps'][0]}-{c['measured_steps'][-1]}:"
            f" step time {c['step_time_ratio']:.2f}x, rollout time {c['rollout_time_ratio']:.2f}x"
            f" | reward TLT-baseline {g['mean_diff']:+.3f} (s.e. {g['stderr']:.3f})"
            f" | drafter on the critical path {c['drafter_critical_path_share']:.1%} of step time"
            + "".join(f" | {phase} rollout {r:.2f}x" for phase, r in c.get("rollout_phase_ratio", {}).items()))


def plot_arms(results: dict[str, dict], png: Path, title: str) -> Path:
    """Step time, rollout time, reward and acceptance length per step, one line per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(17, 3.6))
    panels = [("step_s", "step time (s)"), ("gen_s", "rollout time (s)"), ("reward_mean", "mean reward")]
    for name, res in results.items():
        x = [s["step"] for s in res["steps"]]
        for ax, (key, label) in zip(axes, panels):
            ax.plot(x, [s[key] for s in res["steps"]], marker="o", ms=3, label=name)
            ax.set_ylabel(label)
        acc = [(s["step"], s["tlt"]["acceptance_length"]) for s in res["steps"] if s.get("tlt")]
        if acc:
            axes[3].plot(*zip(*acc), marker="o", ms=3, label=name)
    axes[3].set_ylabel("acceptance length (tokens / SD step)")
    for ax in axes:
        ax.set_xlabel("RL step")
        ax.axvline(FIRST_MEASURED_STEP - 0.5, color="grey", lw=0.5, ls=":")
        ax.legend(fontsize=8, frameon=False)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def compare(base: RunConfig, out_dir: Path, say: Callable[..., None] = print) -> dict:
    """`./tlt run --compare`: TLT, then the same recipe without it; ratios, JSON and PNG."""
    out_dir = Path(out_dir)
    results = run_arms(base, {"tlt": {"tlt": True}, "baseline": {"tlt": False}}, out_dir, say)
    c = tlt_vs_baseline(results)
    (out_dir / "compare.json").write_text(json.dumps({"comparison": c, "arms": results}, indent=2))
    plot_arms(results, out_dir / "compare.png", f"{base.recipe}: TLT vs stock verl, same seed and data")
    say(format_comparison(c))
    say(f"tlt-verl: comparison -> {out_dir / 'compare.json'}, {out_dir / 'compare.png'}")
    return c
