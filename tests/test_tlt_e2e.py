"""`+tlt.enable=true` on the stock tiny GRPO recipe: verl's trainer with the drafter, end to end,
on one node and then across two.

One run of 3 steps on a local Ray (checkpoints every step, the recipe's bypass mode) whose drafter
process is SIGKILLed while it trains in step 3, and whose trainer is SIGKILLed in the middle of step
3's checkpoint save (its drafters and verl's actor files written, verl's tracker not yet); then a
resumed run of step 3 again from verl's own checkpoint (`trainer.resume_mode=auto`: step 2's) on two Ray
nodes started with docker/launch.sh (one trainer rank and one replica per node, the same world
size), with bypass mode off, so that verl recomputes the old log-probs with the actor. Checked: the
drafter trains in the long tail on drained replicas, on states captured from the actor update (verl
ran no old log-prob pass), and is pushed; SD runs in the rollout and the engine's log-probs still
equal the actor's (sampling stayed the policy's own); `tlt/...` metrics reach verl's metrics; the
drafter's checkpoint sits in verl's step folder and the resumed run continues from the step verl
marked saved, not from the newer unfinished save, with nothing lost (bench/reliability.py's own
verdict), on the other cluster's ranks.
"""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import reliability  # noqa: E402

from tlt_verl.integration.config import SpotSection
from tlt_verl.launch.runner import RunConfig, RunError, run

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leftover_ray")]

TLT = ["+tlt.enable=true", "+tlt.drafter.init=scratch", "trainer.save_freq=1",
       # Short pulls: the bandit moves within the few decode steps of a two-step run.
       "+tlt.sd.steps_per_pull=4"]
# The first run trains the drafter in the rollout although the replicas run on CPU: training,
# capture, pushes and their recovery are what it checks. The resumed run keeps the default
# (tlt.spot.train_drafter=auto), which on CPU serves the resumed drafter without training it.
TRAIN = ["+tlt.spot.train_drafter=true"]


# The process that saves the checkpoint (verl's TaskRunner actor) SIGKILLs itself in the middle
# of this step's save (bench/reliability.py's in-save hook).
KILL_IN_SAVE = 3


def _metrics(run_dir):
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        d = json.loads(line)
        out[d["step"]] = d["data"]
    return out


def _kill_drafter_in_step_3(run_dir, killed: dict, timeout_s: float = 1500) -> None:
    """Once step 2's checkpoint is complete, SIGKILL the first drafter process that starts
    training while step 3 rolls out (the child of the actor rank that hosts it)."""
    latest = _ckpt_root(run_dir) / "latest_checkpointed_iteration.txt"
    log, pat = run_dir / "verl.log", re.compile(r"tlt: rank \d+ \(pid (\d+)\) trains the drafter")
    deadline, offset = time.time() + timeout_s, None
    while time.time() < deadline:
        if offset is None:
            if latest.exists() and latest.read_text().strip() == "2":
                offset = log.stat().st_size
        else:
            m = pat.search(log.read_text(errors="replace")[offset:])
            if m:
                time.sleep(0.5)   # mid-session: a few drafter micro-steps in
                os.kill(int(m.group(1)), signal.SIGKILL)
                killed["pid"] = int(m.group(1))
                return
        time.sleep(0.2)


