"""DrafterProcess: the drafter service in a child process, which survives that process's death.

A tiny random Qwen2 target on CPU. Samples enter as the actor's capture hands them over (into the
staging buffer of this process); the child trains on them; it is SIGKILLed mid-session and must
come back at its last checkpoint, with the latest target tensors, and train on."""
import os
import signal
import time

import pytest
import torch

from _drafters import captured_records
from tlt_verl.capture import verl_capture
from tlt_verl.drafter.reducer import free_port
from tlt_verl.drafter.trainer import TrainerConfig
from tlt_verl.spot.drafter_process import DrafterProcess
from tlt_verl.spot.drafter_service import DrafterServiceConfig, tensor_digest

from test_drafter_service import VOCAB, tiny_target

HOST = "127.0.0.1"


def cfg(**kw):
    trainer = TrainerConfig(lr=3e-3, warmup_steps=2, total_steps=200, grad_accum=1, tokens_per_micro=48, row_len=48)
    return DrafterServiceConfig(kind="eagle", init_seed=0, trainer=trainer, idle_poll_s=0.02, **kw)


def capture_into_this_process(target, n, seed, step):
    """What the actor update's capture does: add to whatever capture sink this process has."""
    sink = verl_capture.buffer()
    for r in captured_records(target, n, VOCAB, seed=seed, lengths=(20, 40)):
        sink.add(step, r["input_ids"], r["loss_mask"], r["final_hidden"], r["aux_hidden"])


def train_until(proc: DrafterProcess, version: int, timeout_s: float = 120.0) -> int:
    deadline = time.monotonic() + timeout_s
    while (v := proc.state_version) < version:
        assert time.monotonic() < deadline, f"state_version {v} < {version} after {timeout_s}s"
        time.sleep(0.05)
    return v


def session(proc, name):
    proc.start_session(name, 0, 1, HOST, free_port(HOST), 0)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    root = tmp_path_factory.mktemp("proc")
    model = tiny_target()
    model.save_pretrained(root / "target")
    return {"dir": str(root / "target"), "model": model, "root": root}


def test_a_bad_config_fails_at_start_in_one_line(target, tmp_path):
    with pytest.raises(ValueError, match=r"^DrafterServiceConfig.init='.*nowhere': no such model folder"):
        DrafterProcess(target["dir"], cfg(init=str(tmp_path / "nowhere")))
    assert not verl_capture.enabled()


def test_the_child_trains_on_captured_samples_and_comes_back_from_a_sigkill(target, tmp_path):
    proc = DrafterProcess(target["dir"], cfg())
    try:
        assert proc.pid != os.getpid() and verl_capture.buffer() is proc.staging
        capture_into_this_process(target["model"], 12, seed=1, step=1)
        assert len(proc.staging) == 12
        session(proc, "s1")                       # the staged samples travel with this call
        assert len(proc.staging) == 0
        train_until(proc, 5)
        stats = proc.stop()
        assert stats["error"] is None and stats["steps"] >= 5
        saved_version = proc.state_version
        ckpt = proc.save_checkpoint(tmp_path / "ckpt", global_step=1)
        assert ckpt.is_file()
        m = proc.metrics()
        assert m["tlt/drafter/buffer_samples"] == 12
        # What the drafter cost this (the actor's) process: the staged samples' hand-over; no
        # target written yet, nothing captured through the actor update's hooks.
        assert m["tlt/drafter/host/stage_s"] > 0
        assert m["tlt/drafter/host/target_handover_s"] == m["tlt/drafter/host/capture_s"] == 0

        # New target tensors arrive (verl's weight sync), then training resumes and is killed.
        from_dir = proc.target_digest()
        embed = torch.randn(VOCAB, 32)
        proc.set_target_tensors(embed, embed)
        handed = tensor_digest(embed, embed)
        assert handed != from_dir and proc.target_digest() == handed
        m = proc.metrics()                        # since the last read: the target's write only
        assert m["tlt/drafter/host/target_handover_s"] > 0 and m["tlt/drafter/host/stage_s"] < 0.05
        session(proc, "s2")
        train_until(proc, saved_version + 3)
        dead = proc.pid
        os.kill(dead, signal.SIGKILL)
        t0 = time.monotonic()
        stats = proc.stop()
        assert time.monotonic() - t0 < 5.0, "stop() waited on the restart"
        assert stats["stopped"] and f"drafter process {dead} died (killed by signal 9)" == stats["error"]
        assert stats["state_version"] == 0 and stats["steps"] == 0

        # The new child holds the checkpointed drafter (training since then is lost, nothing
        # older). In-memory samples are not checkpointed: the next actor update refills the buffer.
        assert proc.state_version == saved_version
        assert proc.pid != dead and proc.restarts == 1
        # ... and the target tensors handed in before the kill, not the target folder's.
        assert proc.target_digest() == handed
        m = proc.metrics()
        assert m["tlt/drafter/restarts"] == 1.0 and m["tlt/drafter/buffer_samples"] == 0
        exported = proc.export(tmp_path / "export")
        assert (exported / "model.safetensors").is_file()
        capture_into_this_process(target["model"], 8, seed=2, step=2)
        session(proc, "s3")
        train_until(proc, saved_version + 2)
        assert proc.stop()["error"] is None
        assert proc.metrics()["tlt/drafter/buffer_samples"] == 8
        assert proc.target_digest() == handed
    finally:
        proc.close()
    assert not verl_capture.enabled()


