"""Benchmark harness: run a recipe for N steps and write what its rollout looked like.

Writes JSON with per-step timings, the response-length distribution, the rollout share of
step time and the replica idle fraction, a PNG of the rollout timeline per replica
(generating vs. drained while another replica still generates) and a PNG of the reward and
the step-time split per step (`<out>_steps.png`).

    ./tlt bench --steps 8 --out bench/results/baseline.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from bench import portable
from tlt_verl.launch import timeline
from tlt_verl.launch.runner import RunConfig, run


def length_distribution(lengths: list[int]) -> dict:
    a = np.asarray(lengths)
    pct = {f"p{q}": float(np.percentile(a, q)) for q in (10, 25, 50, 75, 90, 95, 99)}
    edges = np.unique(np.geomspace(1, max(2, a.max() + 1), 16).astype(int))
    hist, _ = np.histogram(a, bins=edges)
    return {"n": int(a.size), "mean": float(a.mean()), "max": int(a.max()), **pct,
            "max_over_p50": float(a.max() / max(1.0, pct["p50"])),
            "histogram": {"edges": edges.tolist(), "counts": hist.tolist()}}


def plot_timeline(events: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    windows = timeline.rollout_windows(events)
    reps = timeline.replicas(events)
    t0 = min(w.start for w in windows.values())
    fig, ax = plt.subplots(figsize=(11, 1.8 + 0.6 * len(reps)))
    for w in windows.values():
        for i, r in enumerate(reps):
            last = w.replica_last_end.get(r, w.start)
            ax.barh(i, last - w.start, left=w.start - t0, color="tab:blue", height=0.6)
            ax.barh(i, w.end - last, left=last - t0, color="tab:orange", height=0.6)
        ax.axvline(w.start - t0, color="grey", lw=0.5)
    ax.set_yticks(range(len(reps)), [f"replica {r}" for r in reps])
    ax.set_xlabel("seconds since the first rollout (grey lines: rollout starts)")
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color="tab:blue"), plt.Rectangle((0, 0), 1, 1, color="tab:orange")],
              labels=["generating", "drained, waiting for the long tail"], loc="upper center",
              bbox_to_anchor=(0.5, -0.32), ncol=2, fontsize=8, frameon=False)
    ax.set_title("Rollout timeline per replica")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_steps(steps: list[dict], out: Path) -> None:
    """Reward per step beside where each step's time went (rollout vs the rest)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [s["step"] for s in steps]
    fig, (ax_r, ax_t) = plt.subplots(1, 2, figsize=(11, 3.2))
    ax_r.plot(x, [s["reward_mean"] for s in steps], marker="o")
    ax_r.set_xlabel("step")
    ax_r.set_ylabel("mean reward")
    ax_r.set_title("Reward per step")
    gen = [s["gen_s"] for s in steps]
    ax_t.bar(x, gen, color="tab:blue", label="rollout")
    ax_t.bar(x, [s["step_s"] - g for s, g in zip(steps, gen)], bottom=gen, color="tab:grey", label="rest of the step")
    ax_t.set_xlabel("step")
    ax_t.set_ylabel("seconds")
    ax_t.set_title("Step time")
    ax_t.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="tlt-verl bench", description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="tiny_cpu_grpo")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", default="bench/results/baseline.json")
    p.add_argument("--run-dir", default=None)
    p.add_argument("--from-run", default=None, help="analyse a finished run's folder instead of running")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.from_run:
        steps_json = Path(args.from_run) / "steps.json"
        if not steps_json.exists():
            p.error(f"--from-run {args.from_run}: no steps.json there (did the run finish?)")
        result = json.loads(steps_json.read_text())
    else:
        result = run(RunConfig(recipe=args.recipe, steps=args.steps, overrides=args.overrides,
                               run_dir=Path(args.run_dir) if args.run_dir else None))
    events = timeline.load_events(Path(result["summary"]["run_dir"]) / "timeline")
    # Step 1 carries the engines' warm-up; the distribution is over all steps.
    report = {
        "recipe": args.recipe,
        "summary": {k: portable(v) for k, v in result["summary"].items() if k != "run_dir"},
        "response_length": length_distribution([e["n_tokens"] for e in events]),
        "steps": result["steps"],
    }
    out.write_text(json.dumps(report, indent=2))
    plot_timeline(events, out.with_suffix(".png"))
    plot_steps(result["steps"], out.with_name(out.stem + "_steps.png"))
    s = result["summary"]
    print(f"bench: rollout share {s['rollout_share']:.0%}, replica idle {s['replica_idle_fraction']:.0%}, "
          f"response length p50 {report['response_length']['p50']:.0f} max {report['response_length']['max']} "
          f"-> {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