@pytest.fixture(scope="module")
def runs(assets, no_leftover_ray, tmp_path_factory, request, tlt_e2e_run):   # verl's local Ray in this module's own temp dir
    run_dir = tmp_path_factory.mktemp("tlt_e2e")
    hook = tmp_path_factory.mktemp("kill_hook")
    killed: dict = {}
    killer = threading.Thread(target=_kill_drafter_in_step_3, args=(run_dir, killed), daemon=True)
    killer.start()
    with pytest.MonkeyPatch.context() as mp:
        for key, value in reliability.in_save_hook(hook, KILL_IN_SAVE, "kill").items():
            mp.setenv(key, value)
        try:
            first = run(RunConfig(steps=3, run_dir=run_dir, quiet=True, assets_root=assets["root"],
                                  overrides=TLT + TRAIN))
        except RunError as e:
            first = {"error": str(e)}
    killer.join(timeout=5)
    # The killed run's local cluster (its raylet, workers and engines) is ended by process id.
    left_running = len(no_leftover_ray.stop())
    m1 = _metrics(run_dir)
    log1 = (run_dir / "verl.log").read_text()
    ckpts = sorted(p.name for p in _ckpt_root(run_dir).glob("global_step_*"))
    # What the resume may count on (step 2), and the unfinished save it must not take (step 3).
    saved = reliability.saved_on_disk(run_dir)
    unfinished = reliability.check_step(run_dir, KILL_IN_SAVE)
    # The cluster starts once the local one has ended: its idle nodes would slow the first run.
    c = request.getfixturevalue("two_node_cluster")
    cmd = [*c["launch"], "submit", "--address", c["address"], "--nodes", "2", "--",
           sys.executable, "-m", "tlt_verl.cli", "run", "--drafter", "scratch", "--steps", "3", "--run-dir", str(run_dir),
           "trainer.nnodes=2", "trainer.n_gpus_per_node=1", *TLT,
           "trainer.resume_mode=auto", "algorithm.rollout_correction.bypass_mode=False"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(c["env"], TLT_HOME=str(assets["root"].parent)),
                         timeout=1500)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    second = json.loads((run_dir / "steps.json").read_text())
    log2 = (run_dir / "verl.log").read_text()
    tlt_e2e_run["dir"] = run_dir
    return {"dir": run_dir, "m1": m1, "log1": log1, "killed": killed, "first": first, "ckpts": ckpts,
            "kill_in_save": {"hook_fired": (hook / "fired").exists(), "left_running": left_running,
                             "saved": saved, "unfinished": unfinished,
                             "verdict": reliability.resume_verdict(saved, log2, second["steps"][-1]["step"] == 3)},
            "second": second, "m2": _metrics(run_dir), "log2": log2, "stdout2": out.stdout, "cluster": c}


def _ckpt_root(run_dir):
    return run_dir / "checkpoints" / "tlt" / "tiny_cpu_grpo"


def test_tlt_run_completes_and_reports_tlt_metrics(runs):
    m1 = runs["m1"]
    # Step 3's metrics were never logged: verl logs a step after saving it, and the trainer was
    # killed in that save.
    assert sorted(m1) == [1, 2], runs["first"].get("error")
    for step, m in m1.items():
        # Step 1 starts every bucket on the largest k; from then on SD runs where it pays, and a
        # scratch drafter pays nowhere, unless a trained drafter was pushed after the step before
        # (the policy measures a pushed drafter with one pull of the largest k in every bucket).
        pushed = step == 1 or m1[step - 1]["tlt/spot/train_steps"] > 0
        assert (0.0 < m["tlt/sd/sd_step_share"] <= 1.0) if pushed else (0.0 <= m["tlt/sd/sd_step_share"] <= 1.0), \
            (step, m["tlt/sd/sd_step_share"], pushed)
        if m["tlt/sd/sd_step_share"] > 0:
            assert m["tlt/sd/acceptance_length"] >= 1.0
        if m["tlt/spot/train_steps"] > 0:
            # The drafter trained, so it was exported and pushed to the replicas before the next
            # rollout: that push is on the critical path, and takes time.
            assert m["tlt/drafter_critical_path_s"] > 0.0, (step, m)
        assert m["tlt/spot/rollout_s"] > 0
    # One replica drains before the other: the drafter trained in that time (from step 2 on:
    # step 1 has nothing captured yet).
    assert sum(m["tlt/spot/harvested_s"] for m in m1.values()) > 0
    assert sum(m["tlt/spot/train_steps"] for m in m1.values()) >= 1
    assert any(m.get("tlt/drafter/state_version", 0) > 0 for m in m1.values())
    # Drafter training never held the trainer up for long: preemption plus push, and what it
    # costs the actor's process (capture in the update, the hand-overs), measured every step.
    for m in m1.values():
        assert m["tlt/drafter_critical_path_s"] < 0.25 * m["timing_s/step"], m
        assert m["tlt/drafter/host_s"] < 0.25 * m["timing_s/step"], m
    assert all(m["tlt/drafter/host/capture_s"] > 0 for m in m1.values())
    # No extra forward: with the recipe's bypass mode verl ran no old log-prob pass (which would
    # report the actor's entropy and its log-prob gap to the rollout); the drafter trained anyway.
    for m in m1.values():
        assert "actor/entropy" not in m and "training/rollout_probs_diff_max" not in m, sorted(m)


