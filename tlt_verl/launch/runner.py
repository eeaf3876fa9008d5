"""Run a recipe: prepare the task assets, launch verl's stock trainer, show per-step progress.

verl's own output goes to `<run_dir>/verl.log`; the terminal gets one line per step. The step
metrics come from verl's `file` logger (its metrics dict, as verl computed it) joined with the
rollout servers' timeline (length percentiles, replica idle fraction).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

import numpy as np

from tlt_verl.launch import timeline

REPO = Path(__file__).resolve().parents[2]
RECIPES = Path(os.environ.get("TLT_RECIPES_DIR", REPO / "recipes"))
DEFAULT_HOME = Path(os.environ.get("TLT_HOME", REPO / ".cache" / "tlt"))


class RunError(RuntimeError):
    pass


WARM = "warm"


@dataclass
class RunConfig:
    recipe: str = "tiny_cpu_grpo"
    steps: int = 14
    run_dir: Optional[Path] = None
    overrides: list[str] = field(default_factory=list)
    assets_root: Path = DEFAULT_HOME / "assets"
    quiet: bool = False
    # TLT on (the embedded default) with the drafter from tlt.drafter.init; off: stock verl.
    # "warm": the task target's offline-trained drafter (tlt_verl.task.warm_drafter), built once.
    tlt: bool = False
    drafter_init: str = WARM

    def given_keys(self) -> set[str]:
        """The config keys the user's overrides set (`+k=v`, `++k=v`, `~k`, `k=v`)."""
        return {o.lstrip("+~").split("=", 1)[0] for o in self.overrides}

    def all_overrides(self) -> list[str]:
        """The recipe's extra Hydra overrides: TLT's switch first, unless the user set those keys."""
        given = self.given_keys()
        ours = {"tlt.enable": "true", "tlt.drafter.init": self.drafter_init} if self.tlt else {}
        return [f"+{k}={v}" for k, v in ours.items() if k not in given] + list(self.overrides)

    def recipe_path(self) -> Path:
        p = Path(self.recipe)
        if not p.suffix:
            p = RECIPES / f"{self.recipe}.sh"
        if not p.exists():
            known = sorted(x.stem for x in RECIPES.glob("*.sh"))
            raise RunError(f"--recipe {self.recipe}: no such recipe (known: {', '.join(known)})")
        return p


def step_record(metrics: dict, window: Optional[timeline.RolloutWindow], replicas: list[int]) -> dict:
    step_s = metrics["timing_s/step"]
    gen_s = metrics.get("timing_s/gen", 0.0)
    rec = {
        "step_s": step_s,
        "gen_s": gen_s,
        "rollout_share": gen_s / step_s if step_s else 0.0,
        "old_log_prob_s": metrics.get("timing_s/old_log_prob", 0.0),
        "update_actor_s": metrics.get("timing_s/update_actor", 0.0),
        "update_weights_s": metrics.get("timing_s/update_weights", 0.0),
        "reward_mean": metrics.get("critic/score/mean"),
        "response_length_mean": metrics.get("response_length/mean"),
        "response_length_max": metrics.get("response_length/max"),
    }
    if "tlt/sd/sd_step_share" in metrics:
        rec["tlt"] = {"sd_share": metrics["tlt/sd/sd_step_share"],
                      "acceptance_length": metrics.get("tlt/sd/acceptance_length", 0.0),
                      "harvested_s": metrics.get("tlt/spot/harvested_s", 0.0),
                      "drafter_steps": metrics.get("tlt/spot/train_steps", 0.0),
                      "critical_path_s": metrics.get("tlt/drafter_critical_path_s", 0.0),
                      "host_s": metrics.get("tlt/drafter/host_s", 0.0)}
    if window is not None:
        rec["rollout_window_s"] = window.seconds
        rec["rollout_crowded_s"] = window.crowded_seconds()
        rec["rollout_tail_s"] = window.seconds - rec["rollout_crowded_s"]
        rec["replica_idle_fraction"] = window.idle_fraction(replicas)
        rec["response_length"] = window.length_stats()
    return rec


