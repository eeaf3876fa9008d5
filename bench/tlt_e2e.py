"""End-to-end benchmark: the tiny recipe with TLT, without it, and with TLT's drafter frozen at
step 0 or forced to train; same seed and data, the arms one after the other, `--repeats` times in
alternating order. `tlt` is TLT as `./tlt run` runs it (tlt.spot.train_drafter=auto: on CPU the
drafter does not train, so there it is the frozen arm without capture); `tlt_adaptive` trains the
drafter on drained replicas whatever the device, and is the adaptive side of the adaptive/frozen
ratio when it runs (else `tlt` is).

Writes JSON with the ratios pooled over the repeats at the top level (`step_time_baseline_over_tlt`,
`rollout_time_baseline_over_tlt`, `non_rollout_tlt_over_baseline`,
`adaptive_over_frozen_rollout_speed`; means over steps 5 to the last of every repeat), the same
per repeat under `repeats` (with both reward curves and their gap, acceptance over steps, the
drafter's share of the critical path, and every arm's per-step records), and a PNG of the
per-step curves of the first repeat.

    ./tlt bench-e2e --steps 20 --out bench/results/tlt_e2e.json
    ./tlt bench-e2e --steps 20 --drafter /path/to/exported/eagle --arms tlt,tlt_frozen_drafter
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench import portable, portable_settings
from tlt_verl.launch.compare import (FIRST_MEASURED_STEP, format_comparison, measured, phase_ratios, plot_arms,
                                     ratio, run_arms, tlt_vs_baseline)
from tlt_verl.launch.runner import REPO, RunConfig, read_steps

ARMS = {
    "baseline": {"tlt": False},
    "tlt": {"tlt": True},
    "tlt_frozen_drafter": {"tlt": True, "overrides": ["+tlt.spot.train_drafter=false"]},
    "tlt_adaptive": {"tlt": True, "overrides": ["+tlt.spot.train_drafter=true"]},
    # Not a default arm: training on, the coordinator looking at the replicas as seldom as when it
    # does not train (tlt.spot.observe_interval_s), to tell what its looks cost the rollout from
    # what the training itself costs.
    "tlt_adaptive_slow_poll": {"tlt": True, "overrides": ["+tlt.spot.train_drafter=true",
                                                          "+tlt.spot.poll_interval_s=0.25"]},
    # Not a default arm: the SD policy's start before 2026-12-07 (every bucket on its largest k
    # first, every exploring pull played), to check that the newer start does not cost the run.
    "tlt_start_largest": {"tlt": True, "overrides": ["+tlt.sd.bandit.start=largest",
                                                     "+tlt.sd.bandit.explore_floor=0.0"]},
    # Not a default arm: k=3 at every batch size (the bandit starts on its largest arm and, with no
    # exploration, never leaves it), to tell what the policy costs from what the engine can give.
    "tlt_fixed_k3": {"tlt": True, "overrides": ["+tlt.sd.bandit.arms=[2,3]", "+tlt.sd.bandit.epsilon=0",
                                                "+tlt.sd.bandit.min_epsilon=0"]},
}
DEFAULT_ARMS = ("baseline", "tlt", "tlt_frozen_drafter", "tlt_adaptive")
FROZEN = "tlt_frozen_drafter"


def adaptive_arm(names) -> str | None:
    """The arm whose drafter adapts online, if this run can compare it with the frozen one."""
    if FROZEN not in names:
        return None
    return next((n for n in ("tlt_adaptive", "tlt") if n in names), None)


def frozen_vs_adaptive(results: dict, last: int = 5) -> dict:
    """Rollout speed of the adaptive drafter over the frozen one: rollout-time ratios over steps
    5 to the last, and over the last `last` steps (where the adaptive drafter has trained most)."""
    adaptive = adaptive_arm(results)
    a, f = results[adaptive]["steps"], results[FROZEN]["steps"]
    tail_from = max(s["step"] for s in a) - last + 1
    acc = {name: [s["tlt"]["acceptance_length"] for s in results[name]["steps"] if s.get("tlt")]
           for name in (adaptive, FROZEN)}
    return {"adaptive_arm": adaptive, "rollout_speed_ratio": ratio(f, a, "gen_s"),
            f"rollout_speed_ratio_last{last}": ratio(f, a, "gen_s", first=tail_from),
            "acceptance_length": acc}


def non_rollout(steps: list[dict]) -> list[dict]:
    return [{**s, "non_rollout_s": s["step_s"] - s["gen_s"]} for s in steps]


def summary(results: dict) -> dict:
    """One repeat's ratios (over steps 5 to the last)."""
    out: dict = {}
    if {"tlt", "baseline"} <= set(results):
        c = tlt_vs_baseline(results)
        out.update(step_time_baseline_over_tlt=c["step_time_ratio"], rollout_time_baseline_over_tlt=c["rollout_time_ratio"],
                   non_rollout_tlt_over_baseline=ratio(non_rollout(results["tlt"]["steps"]),
                                                       non_rollout(results["baseline"]["steps"]), "non_rollout_s"),
                   tlt_vs_baseline=c)
    if adaptive_arm(results):
        f = frozen_vs_adaptive(results)
        out.update(adaptive_over_frozen_rollout_speed=f["rollout_speed_ratio"], adaptive_vs_frozen_drafter=f)
    return out


def _pooled_steps(repeats: list[dict]) -> dict[str, list[dict]]:
    """Each arm's measured steps of all repeats together."""
    return {name: [s for r in repeats for s in measured(r[name]["steps"])] for name in repeats[0]}