def test_sampling_stays_the_policys_own_with_sd_on(runs):
    """With bypass mode off, verl recomputes the sampled tokens' log-probs with the actor: with SD
    on (the resumed drafter, after the resumed target's weight sync) the engine's log-probs still
    match them. The resumed step samples with the weights loaded from step 3's checkpoint and
    pushed to the engines, so a push that did not reach an engine shows up as a large difference."""
    for step, m in runs["m2"].items():
        assert abs(m["actor/pg_loss"]) > 0 or m["actor/grad_norm"] > 0  # the actor moved
        assert m["training/rollout_probs_diff_valid"] == 1.0
        assert m["training/rollout_probs_diff_max"] < 2e-3, (step, m["training/rollout_probs_diff_max"])
        assert m["training/rollout_probs_diff_mean"] < 1e-4
        assert m["training/rollout_actor_probs_pearson_corr"] > 0.999


def test_resumed_run_spans_both_nodes(runs):
    """docker/launch.sh's two nodes: one trainer rank per node (nnodes=2 x 1 slot), and each
    replica's server beside its rank."""
    assert "launch.sh: 2 nodes, 16 CPUs, 2 GPUs" in runs["stdout2"]
    assert runs["second"]["summary"]["replicas"] >= 2
    c = runs["cluster"]
    # In a fresh process: Ray reads its authentication mode once, at import.
    query = ("import json, ray; from ray.util.state import list_actors; ray.init(log_to_driver=False); "
             "print(json.dumps([[a.class_name, a.node_id] for a in list_actors(limit=10000, detail=True)]))")
    out = subprocess.run([sys.executable, "-c", query], capture_output=True, text=True, timeout=120,
                         env=dict(c["env"], RAY_ADDRESS=c["address"]))
    assert out.returncode == 0, out.stderr[-2000:]
    actors = json.loads(out.stdout.strip().splitlines()[-1])
    nodes_of = lambda part: {node for name, node in actors if part in (name or "")}
    assert len(nodes_of("WorkerDict")) == 2, actors
    assert len(nodes_of("VllmServer")) == 2, actors


def test_spot_timeline_shows_training_on_drained_replicas(runs):
    lines = (_ckpt_root(runs["dir"]) / "tlt" / "spot_timeline.jsonl").read_text().splitlines()
    entries = [json.loads(x) for x in lines]
    states = {st for e in entries for spans in e["replicas"].values() for _, _, st in spans}
    assert {"generating", "training"} <= states, states
    for e in entries:
        for spans in e["replicas"].values():
            for t0, t1, _ in spans:
                assert 0 <= t0 <= t1
    # The runner drew it, and its per-step records carry the TLT figures it printed.
    assert (runs["dir"] / "spot_timeline.png").stat().st_size > 10_000
    for s in runs["second"]["steps"]:
        assert set(s["tlt"]) >= {"sd_share", "acceptance_length", "harvested_s", "critical_path_s"}


def _advanced_by(saved, later, most: int) -> bool:
    """Whether the random stream state ``later`` is ``saved`` after at most ``most`` draws."""
    import random

    rng, want = random.Random(), (later[0], tuple(later[1]), later[2])
    rng.setstate((saved[0], tuple(saved[1]), saved[2]))
    for _ in range(most + 1):
        if rng.getstate() == want:
            return True
        rng.random()
    return False