def format_step(step: int, total: int, rec: dict) -> str:
    lens = rec.get("response_length") or {"p50": float("nan"), "p90": float("nan"), "max": rec["response_length_max"]}
    idle = rec.get("replica_idle_fraction")
    idle_s = f" | replicas idle {idle:4.0%}" if idle is not None else ""
    t = rec.get("tlt")
    if t:
        idle_s += (f" | SD {t['sd_share']:4.0%} acc {t['acceptance_length']:.2f} | drafter {t['harvested_s']:4.1f}s"
                   f" harvested, {t['drafter_steps']:.0f} steps, {t['critical_path_s']:.2f}s on path"
                   f" + {t.get('host_s', 0.0):.2f}s in the actor")
    return (
        f"[step {step:>3}/{total}] step {rec['step_s']:6.1f}s | gen {rec['gen_s']:6.1f}s ({rec['rollout_share']:4.0%})"
        f" | resp len p50 {lens['p50']:4.0f} p90 {lens['p90']:4.0f} max {lens['max']:4.0f}"
        f" | reward {rec['reward_mean']:+.3f}{idle_s}"
    )


def _read_metrics(path: Path) -> dict[int, dict]:
    out = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                d = json.loads(line)
                out[int(d["step"])] = d["data"]
    return out


def error_lines(log: Path) -> list[str]:
    """What to show when verl exits non-zero: our one-line errors first, else the last exception."""
    if not log.exists():
        return []
    lines = log.read_text(errors="replace").splitlines()
    ours = [ln for ln in lines if ln.startswith("tlt-verl:")]
    if ours:
        return ours[-1:]
    pat = re.compile(r"^\S*(Error|Exception)\b|Error: |error: ")
    errs = [ln for ln in lines if pat.search(ln) and "Error executing job" not in ln]
    return errs[-3:] or lines[-5:]


def cluster_overrides(cfg: RunConfig, run_dir: Path, worker_env: dict[str, str]) -> list[str]:
    """On a running cluster (RAY_ADDRESS, as docker/launch.sh submit sets it) verl's workers start
    from the nodes' environment and folder, not the driver's: hand them the environment through
    the job's runtime_env, and the checkpoints an absolute folder under the run directory."""
    if not os.environ.get("RAY_ADDRESS"):
        return []
    # Quoted: Hydra would read PYTHONUNBUFFERED=1 as an int, which Ray's env_vars refuse.
    out = [f"+ray_kwargs.ray_init.runtime_env.env_vars.{k}='{v}'" for k, v in worker_env.items()]
    if "trainer.default_local_dir" not in cfg.given_keys():
        out.append(f"trainer.default_local_dir={run_dir}/checkpoints/${{trainer.project_name}}/${{trainer.experiment_name}}")
    return out


def _warm_drafter(root: Path, quiet: bool) -> Path:
    """Built in a child process: its generation engine and training would otherwise stay in this
    process's memory for the whole run."""
    p = subprocess.run([sys.executable, "-m", "tlt_verl.task.warm_drafter", "--root", str(root)],
                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL if quiet else None, text=True)
    lines = p.stdout.strip().splitlines()
    if p.returncode != 0 or not lines:
        raise RunError(f"the warm drafter could not be built under {root} (exit code {p.returncode}); "
                       f"--drafter scratch starts without it")
    return Path(lines[-1])


def read_steps(run_dir: Path) -> tuple[list[dict], list[int]]:
    """A finished run's per-step records (verl's metrics and the rollout timeline) and its replicas."""
    events = timeline.load_events(run_dir / "timeline")
    windows, reps = timeline.rollout_windows(events), timeline.replicas(events)
    metrics = _read_metrics(run_dir / "metrics.jsonl")
    return [dict(step=s, **step_record(metrics[s], windows.get(s), reps)) for s in sorted(metrics)], reps


