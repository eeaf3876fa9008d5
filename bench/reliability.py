"""Crash anywhere, resume: kill a TLT run and check that the next `trainer.resume_mode=auto` run
picks it up with nothing lost.

    .venv/bin/python bench/reliability.py [--driver-kills 10] [--rank-kill 1] [--engine-kill 1]
                                          [--steps 3] [--seed 0] [--out bench/results/reliability.json]

A reference run (`./tlt run`, TLT on, warm drafter trained in the rollout, a checkpoint every step) gives the
run's length T. Then each trial starts the same run in a fresh folder, with a Ray of its own, and:

- driver: SIGKILLs verl's driver (the `main_ppo` process); every other time at a moment drawn
  uniformly from [5 s, 0.95 T], in between uniformly over what follows the first step's metrics
  (start-up is most of a short run): start-up, a rollout, a drafter session, a checkpoint or
  export being written, a drafter push;
- rank: SIGKILLs one trainer rank (a Ray `WorkerDict` process) a random 0-10 s after the first
  step's metrics are in;
- engine: SIGKILLs one vLLM engine core (`VLLM::EngineCore`) in the same window;
- a save (`trial(..., when=("saving", (step, part)))`, tests/test_reliability.py): SIGKILLs the
  driver in the middle of step N's checkpoint save, once its drafters' part (`part="drafter"`:
  the step's `tlt_drafter` folder has appeared) or verl's part (`"verl"`: its `actor` folder has)
  is being written, before verl marks the step saved.

Whatever still runs from the trial's Ray temp dir is then ended by process id (nothing else on
the machine), the folder is checked (every step verl had marked as saved is still complete: its
actor files, its drafters' checkpoints verify against their sha256, its SD policy state), and the
run is launched again with `trainer.resume_mode=auto`. Recorded per trial: the kill moment and
the phase it hit, how the killed run ended (seconds from kill to exit, its last error line), the
step verl resumed from, the drafter state versions and bandit pulls the resumed run reports
against those in the checkpoint, whether the resumed run finished, the time it took to be back
at work (launch to the first new step) and `lost_checkpoints`.

About 5 minutes a trial on a 2-core box (two launches of Ray, verl and two vLLM replicas), so it
is not part of CI; `SHORT` (`--short`) shrinks each step's rollout (4 prompts, 64 response tokens),
which leaves mostly the two start-ups.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tlt_verl.drafter.checkpoint import CheckpointError, load, manifests  # noqa: E402
from tlt_verl.launch.runner import error_lines  # noqa: E402
from tlt_verl.rollout.policy.sd_policy import sd_policy_pulls  # noqa: E402
from tlt_verl.serve.export import DRAFTER_SUBDIR  # noqa: E402
from tlt_verl.utils.own_ray import OwnRay  # noqa: E402

CKPT_REL = Path("checkpoints") / "tlt" / "tiny_cpu_grpo"
TRACKER = "latest_checkpointed_iteration.txt"
# What each kind of trial kills, by command line (the driver) or process title (Ray, vLLM).
TARGETS = {"driver": "verl.trainer.main_ppo", "rank": "WorkerDict", "engine": "VLLM::EngineCore"}
RESUMED = re.compile(r"tlt: drafter resumed from \S*global_step_(\d+) on (\d+)/(\d+) ranks "
                     r"\(state versions \[([\d, ]*)\]\); SD policy resumed: (no|(\d+) bandit pulls)")
HANG_S = 300.0          # a killed run that has not exited by then is recorded as hung, then ended
# A short run of the same recipe: a quarter of its prompts (still a multiple of the two ranks'
# mini-batches) and short responses, so that a step is seconds, not minutes.
SHORT = ("data.train_batch_size=4", "data.max_response_length=64", "actor_rollout_ref.actor.ppo_mini_batch_size=2")
SAVE_PARTS = {"drafter": "tlt_drafter", "verl": "actor"}   # what a step's save writes first, in order


# A `sitecustomize` for a run's PYTHONPATH (its processes alone): the process that writes verl's
# tracker (the TaskRunner actor) stops there in step N's save, its drafters and actor files
# written, the step not yet marked saved; once (a marker file), so that the resumed run saves the
# step through. "kill": it SIGKILLs itself there; "hold": it waits a minute there, for a watcher to
# kill the driver. A tiny model's save takes less time than a busy box takes to schedule a watcher.
IN_SAVE_HOOK = '''
import builtins, os, signal, time
_step, _action, _marker = os.environ["TLT_IN_SAVE"].split(":", 2)
_open = builtins.open


def open(file, mode="r", *args, **kwargs):
    path = str(file)
    if ("w" in str(mode) and path.endswith("latest_checkpointed_iteration.txt") and not os.path.exists(_marker)
            and os.path.isdir(os.path.join(os.path.dirname(path), "global_step_" + _step))):
        _open(_marker, "w").close()
        if _action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    return _open(file, mode, *args, **kwargs)


builtins.open = open
'''
IN_SAVE_ACTIONS = ("kill", "hold")


def in_save_hook(folder: Path, step: int, action: str) -> dict[str, str]:
    """IN_SAVE_HOOK written into ``folder``; returns the environment a run loads it with. The
    file ``folder/fired`` appears when it has fired."""
    if action not in IN_SAVE_ACTIONS:
        raise ValueError(f"in_save_hook: action {action!r}: one of {IN_SAVE_ACTIONS}")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(IN_SAVE_HOOK)
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")])),
            "TLT_IN_SAVE": f"{step}:{action}:{folder / 'fired'}"}


def launch(run_dir: Path, steps: int, ray: OwnRay, log: Path, overrides=()) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tlt_verl.cli", "run", "--steps", str(steps), "--run-dir", str(run_dir),
           # The drafter trains (on CPU the default, train_drafter=auto, leaves it frozen): kills
           # then also land in drafter sessions and pushes.
           "trainer.save_freq=1", "trainer.resume_mode=auto", "+tlt.spot.train_drafter=true", *overrides]
    env = dict(os.environ, **ray.env, PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(log, "a"), stderr=subprocess.STDOUT)


def steps_done(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(int(json.loads(line)["step"]))
        except (ValueError, KeyError):
            continue
    return out


def saved_step(run_dir: Path) -> int:
    tracker = run_dir / CKPT_REL / TRACKER
    try:
        return int(tracker.read_text().strip())
    except (OSError, ValueError):
        return 0


def check_step(run_dir: Path, step: int) -> dict:
    """A saved step as the resume will read it: verl's actor files, every rank's drafter
    checkpoint (sha256 against its manifest), the SD policy state."""
    folder = run_dir / CKPT_REL / f"global_step_{step}"
    out = {"step": step, "problems": [], "drafter_versions": [], "bandit_pulls": None}
    actor = folder / "actor"
    if not actor.is_dir() or not any(actor.iterdir()):
        out["problems"].append(f"{actor} missing or empty")
    ranks = sorted((folder / DRAFTER_SUBDIR).glob("rank_*"))
    if not ranks:
        out["problems"].append(f"{folder / DRAFTER_SUBDIR} holds no rank's drafter")
    for rank in ranks:
        found = manifests(rank)
        if not found:
            out["problems"].append(f"{rank}: no committed drafter checkpoint")
            continue
        try:
            state = load(found[0]).state           # verified against its sha256 first
        except CheckpointError as e:
            out["problems"].append(str(e))
            continue
        out["drafter_versions"].append(int(state["service"]["state_version"]))
    policy = folder / DRAFTER_SUBDIR / "sd_policy.json"
    try:
        out["bandit_pulls"] = sum(sd_policy_pulls(s) for s in json.loads(policy.read_text()) if s)
    except (OSError, ValueError, KeyError) as e:
        out["problems"].append(f"{policy}: {type(e).__name__}")
    return out


def phase(run_dir: Path, log: Path) -> str:
    """What the run was doing when killed, from what it had written."""
    done, saved = steps_done(run_dir), saved_step(run_dir)
    if not done:
        return "start-up" if "Training Progress" not in log.read_text(errors="replace") else "step 1"
    last = max(done)
    partial = sorted(int(p.name.split("_")[-1]) for p in (run_dir / CKPT_REL).glob("global_step_*")
                     if int(p.name.split("_")[-1]) > saved)
    if partial:
        return f"saving step {partial[-1]} (steps done {last})"
    return f"step {last + 1} (steps done {last}, saved {saved})"


def find_target(ray: OwnRay, kind: str):
    import psutil

    for p in ray.processes():
        try:
            if TARGETS[kind] in " ".join(p.cmdline()) or TARGETS[kind] in p.name():
                return p
        except psutil.Error:
            continue
    return None


def wait_exit(proc: subprocess.Popen, timeout: float) -> float | None:
    t = time.time()
    try:
        proc.wait(timeout=timeout)
        return time.time() - t
    except subprocess.TimeoutExpired:
        return None


def save_begun(run_dir: Path, step: int, part: str) -> bool:
    """Step ``step``'s checkpoint save has reached ``part`` (SAVE_PARTS) and verl has not yet
    marked the step saved."""
    return (run_dir / CKPT_REL / f"global_step_{step}" / SAVE_PARTS[part]).exists() and saved_step(run_dir) < step


def trial(kind: str, work: Path, steps: int, when: tuple[str, object], rng: random.Random, overrides=()) -> dict:
    """``when``: ("at", seconds after launch), ("after_first_step", seconds after the first
    step's metrics are in) or ("saving", (step, part)): as soon as ``save_begun``."""
    run_dir, log = work / "run", work / "launcher.log"
    work.mkdir(parents=True, exist_ok=True)
    ray = OwnRay()
    rec: dict = {"kind": kind, "trial": work.name, "moment": when[0]}
    t0 = time.time()
    proc = launch(run_dir, steps, ray, log, overrides)
    target = None
    try:
        if when[0] == "saving":
            # The target found first and the save polled often: the save of a tiny model's step
            # takes a second or two, looking through the processes as long.
            while proc.poll() is None and (target := find_target(ray, kind)) is None:
                time.sleep(0.5)
            while proc.poll() is None and not save_begun(run_dir, *when[1]):
                time.sleep(0.01)
            deadline = time.time()
        elif when[0] == "after_first_step":
            while proc.poll() is None and not steps_done(run_dir):
                time.sleep(0.5)
            deadline = time.time() + when[1]
        else:
            deadline = t0 + when[1]
        while time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
        target = target or find_target(ray, kind)
        rec["kill_at_s"] = round(time.time() - t0, 1)
        if proc.poll() is not None or target is None:
            rec.update(killed=False, why="the run had ended" if proc.poll() is not None else "no such process")
            return rec
        rec["phase"] = phase(run_dir, run_dir / "verl.log")
        # The trackers verl had written: the steps a resume may count on.
        saved_before = saved_step(run_dir)
        os.kill(target.pid, signal.SIGKILL)
        rec.update(killed=True, killed_pid=target.pid)
        took = wait_exit(proc, HANG_S)
        rec["exit_after_kill_s"] = None if took is None else round(took, 1)
        rec["hung"] = took is None
        if took is None:
            proc.kill()
            proc.wait()
        # What `./tlt run` itself shows for a failed run; a killed driver leaves none.
        rec["killed_run_error"] = (error_lines(run_dir / "verl.log")[-1:] or [None])[0] if kind != "driver" else None
        if kind == "engine":
            rec["one_line_engine_death"] = "its vLLM engine died" in (run_dir / "verl.log").read_text(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        rec["ray_processes_ended"] = len(ray.stop())

    saved = saved_step(run_dir)
    rec.update(saved_on_disk(run_dir))
    if saved < saved_before:
        rec["lost"].append(saved_before)     # the tracker went backwards

    ray = OwnRay()
    t1 = time.time()
    resume_log = work / "resume.log"
    proc = launch(run_dir, steps, ray, resume_log, overrides)
    first_new = None
    try:
        while proc.poll() is None:
            if first_new is None and any(s > saved for s in steps_done(run_dir)):
                first_new = time.time() - t1
            time.sleep(0.5)
        rc = proc.returncode
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        ray.stop()
    done = steps_done(run_dir)
    text = (run_dir / "verl.log").read_text(errors="replace") if (run_dir / "verl.log").exists() else ""
    rec.update(resume_rc=rc, resume_s=round(time.time() - t1, 1),
               time_to_recover_s=None if first_new is None else round(first_new, 1),
               finished=rc == 0 and max(done, default=0) >= steps)
    rec.update(resume_verdict(rec, text, rec["finished"]))
    del rec["lost"]
    return rec


def saved_on_disk(run_dir: Path) -> dict:
    """After a kill, what a resume may count on: the step verl marked saved, and every saved step
    still whole (``check_step``). ``lost``: the saved steps that are not."""
    saved = saved_step(run_dir)
    checked = [check_step(run_dir, s) for s in range(1, saved + 1)
               if (run_dir / CKPT_REL / f"global_step_{s}").exists() or s == saved]
    latest = next((c for c in checked if c["step"] == saved), None)
    return {"saved_step": saved,
            "checkpoint_problems": [p.replace(str(run_dir), "<run>") for c in checked for p in c["problems"]],
            "saved_drafter_versions": latest["drafter_versions"] if latest else [],
            "saved_bandit_pulls": latest["bandit_pulls"] if latest else None,
            "lost": [c["step"] for c in checked if c["problems"]]}


def resume_verdict(saved: dict, log_text: str, finished: bool) -> dict:
    """Whether the resumed run (its verl.log ``log_text``) picked up ``saved`` (``saved_on_disk``
    before it started) with nothing lost: it named the saved step's checkpoint, not a newer
    unfinished one, resumed its drafters at their saved versions or later and its bandit at its
    saved pulls, and finished."""
    m = RESUMED.search(log_text)
    out, lost = {}, list(saved["lost"])
    if saved["saved_step"] > 0:
        resumed_from = int(m.group(1)) if m else None
        versions = [int(v) for v in m.group(4).split(",") if v.strip()] if m else []
        pulls = int(m.group(6)) if m and m.group(6) else None
        out.update(resumed_from=resumed_from, resumed_drafter_versions=versions, resumed_bandit_pulls=pulls)
        out["drafter_at_saved_version_or_later"] = bool(versions) and bool(saved["saved_drafter_versions"]) and \
            max(versions) >= max(saved["saved_drafter_versions"])
        out["bandit_resumed"] = pulls is not None and pulls == saved["saved_bandit_pulls"]
        if resumed_from != saved["saved_step"]:
            lost.append(saved["saved_step"])
        ok = out["drafter_at_saved_version_or_later"] and out["bandit_resumed"]
    else:
        out.update(resumed_from=0)           # nothing was saved: the next run starts over, as it should
        ok = m is None
    out["lost_checkpoints"] = sorted(set(lost))
    out["resumed"] = bool(finished and ok and not out["lost_checkpoints"])
    return out


def reference(work: Path, steps: int, overrides=()) -> tuple[float, float]:
    """An uninterrupted run: its length, and when its first step's metrics were in."""
    ray, log, run_dir = OwnRay(), work / "launcher.log", work / "run"
    work.mkdir(parents=True, exist_ok=True)
    t, first = time.time(), None
    proc = launch(run_dir, steps, ray, log, overrides)
    try:
        while proc.poll() is None:
            if first is None and steps_done(run_dir):
                first = time.time() - t
            time.sleep(0.5)
    finally:
        ray.stop()
    if proc.returncode != 0 or first is None:
        raise SystemExit(f"reliability: the reference run failed (exit code {proc.returncode}); see {log}")
    return time.time() - t, first


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--driver-kills", type=int, default=10)
    ap.add_argument("--rank-kill", type=int, default=1)
    ap.add_argument("--engine-kill", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--short", action="store_true", help="short steps (SHORT): the kills then land mostly in start-up")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reference-s", type=float, nargs=2, default=None, metavar=("LENGTH", "FIRST_STEP"),
                    help="an uninterrupted run's length and when its first step was in; measured by a "
                         "reference run if not given")
    ap.add_argument("--budget-min", type=float, default=None,
                    help="start no trial after this many minutes (the trials done are written)")
    ap.add_argument("--work", default=str(REPO / "runs" / f"reliability-{time.strftime('%Y%m%d-%H%M%S')}"))
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "reliability.json"))
    ap.add_argument("--append", action="store_true",
                    help="add this invocation's trials to those already in --out (a new seed draws new moments)")
    args = ap.parse_args()
    work, rng = Path(args.work), random.Random(args.seed)
    out = previous(Path(args.out)) if args.append else {"invocations": [], "trials": []}
    if any(inv["seed"] == args.seed for inv in out["invocations"]):
        raise SystemExit(f"reliability: {args.out} already holds seed {args.seed}; pass another --seed to draw new moments")
    overrides = SHORT if args.short else ()
    length, first_step = args.reference_s or reference(work / "reference", args.steps, overrides)
    print(f"reliability: an uninterrupted {args.steps}-step run takes {length:.0f}s", flush=True)
    kinds = ["engine"] * args.engine_kill + ["rank"] * args.rank_kill + ["driver"] * args.driver_kills
    invocation = len(out["invocations"])
    out["invocations"].append({"steps": args.steps, "seed": args.seed, "reference_s": round(length, 1),
                               "reference_first_step_s": round(first_step, 1),
                               **({"overrides": list(overrides)} if overrides else {})})
    trials = out["trials"]
    started, drivers = time.time(), 0
    for i, kind in enumerate(kinds):
        if args.budget_min is not None and time.time() - started > 60 * args.budget_min:
            print(f"reliability: {args.budget_min:g} minutes spent; {len(kinds) - i} trials not run", flush=True)
            out["invocations"][invocation]["not_run"] = kinds[i:]
            break
        if kind != "driver":
            when = ("after_first_step", rng.uniform(0.0, 10.0))
        elif drivers % 2 == 0:
            when = ("at", rng.uniform(5.0, 0.95 * length))
        else:
            # Start-up is most of a short run: every other driver kill falls after the first step
            # (rollouts, drafter sessions, saves, exports, pushes of steps 2 and 3).
            when = ("after_first_step", rng.uniform(0.0, 0.95 * (length - first_step)))
        drivers += kind == "driver"
        rec = {"invocation": invocation, **trial(kind, work / f"trial_{i:02d}_{kind}", args.steps, when, rng, overrides)}
        trials.append(rec)
        print(f"reliability: trial {i + 1}/{len(kinds)} {kind} killed at {rec.get('kill_at_s')}s "
              f"({rec.get('phase', rec.get('why'))}): resumed={rec.get('resumed')} "
              f"from step {rec.get('resumed_from')}, lost {rec.get('lost_checkpoints')}, "
              f"back at work after {rec.get('time_to_recover_s')}s", flush=True)
        write(out, Path(args.out))
    write(out, Path(args.out))
    print(f"reliability: {out['summary']} -> {args.out}", flush=True)
    return 0 if out["summary"]["resumed"] == out["summary"]["killed"] else 1


def previous(path: Path) -> dict:
    """The invocations and trials already in ``path``; a file from one invocation (its settings at
    the top level) becomes invocation 0."""
    if not path.exists():
        return {"invocations": [], "trials": []}
    old = json.loads(path.read_text())
    if "invocations" in old:
        return {"invocations": old["invocations"], "trials": old["trials"]}
    inv = {k: v for k, v in old.items() if k not in ("trials", "summary")}
    return {"invocations": [inv], "trials": [{"invocation": 0, **t} for t in old["trials"]]}


def write(out: dict, path: Path) -> None:
    killed = [t for t in out["trials"] if t.get("killed")]
    out["summary"] = {"trials": len(out["trials"]), "killed": len(killed),
                      "killed_by_kind": {k: sum(t["kind"] == k for t in killed) for k in TARGETS},
                      "resumed": sum(bool(t.get("resumed")) for t in killed),
                      "lost_checkpoints": sum(len(t.get("lost_checkpoints", [])) for t in killed),
                      "hung": sum(bool(t.get("hung")) for t in killed)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(out, indent=1))
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