def test_drafter_checkpoint_in_verl_step_folder_and_resume(runs):
    root = _ckpt_root(runs["dir"])
    for step in (1, 2, 3):
        folder = root / f"global_step_{step}" / "tlt_drafter"
        assert (folder / "sd_policy.json").is_file()
        for rank in (0, 1):
            assert any((folder / f"rank_{rank}").iterdir()), folder
        # verl ran its synchronous path (an async mode would also checkpoint its TransferQueue).
        assert not (root / f"global_step_{step}" / "transfer_queue").exists()
    assert re.search(r"tlt: drafter resumed from \S*global_step_2 on 2/2 ranks", runs["log2"]), runs["log2"][-3000:]
    # The bandit carries on from the saved state. The resumed run names the pulls it loaded: the
    # bandit's selections, one per bucket at the start and one after each completed pull (counted
    # here from the arms' pull counts). And the states its replicas saved after step 3 (its save
    # overwrote the killed run's) continue step 2's: no arm's count went down, and each random
    # stream is the saved one advanced by step 3's selections (two draws at most each), not one
    # started over.
    def policy(step):
        return json.loads((_ckpt_root(runs["dir"]) / f"global_step_{step}" / "tlt_drafter" / "sd_policy.json").read_text())

    saved, after = policy(2), policy(3)
    assert len(saved) == len(after) >= 2 and all(saved) and all(after)
    selections = sum(sum(map(sum, s["bandit"]["counts"])) + len(s["bandit"]["counts"]) for s in saved)
    assert f"SD policy resumed: {selections} bandit pulls" in runs["log2"], runs["log2"][-3000:]
    for s3, s4 in zip(saved, after):
        c3, c4 = s3["bandit"]["counts"], s4["bandit"]["counts"]
        assert sum(map(sum, c3)) > 0 and all(x4 >= x3 for b3, b4 in zip(c3, c4) for x3, x4 in zip(b3, b4)), (c3, c4)
        new = sum(map(sum, c4)) - sum(map(sum, c3))
        assert _advanced_by(s3["bandit"]["rng"], s4["bandit"]["rng"], 2 * new), (c3, c4)
    m2 = runs["m2"]
    assert sorted(m2) == [3]
    # The resumed drafter carries on from the saved one (its optimizer step count), not from scratch.
    assert m2[3]["tlt/drafter/state_version"] >= runs["m1"][2]["tlt/drafter/state_version"] > 0


def test_on_cpu_the_default_serves_the_drafter_without_training_or_capture(runs):
    """tlt.spot.train_drafter: the first run set it true and trained on states captured from the
    actor update; the resumed run kept auto, which on CPU trains nothing and captures nothing (a
    drained replica's core is not idle there), while SD still ran with the resumed drafter."""
    assert "tlt: drafter training in the rollout: on (tlt.spot.train_drafter=True, rollout on cpu)" in runs["log1"]
    assert "tlt: drafter training in the rollout: off (tlt.spot.train_drafter=auto, rollout on cpu)" in runs["log2"]
    assert any(m["tlt/drafter/buffer_samples"] > 0 for m in runs["m1"].values())
    m = runs["m2"][3]
    assert m["tlt/spot/train_steps"] == 0 and m["tlt/spot/sessions"] == 0 and m["tlt/drafter/buffer_samples"] == 0
    assert m["tlt/drafter/host_s"] == 0.0
    assert m["tlt/sd/sd_step_share"] > 0
    # With nothing to train the coordinator only keeps the timeline: it looked at the replicas
    # every tlt.spot.observe_interval_s, where the training rollouts looked every poll_interval_s.
    spot = SpotSection()
    rate = lambda m: m["tlt/spot/polls"] / m["tlt/spot/rollout_s"]
    assert 0 < m["tlt/spot/polls"] <= m["tlt/spot/rollout_s"] / spot.observe_interval_s + 2, m
    assert max(rate(m1) for m1 in runs["m1"].values()) > 3 / spot.observe_interval_s, \
        {s: rate(x) for s, x in runs["m1"].items()}