def test_the_child_exits_with_its_host(target):
    """The drafter does not outlive the actor process that hosts it (an orphan would hold its core)."""
    import subprocess
    import sys

    code = ("import sys, time; sys.path[:0] = sys.argv[2:]\n"
            "from tlt_verl.spot.drafter_process import DrafterProcess\n"
            "from test_drafter_process import cfg\n"
            "p = DrafterProcess(sys.argv[1], cfg()); print(p.pid, flush=True); time.sleep(600)\n")
    here = os.path.dirname(__file__)
    host = subprocess.Popen([sys.executable, "-c", code, target["dir"], here, os.path.dirname(here)],
                            stdout=subprocess.PIPE, text=True)
    child = int(host.stdout.readline())
    host.kill()
    host.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(child, signal.SIGKILL)
    pytest.fail(f"drafter process {child} outlived its host")


def test_staging_holds_one_buffer_budget_and_hands_over_in_bounded_messages():
    import torch

    from tlt_verl.capture.staging import StagingBuffer

    def sample(step, n=100, hidden=64):        # 100 states of 64 fp32: 25,600 bytes + ids and mask
        return step, torch.arange(n), torch.ones(n, dtype=torch.bool), torch.full((n, hidden), float(step))

    size = 100 * 8 + 100 + 100 * 64 * 4
    stage = StagingBuffer(budget_bytes=3 * size)
    for step in range(5):
        stage.add(*sample(step))
    # Over budget, the oldest went first, as the child's buffer would evict them on arrival.
    assert len(stage) == 3 and stage.dropped == 2 and stage.nbytes == 3 * size
    first = stage.take(max_bytes=2 * size)
    assert [s[0] for s in first] == [2, 3] and stage.nbytes == size
    assert [s[0] for s in stage.take(max_bytes=1)] == [4]   # at least one, even over the limit
    assert stage.take() == [] and stage.nbytes == 0
    # Staged samples own their storage: a view of a whole micro-batch is not kept alive.
    batch = torch.zeros(10, 100, 64)
    stage.add(0, torch.arange(100), torch.ones(100, dtype=torch.bool), batch[3])
    assert stage.take()[0][3].untyped_storage().nbytes() == 100 * 64 * 4


def _staging_peak(spec: dict) -> dict:
    """In a fresh process (its own high-water mark): capture far more states than the buffer's
    budget into the staging buffer, then hand them to the drafter process as a step does."""
    import re
    from pathlib import Path

    from tlt_verl.capture.buffer import BufferConfig

    def status(key):
        return int(re.search(rf"{key}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) << 10

    budget = spec["budget_mib"] << 20
    proc = DrafterProcess(spec["target"], cfg(buffer=BufferConfig(kind="eagle", budget_bytes=budget)))
    try:
        proc.metrics()                                        # the pipe and the child up
        tokens, hidden = spec["tokens"], spec["hidden"]
        base = status("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")         # reset VmHWM
        captured = 0
        for i in range(spec["samples"]):
            ids = torch.randint(0, VOCAB, (tokens,))
            states = torch.randn(tokens, hidden)
            proc.staging.add(1, ids, torch.ones(tokens, dtype=torch.bool), states)
            captured += ids.nbytes + tokens + states.nbytes
            del ids, states
        proc.metrics()                                        # staged samples go to the child first
        return {"peak_added": status("VmHWM") - base, "captured": captured, "budget": budget,
                "dropped": proc.staging.dropped, "left": len(proc.staging)}
    finally:
        proc.close()


def test_capture_staging_adds_about_one_buffer_budget_to_the_actor_not_everything_captured(target, tmp_path):
    from _subproc import run_in_subprocess

    # 192 samples of 4,096 states of 32 floats: 103 MiB captured against a 16 MiB budget.
    r = run_in_subprocess(__file__, {"target": target["dir"], "budget_mib": 16, "tokens": 4096, "hidden": 32,
                                     "samples": 192}, tmp_path, timeout=300)
    assert r["captured"] > 6 * r["budget"] and r["dropped"] > 0 and r["left"] == 0
    # Held: at most the budget, plus the message it is serialised into while it is handed over
    # (a quarter of the budget; torch.save's buffer grows by doubling, so up to half a budget),
    # plus allocator slack. Unbounded, the 103 MiB captured would all be staged and serialised.
    assert r["peak_added"] <= 2.5 * r["budget"], r
    # ... and not much less than the budget: the stage really holds a budget's worth before the
    # hand-over (as the child's buffer would), and the measurement saw it. A stage that kept
    # less, or a high-water mark that missed the staged states, would pass the bound above alone.
    assert r["peak_added"] >= 0.75 * r["budget"], r


if __name__ == "__main__":
    from _subproc import child_main

    child_main(_staging_peak)