def run(cfg: RunConfig) -> dict:
    from tlt_verl.task.prepare import prepare

    say = (lambda *a, **k: None) if cfg.quiet else print
    recipe = cfg.recipe_path()
    t0 = time.time()
    assets = prepare(Path(cfg.assets_root), log=say)
    if cfg.tlt and cfg.drafter_init == WARM and "tlt.drafter.init" not in cfg.given_keys():
        cfg = replace(cfg, drafter_init=str(_warm_drafter(Path(cfg.assets_root), cfg.quiet)))
    run_dir = Path(cfg.run_dir or (REPO / "runs" / f"{recipe.stem}-{time.strftime('%Y%m%d-%H%M%S')}")).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics_path, tl_dir, log_path = run_dir / "metrics.jsonl", run_dir / "timeline", run_dir / "verl.log"
    for stale in [metrics_path, *tl_dir.glob("*.jsonl")]:
        stale.unlink(missing_ok=True)

    # What verl's processes must see: the metrics file, the servers' timeline folder.
    worker_env = dict(VERL_FILE_LOGGER_PATH=str(metrics_path), TLT_TIMELINE_DIR=str(tl_dir), PYTHONUNBUFFERED="1")
    env = dict(os.environ, MODEL=str(assets["model"]), TRAIN=str(assets["train"]), VAL=str(assets["val"]),
               STEPS=str(cfg.steps), **worker_env)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    cmd = ["bash", str(recipe), f"hydra.run.dir={run_dir / 'hydra'}", *cluster_overrides(cfg, run_dir, worker_env),
           *cfg.all_overrides()]
    mode = f"with TLT (drafter: {cfg.drafter_init})" if cfg.tlt else "without TLT"
    say(f"tlt-verl: running {recipe.name} {mode} for {cfg.steps} steps; verl's log: {log_path}")
    t_launch = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=run_dir)
        shown: set[int] = set()
        records: dict[int, dict] = {}
        last_beat = time.time()
        while True:
            rc = proc.poll()
            metrics = _read_metrics(metrics_path)
            new = sorted(set(metrics) - shown)
            if new:
                events = timeline.load_events(tl_dir)
                windows, reps = timeline.rollout_windows(events), timeline.replicas(events)
                for s in new:
                    records[s] = step_record(metrics[s], windows.get(s), reps)
                    say(format_step(s, cfg.steps, records[s]), flush=True)
                    shown.add(s)
                last_beat = time.time()
            elif time.time() - last_beat > 30:
                phase = "starting Ray, verl and the vLLM replicas" if not shown else f"step {len(shown) + 1}"
                say(f"  ... {phase} ({time.time() - t_launch:.0f}s)", flush=True)
                last_beat = time.time()
            if rc is not None:
                break
            time.sleep(1.0)
    if rc != 0:
        detail = "\n".join(f"  {ln}" for ln in error_lines(log_path))
        raise RunError(f"verl exited with code {rc}; see {log_path}\n{detail}")

    steps, reps = read_steps(run_dir)
    summary = summarize(steps)
    summary.update(recipe=recipe.stem, run_dir=str(run_dir), wall_s=time.time() - t0,
                   launch_to_exit_s=time.time() - t_launch, replicas=len(reps))
    result = {"summary": summary, "steps": steps}
    (run_dir / "steps.json").write_text(json.dumps(result, indent=2))
    if any(s.get("tlt") for s in steps):
        from tlt_verl.launch.spot_plot import load_spot_timeline, plot_spot

        found = sorted(run_dir.glob("checkpoints/*/*/tlt/spot_timeline.jsonl"))
        if found:
            png = plot_spot(load_spot_timeline(found[-1]), steps, run_dir / "spot_timeline.png")
            say(f"tlt-verl: long-tail timeline per replica -> {png}")
    from tlt_verl.serve.export import find_exports

    exports = find_exports(run_dir)
    if exports:
        say(f"tlt-verl: policy and drafter exported for serving -> {exports[-1]}; serve it: ./tlt serve {run_dir}")
    say(
        f"tlt-verl: done in {summary['wall_s']:.0f}s | reward first-3 {summary['reward_first3']:+.3f}"
        f" -> last-3 {summary['reward_last3']:+.3f} | rollout share {summary['rollout_share']:.0%}"
        f" | replica idle {summary['replica_idle_fraction']:.0%} | {run_dir / 'steps.json'}"
    )
    return result


def summarize(steps: list[dict]) -> dict:
    rewards = [s["reward_mean"] for s in steps]
    k = min(3, len(rewards))
    # Step 1 pays one-time warm-up (first engine steps, lazy imports): keep it out of the shares.
    steady = steps[1:] or steps
    gen, tot = sum(s["gen_s"] for s in steady), sum(s["step_s"] for s in steady)
    windows = [s for s in steady if "rollout_window_s" in s]
    idle = (sum(s["replica_idle_fraction"] * s["rollout_window_s"] for s in windows)
            / max(1e-9, sum(s["rollout_window_s"] for s in windows))) if windows else float("nan")
    return {
        "steps": len(steps),
        "reward_first3": float(np.mean(rewards[:k])),
        "reward_last3": float(np.mean(rewards[-k:])),
        "rollout_share": gen / tot if tot else 0.0,
        "replica_idle_fraction": float(idle),
        "mean_step_s": tot / len(steady),
    }