def test_sigkill_of_the_drafter_mid_step_loses_no_checkpoint(runs):
    """The drafter's process was SIGKILLed while it trained in step 3: the actor rank that hosts it
    lived on, restarted it from step 2's drafter checkpoint, and step 3's save holds every rank's
    drafter, whole (the restarted one's; checked before the resume rewrote the step)."""
    pid = runs["killed"].get("pid")
    assert pid, "no drafter session started in step 3"
    assert f"tlt: drafter process {pid} died (killed by signal 9)" in runs["log1"]
    assert re.search(r"tlt: drafter process \d+ resumed from \S*global_step_2/tlt_drafter/rank_\d/ckpt-\S+\.pt",
                     runs["log1"]), runs["log1"][-3000:]
    assert runs["m1"][2]["tlt/drafter/restarts"] == 0
    unfinished = runs["kill_in_save"]["unfinished"]
    assert unfinished["problems"] == [] and len(unfinished["drafter_versions"]) == 2, unfinished


def test_a_trainer_killed_in_the_middle_of_a_save_resumes_with_nothing_lost(runs):
    """verl's trainer (the TaskRunner actor that runs the training loop and saves) was SIGKILLed
    in step 3's save, after its drafters and verl's actor files were written and before verl
    marked the step saved; the run ended there. Judged by bench/reliability.py's own checks:
    every step verl marked saved was whole after the kill; the resumed run named step 2's
    checkpoint, not step 3's newer unfinished one, resumed every rank's drafter at its saved
    version or later and the bandit at its saved pulls, and finished; step 3 was saved again,
    whole, by the resumed run."""
    k = runs["kill_in_save"]
    assert k["hook_fired"] and "The actor died unexpectedly" in runs["first"].get("error", ""), runs["first"]
    assert runs["ckpts"] == ["global_step_1", "global_step_2", "global_step_3"]
    assert k["saved"]["saved_step"] == 2 and k["saved"]["checkpoint_problems"] == [], k["saved"]
    v = k["verdict"]
    assert v["resumed_from"] == 2 and v["lost_checkpoints"] == [], v
    assert v["drafter_at_saved_version_or_later"] and len(v["resumed_drafter_versions"]) == 2, v
    assert v["bandit_resumed"] and v["resumed"], v
    assert reliability.saved_step(runs["dir"]) == 3
    assert reliability.check_step(runs["dir"], 3)["problems"] == []
    assert sorted(runs["m2"]) == [3] and runs["second"]["steps"][-1]["step"] == 3


def test_each_save_leaves_an_export_for_serving(runs):
    """trainer.save_freq=1: every saved step (1-2, and 3 of the resumed run) has its export, the
    policy in Hugging Face format beside the freshest drafter, whole against its manifest; the
    drafter is the one the step's metrics report as freshest, and the acceptance recorded is the
    step's own. tests/test_serve.py serves an export."""
    from tlt_verl.serve.export import find_exports, read_export

    root = _ckpt_root(runs["dir"]) / "tlt" / "export"
    folders = find_exports(root)
    assert [p.name for p in folders] == ["step_1", "step_2", "step_3"]
    metrics = {**runs["m1"], **runs["m2"]}
    for folder in folders:
        m = read_export(folder, hashes=True).manifest
        step = m["step"]
        assert m["policy"]["architecture"] == "Qwen2ForCausalLM" and "policy/model.safetensors" in m["files"]
        assert set(m["drafter"]["layouts"]) == {"vllm", "sglang"}
        assert m["drafter"]["state_version"] == metrics[step]["tlt/drafter/state_version"], step
        assert m["acceptance"]["step"] == step
        assert m["acceptance"]["acceptance_length"] == pytest.approx(metrics[step]["tlt/sd/acceptance_length"])
        assert m["serve"] == {"dtype": "float32", "max_model_len": 1536, "num_speculative_tokens": 3}
        assert metrics[step]["tlt/export_s"] > 0
