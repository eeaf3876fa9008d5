"""End-to-end benchmark: the tiny recipe with TLT, without it, and with TLT's drafter frozen at
step 0; same seed and data, the arms one after the other in one invocation.

Writes JSON (per-step records of every arm, step-time and rollout-time ratios over steps 5 to the
last, both reward curves with their per-step gap, acceptance over steps, the adaptive drafter's
rollout speed over the frozen one's) and a PNG of the four per-step curves.

    ./tlt bench-e2e --steps 20 --out bench/results/tlt_e2e.json
    ./tlt bench-e2e --steps 20 --drafter /path/to/exported/eagle --arms tlt,tlt_frozen_drafter
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench import portable, portable_settings
from tlt_verl.launch.compare import (FIRST_MEASURED_STEP, format_comparison, measured, plot_arms, ratio,
                                     run_arms, tlt_vs_baseline)
from tlt_verl.launch.runner import REPO, RunConfig

ARMS = {
    "baseline": {"tlt": False},
    "tlt": {"tlt": True},
    "tlt_frozen_drafter": {"tlt": True, "overrides": ["+tlt.spot.train_drafter=false"]},
}


def frozen_vs_adaptive(results: dict, last: int = 5) -> dict:
    """Rollout speed of the adaptive drafter over the frozen one: rollout-time ratios over steps
    5 to the last, and over the last `last` steps (where the adaptive drafter has trained most)."""
    a, f = results["tlt"]["steps"], results["tlt_frozen_drafter"]["steps"]
    tail_from = max(s["step"] for s in a) - last + 1
    acc = {name: [s["tlt"]["acceptance_length"] for s in results[name]["steps"] if s.get("tlt")]
           for name in ("tlt", "tlt_frozen_drafter")}
    return {"rollout_speed_ratio": ratio(f, a, "gen_s"),
            f"rollout_speed_ratio_last{last}": ratio(f, a, "gen_s", first=tail_from),
            "acceptance_length": acc}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--drafter", default="warm",
                   help="tlt.drafter.init of both TLT arms: warm (the cached offline-trained drafter), scratch, or a folder")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {','.join(ARMS)}")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "tlt_e2e.json"))
    p.add_argument("--run-dir", default=None, help="where the runs go (default: runs/tlt_e2e-<time>)")
    args = p.parse_args(argv)
    names = args.arms.split(",")
    unknown = sorted(set(names) - set(ARMS))
    if unknown or args.steps < FIRST_MEASURED_STEP + 1:
        p.error(f"--arms: unknown {unknown}" if unknown else f"--steps must be > {FIRST_MEASURED_STEP}")
    out = Path(args.out)
    run_dir = Path(args.run_dir or REPO / "runs" / f"tlt_e2e-{time.strftime('%Y%m%d-%H%M%S')}")
    base = RunConfig(steps=args.steps, drafter_init=args.drafter)
    results = run_arms(base, {n: ARMS[n] for n in names}, run_dir)

    report = {"settings": portable_settings({"steps": args.steps, "drafter_init": args.drafter, "arms": names,
                                             "first_measured_step": FIRST_MEASURED_STEP}),
              "measured_steps": [s["step"] for s in measured(next(iter(results.values()))["steps"])]}
    if {"tlt", "baseline"} <= set(results):
        report["tlt_vs_baseline"] = tlt_vs_baseline(results)
        print(format_comparison(report["tlt_vs_baseline"]))
    if {"tlt", "tlt_frozen_drafter"} <= set(results):
        report["adaptive_vs_frozen_drafter"] = frozen_vs_adaptive(results)
        r = report["adaptive_vs_frozen_drafter"]
        print(f"tlt-verl: adaptive / frozen drafter rollout speed {r['rollout_speed_ratio']:.2f}x"
              f" (last 5 steps {r['rollout_speed_ratio_last5']:.2f}x)")
    report["arms"] = {n: {"summary": {k: portable(v) for k, v in r["summary"].items()}, "steps": r["steps"]} for n, r in results.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    png = plot_arms(results, out.with_suffix(".png"), f"tiny_cpu_grpo, {args.steps} steps: "
                    f"TLT vs stock verl vs TLT with the drafter frozen at step 0 (init: {args.drafter})")
    print(f"tlt-verl: wrote {out} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