def pooled(repeats: list[dict]) -> dict:
    """The ratios over the measured steps of all repeats together (each arm's steps pooled)."""
    arms = _pooled_steps(repeats)
    out: dict = {}
    if {"tlt", "baseline"} <= set(arms):
        t, b = arms["tlt"], arms["baseline"]
        out.update(step_time_baseline_over_tlt=ratio(b, t, "step_s", first=0),
                   rollout_time_baseline_over_tlt=ratio(b, t, "gen_s", first=0),
                   non_rollout_tlt_over_baseline=ratio(non_rollout(t), non_rollout(b), "non_rollout_s", first=0))
    adaptive = adaptive_arm(arms)
    if adaptive:
        out["adaptive_over_frozen_rollout_speed"] = ratio(arms[FROZEN], arms[adaptive], "gen_s", first=0)
    return out


def baseline_over_arms(repeats: list[dict]) -> dict:
    """Every other arm against the baseline, pooled: step, rollout, and the rollout's two phases
    (timeline.crowded_seconds: many requests in flight, then the long tail)."""
    arms = _pooled_steps(repeats)
    if "baseline" not in arms:
        return {}
    b = arms["baseline"]
    return {name: {"step": ratio(b, steps, "step_s", first=0), "rollout": ratio(b, steps, "gen_s", first=0),
                   **{f"{p}_rollout": r for p, r in phase_ratios(b, steps, first=0).items()}}
            for name, steps in arms.items() if name != "baseline"}


def load_run(d: Path, parser: argparse.ArgumentParser) -> dict:
    """A finished arm's result as `run` returned it, its steps read again from its files."""
    if not (d / "steps.json").exists():
        parser.error(f"--from-runs: {d} has no steps.json (that run did not finish)")
    return {"summary": json.loads((d / "steps.json").read_text())["summary"], "steps": read_steps(d)[0]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--drafter", default="warm",
                   help="tlt.drafter.init of both TLT arms: warm (the cached offline-trained drafter), scratch, or a folder")
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"comma-separated subset of {','.join(ARMS)} "
                   "(on a GPU, where tlt trains its drafter, tlt_adaptive repeats it; tlt_fixed_k3 plays k=3 "
                   "at every batch size; tlt_start_largest is the SD policy of before 2026-12-07)")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "tlt_e2e.json"))
    p.add_argument("--repeats", type=int, default=2, help="runs of every arm, in alternating order")
    p.add_argument("--run-dir", default=None, help="where the runs go (default: runs/tlt_e2e-<time>)")
    p.add_argument("--from-runs", default=None, metavar="DIR",
                   help="write the report from a finished bench's runs (DIR/r1/<arm>, ...) instead of running them")
    args = p.parse_args(argv)
    names = args.arms.split(",")
    unknown = sorted(set(names) - set(ARMS))
    if unknown or args.steps < FIRST_MEASURED_STEP + 1:
        p.error(f"--arms: unknown {unknown}" if unknown else f"--steps must be > {FIRST_MEASURED_STEP}")
    out = Path(args.out)
    run_dir = Path(args.run_dir or REPO / "runs" / f"tlt_e2e-{time.strftime('%Y%m%d-%H%M%S')}")
    base = RunConfig(steps=args.steps, drafter_init=args.drafter)
    runs = []
    for r in range(args.repeats):
        order = names if r % 2 == 0 else names[::-1]
        if args.from_runs:
            runs.append({n: load_run(Path(args.from_runs) / f"r{r + 1}" / n, p) for n in order})
            continue
        print(f"tlt-verl: === repeat {r + 1}/{args.repeats}: {', '.join(order)} ===", flush=True)
        runs.append(run_arms(base, {n: ARMS[n] for n in order}, run_dir / f"r{r + 1}"))

    ratios = pooled(runs)
    report = {"settings": portable_settings({"steps": args.steps, "drafter_init": args.drafter, "arms": names,
                                             "repeats": args.repeats, "first_measured_step": FIRST_MEASURED_STEP}),
              "measured_steps": [s["step"] for s in measured(next(iter(runs[0].values()))["steps"])],
              **ratios, "baseline_over_arm": baseline_over_arms(runs), "repeats": []}
    for r, results in enumerate(runs):
        rep = summary(results)
        if "tlt_vs_baseline" in rep:
            print(f"tlt-verl: repeat {r + 1}: " + format_comparison(rep["tlt_vs_baseline"]).removeprefix("tlt-verl: ")
                  + f" | non-rollout TLT/baseline {rep['non_rollout_tlt_over_baseline']:.2f}x")
        if "adaptive_vs_frozen_drafter" in rep:
            f = rep["adaptive_vs_frozen_drafter"]
            print(f"tlt-verl: repeat {r + 1}: adaptive / frozen drafter rollout speed {f['rollout_speed_ratio']:.2f}x"
                  f" (last 5 steps {f['rollout_speed_ratio_last5']:.2f}x)")
        rep["order"] = names if r % 2 == 0 else names[::-1]
        rep["arms"] = {n: {"summary": {k: portable(v) for k, v in x["summary"].items()}, "steps": x["steps"]}
                       for n, x in results.items()}
        report["repeats"].append(rep)
    print("tlt-verl: pooled over repeats: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    for name, r in report["baseline_over_arm"].items():
        print(f"tlt-verl: pooled, baseline over {name}: " + ", ".join(f"{k} {v:.2f}x" for k, v in r.items()))
    results = runs[0]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    png = plot_arms(results, out.with_suffix(".png"), f"tiny_cpu_grpo, {args.steps} steps: "
                    f"{' vs '.join(results)} (init: {args.drafter}); repeat 1")
    print(f"tlt-verl: wrote {out} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
