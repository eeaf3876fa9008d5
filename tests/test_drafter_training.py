"""Drafter training: data buffer, hidden-state capture, preemptible / data-parallel trainer,
atomic checkpoints, warm-up CLI. Tiny random Qwen2 targets on CPU; seconds each."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from _drafters import Interleaved, captured_records
from tlt_verl.capture import BufferConfig, DataBuffer, capture_hidden, capture_samples
from tlt_verl.drafter import DrafterConfig, LossConfig, build_drafter, target_tensors
from tlt_verl.drafter.checkpoint import CheckpointError, CheckpointManager, load_latest
from tlt_verl.drafter.trainer import DrafterTrainer, TrainerConfig, lr_at

torch.set_num_threads(1)
VOCAB = 96
REPO = Path(__file__).resolve().parents[1]


def tiny_target(seed=0, **over):
    torch.manual_seed(seed)
    base = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=128,
                tie_word_embeddings=False, initializer_range=0.2)
    return Qwen2ForCausalLM(Qwen2Config(**{**base, **over})).eval()


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def drafter_for(target, kind="eagle", seed=1):
    torch.manual_seed(seed)
    return build_drafter(DrafterConfig.from_target(target.config, kind=kind), *target_tensors(target))


def records(target, n, seed=0, kind="eagle", lengths=(6, 20)):
    return captured_records(target, n, VOCAB, seed=seed, kind=kind, lengths=lengths)


def fill(buffer, recs, steps):
    for r, step in zip(recs, steps):
        buffer.add(step, r["input_ids"], r["loss_mask"], r["final_hidden"], r["aux_hidden"])
    return buffer


def small_cfg(**over):
    base = dict(lr=3e-3, warmup_steps=2, total_steps=8, grad_accum=1, tokens_per_micro=48, row_len=48)
    return TrainerConfig(**{**base, **over})


# ---------------------------------------------------------------- buffer

def test_buffer_budget_evicts_oldest_steps_first_and_stores_half(target):
    recs = records(target, 8, lengths=(10, 11))                 # equal lengths: equal sizes
    one = 10 * 4 + 10 + 10 * 32 * 2                               # int32 ids, bool mask, bf16 [T, H]
    buf = DataBuffer(BufferConfig(budget_bytes=3 * one))
    # Steps arrive out of order once: step 0 data after step 2 is still the oldest.
    fill(buf, recs, [1, 1, 2, 2, 0, 3, 3, 4])
    assert buf.memory_bytes <= 3 * one and len(buf) == 3
    assert [buf.get(i).step for i in buf.ids()] == [3, 3, 4]
    assert buf.stats.dropped == 5
    s = buf.get(buf.ids()[0])
    assert s.final_hidden.dtype == torch.bfloat16 and s.input_ids.dtype == torch.int32 and s.aux_hidden is None
    torch.testing.assert_close(s.final_hidden.float(), recs[5]["final_hidden"], atol=0.02, rtol=0.01)
    fp16 = fill(DataBuffer(BufferConfig(dtype="float16")), recs[:1], [0])
    assert fp16.get(0).final_hidden.dtype == torch.float16
    e3 = records(target, 1, kind="eagle3")[0]
    b3 = fill(DataBuffer(BufferConfig(kind="eagle3")), [e3], [0])
    assert b3.get(0).aux_hidden.shape == (len(e3["input_ids"]), 3 * 32)
    with pytest.raises(ValueError, match=r"^DataBuffer.add: kind='eagle3' needs aux_hidden"):
        DataBuffer(BufferConfig(kind="eagle3")).add(0, *[recs[0][k] for k in ("input_ids", "loss_mask", "final_hidden")])
    with pytest.raises(ValueError, match=r"^BufferConfig.dtype='float32': must be one of bfloat16, float16$"):
        BufferConfig(dtype="float32")
    with pytest.raises(ValueError, match=r"^BufferConfig.budget_bytes=0: must be a positive int$"):
        BufferConfig(budget_bytes=0)


def test_buffer_spills_to_disk_and_reloads_lazily(target, tmp_path):
    recs = records(target, 6, kind="eagle3", lengths=(10, 11))
    one = 10 * 4 + 10 + 4 * 10 * 32 * 2
    cfg = BufferConfig(kind="eagle3", budget_bytes=2 * one, spill_dir=str(tmp_path / "spill"))
    buf = fill(DataBuffer(cfg), recs, [0, 0, 1, 1, 2, 2])
    assert len(buf) == 6 and buf.memory_bytes <= 2 * one and buf.stats.spilled == 4
    assert buf.ids("disk") == [0, 1, 2, 3] and buf.ids("memory") == [4, 5]
    files = sorted(p.name for p in (tmp_path / "spill").iterdir())
    assert files and all(f.startswith("step0000000") and f.endswith(".safetensors") for f in files)
    for i in range(6):
        s = buf.get(i)
        assert torch.equal(s.final_hidden, recs[i]["final_hidden"].to(torch.bfloat16))
        assert torch.equal(s.aux_hidden, recs[i]["aux_hidden"].to(torch.bfloat16))
        assert torch.equal(s.input_ids.long(), recs[i]["input_ids"]) and torch.equal(s.loss_mask, recs[i]["loss_mask"])
    # Metadata round trip: a fresh buffer (after a restart) re-attaches what is on disk.
    state = json.loads(json.dumps(buf.state_dict()))
    again = DataBuffer(cfg)
    again.load_state_dict(state)
    assert again.ids() == [0, 1, 2, 3] and again.stats.spilled == 4
    assert torch.equal(again.get(2).aux_hidden, buf.get(2).aux_hidden)
    assert fill(again, recs[:1], [3]) == again and again.ids()[-1] == 6         # ids keep counting
    # A disk budget deletes the oldest step's files first.
    tight = BufferConfig(kind="eagle3", budget_bytes=2 * one, spill_dir=str(tmp_path / "s2"),
                         spill_budget_bytes=int(2.5 * one))
    b2 = fill(DataBuffer(tight), recs, [0, 0, 1, 1, 2, 2])
    assert sorted({b2.get(i).step for i in b2.ids("disk")}) == [1] and b2.spill_bytes <= 2.5 * one


def test_sample_batches_prefer_recent_steps_and_resume(target):
    recs = records(target, 40, lengths=(6, 12))
    buf = fill(DataBuffer(), recs, [i // 10 for i in range(40)])          # steps 0..3
    first = next(buf.sample_batches(60, recency_decay=0.2))[0]
    assert sum(s.length - 1 for s in first) <= 60
    assert sum(s.step == 3 for s in first) > len(first) / 2, [s.step for s in first]
    newest = [s.step for s, _ in zip((s for b, _ in buf.sample_batches(60, recency_decay=0.0) for s in b), range(25))]
    assert set(newest) == {3}                                              # decay 0: newest step only
    it = buf.sample_batches(50, seed=3)
    seen = [next(it) for _ in range(7)]
    again = buf.sample_batches(50, seed=3, cursor=seen[3][1])
    for want in seen[4:]:
        got = next(again)
        assert [s.id for s in got[0]] == [s.id for s in want[0]] and got[1] == want[1]
    one_pass = [s.id for s in next(buf.sample_batches(10_000))[0]]       # all of it fits one batch
    assert sorted(one_pass) == list(range(40))                             # a pass is a permutation
    with pytest.raises(ValueError, match="no samples to train on"):
        next(DataBuffer().sample_batches(10))


# ---------------------------------------------------------------- capture

def test_capture_matches_hf_output_hidden_states(target):
    aux_ids = (0, 2, 3)
    seqs = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (7, 12, 4)]
    want = []
    with torch.no_grad():
        for s in seqs:
            hs = target(s[None], output_hidden_states=True).hidden_states
            want.append((hs[-1][0], torch.cat([hs[k][0] for k in aux_ids], -1)))
    # Unpadded: the very same forward, so bit-equal.
    cap = capture_hidden(target, seqs[1][None], aux_layer_ids=aux_ids)
    assert torch.equal(cap.final[0], want[1][0]) and torch.equal(cap.aux[0], want[1][1])
    # Left-padded batch: positions restart at each row's first real token.
    W = 12
    ids = torch.zeros(3, W, dtype=torch.long)
    mask = torch.zeros(3, W, dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, W - len(s):], mask[r, W - len(s):] = s, 1
    cap = capture_hidden(target, ids, mask, aux_layer_ids=aux_ids)
    for r, s in enumerate(seqs):
        torch.testing.assert_close(cap.final[r, W - len(s):], want[r][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cap.aux[r, W - len(s):], want[r][1], atol=1e-5, rtol=1e-5)
    # Per-sample records (right padding, length-bucketed batches) line up token by token.
    out = capture_samples(target, seqs, [2, 5, 1], aux_layer_ids=aux_ids, batch_tokens=16)
    for r, s in enumerate(seqs):
        assert torch.equal(out[r]["input_ids"], s)
        assert out[r]["loss_mask"].tolist() == [t >= [2, 5, 1][r] for t in range(len(s))]
        torch.testing.assert_close(out[r]["final_hidden"], want[r][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[r]["aux_hidden"], want[r][1], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"aux_layer_ids=\[4\]: ids must be in \[0, 3\]"):
        capture_hidden(target, seqs[0][None], aux_layer_ids=(4,))


# ---------------------------------------------------------------- trainer

def test_lr_schedule_warmup_then_cosine():
    c = TrainerConfig(lr=1.0, warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    assert [lr_at(c, s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(c, 4) == 1.0 and abs(lr_at(c, 9) - 0.55) < 1e-12 and lr_at(c, 14) == lr_at(c, 99) == pytest.approx(0.1)
    with pytest.raises(ValueError, match=r"^TrainerConfig.grad_accum=0: must be >= 1$"):
        TrainerConfig(grad_accum=0)


def _weights(trainer):
    return {k: v.clone() for k, v in trainer.drafter.state_dict().items()}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_stop_mid_accumulation_discards_partial_step(target, kind):
    buf = fill(DataBuffer(BufferConfig(kind=kind)), records(target, 16, kind=kind), [0] * 16)
    ref = DrafterTrainer(drafter_for(target, kind), buf, small_cfg(grad_accum=3))
    ref_hist = ref.train(max_steps=2).history
    calls = iter(range(100))
    tr = DrafterTrainer(drafter_for(target, kind), buf, small_cfg(grad_accum=3))
    after_one = {}
    res = tr.train(stop=lambda: next(calls) >= 4, on_step=lambda s, m: after_one.update(_weights(tr)))
    assert (res.steps, res.stopped, res.micro_steps, res.discarded_micro_steps) == (1, True, 4, 1)
    assert _same(_weights(tr), after_one) and tr.step == 1
    assert all(p.grad is None for p in tr.params)
    # The discarded micro-batch is replayed: step 2 is the uninterrupted run's step 2.
    again = tr.train(max_steps=1).history
    assert [h["loss"] for h in res.history + again] == [h["loss"] for h in ref_hist]
    assert _same(_weights(tr), _weights(ref))


def test_stop_event_from_another_thread_returns_within_one_micro_step(target):
    buf = fill(DataBuffer(), records(target, 64, lengths=(30, 40)), [0] * 64)
    # Four micro-steps a step: an implementation that finished the step before stopping would
    # start up to three after the stop, which the count below tells from the one that may race it.
    tr = DrafterTrainer(drafter_for(target), buf, small_cfg(grad_accum=4, tokens_per_micro=120, row_len=60))
    starts, durations, snaps = [], [], []
    inner = tr._micro_step

    def timed(samples):
        t0 = time.perf_counter()
        starts.append(t0)
        out = inner(samples)
        durations.append(time.perf_counter() - t0)
        return out

    tr._micro_step = timed
    stop = threading.Event()
    set_at, steps_at_set = [], []

    def stopper():
        while tr.step < 2:
            time.sleep(0.001)
        time.sleep(0.6 * (durations[-1] if durations else 0.01))   # likely mid-accumulation
        set_at.append(time.perf_counter())
        stop.set()
        set_at.append(time.perf_counter())
        steps_at_set.append(tr.step)

    th = threading.Thread(target=stopper)
    th.start()
    res = tr.train(stop=stop, on_step=lambda s, m: snaps.append((_weights(tr), {k: v.clone() for k, v in tr.optimizer.state_dict()["state"][0].items()})))
    returned = time.perf_counter()
    th.join()
    assert res.stopped and res.steps == tr.step >= 2
    # The behaviour, counted in work (which a busy machine does not change): after the stop no
    # micro-step starts but the one whose check raced the set, and no optimizer step completes
    # but one that micro-step may have finished.
    assert sum(t > set_at[1] for t in starts) <= 1, (set_at, starts[-4:])
    assert tr.step <= steps_at_set[0] + 1, (tr.step, steps_at_set)
    # And in time: that work, plus a margin for a shared 2-core box that has descheduled this
    # process (not a bound on the work: one more step would take 4 micro-steps).
    waited = returned - set_at[1]
    assert waited <= 2 * max(durations) + 1.0, (waited, max(durations))
    weights, adam = snaps[-1]
    assert _same(_weights(tr), weights)
    now = tr.optimizer.state_dict()["state"][0]
    assert all(torch.equal(now[k], adam[k]) for k in adam)


def test_resume_from_checkpoint_repeats_the_uninterrupted_losses(target, tmp_path):
    buf = fill(DataBuffer(), records(target, 24), [i // 8 for i in range(24)])
    full = DrafterTrainer(drafter_for(target), buf, small_cfg())
    losses = [h["loss"] for h in full.train(max_steps=6).history]
    first = DrafterTrainer(drafter_for(target), buf, small_cfg())
    head = [h["loss"] for h in first.train(max_steps=3).history]
    mgr = CheckpointManager(tmp_path / "ck")
    handle = mgr.save_async({**first.state_dict(), "buffer": buf.state_dict()}, step=first.step)
    first.train(max_steps=2)                  # training goes on while the copy is written
    handle.wait()
    resumed = DrafterTrainer(drafter_for(target, seed=9), buf, small_cfg())
    loaded = load_latest(tmp_path / "ck")
    assert loaded.step == 3 and loaded.refused == [] and loaded.state["buffer"]["next_id"] == 24
    assert not any("embed" in k or "target" in k for k in loaded.state["drafter"])
    resumed.load_state_dict(loaded.state)
    tail = [h["loss"] for h in resumed.train(max_steps=3).history]
    assert head + tail == losses                                     # bit-identical
    assert _same(_weights(resumed), _weights(full))
    other = DrafterTrainer(drafter_for(target, "eagle3"), buf, small_cfg())
    with pytest.raises(ValueError, match=r"^checkpoint drafter config differs from this drafter's in kind, aux_layer_ids$"):
        other.load_state_dict(loaded.state)


def test_corrupt_checkpoint_is_refused_and_previous_used(target, tmp_path):
    buf = fill(DataBuffer(), records(target, 8), [0] * 8)
    tr = DrafterTrainer(drafter_for(target), buf, small_cfg())
    mgr = CheckpointManager(tmp_path, keep=2)
    tr.train(max_steps=1)
    mgr.save(tr.state_dict(), tr.step)
    tr.train(max_steps=1)
    newest = mgr.save(tr.state_dict(), tr.step)
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="sha256 does not match its manifest"):
        loaded = load_latest(tmp_path)
    assert loaded.step == 1 and len(loaded.refused) == 1 and "\n" not in loaded.refused[0]
    newest.write_bytes(bytes(data[:100]))                                   # truncated
    with pytest.warns(UserWarning, match="corrupt or truncated"):
        assert load_latest(tmp_path).step == 1
    for p in tmp_path.glob("*.pt"):
        p.write_bytes(b"x")
    with pytest.warns(UserWarning), pytest.raises(CheckpointError, match=r"no loadable checkpoint \(2 refused;") as e:
        load_latest(tmp_path)
    assert "\n" not in str(e.value)
    with pytest.raises(CheckpointError, match="not found"):
        load_latest(tmp_path / "nope")


KILLED_WRITER = r"""
import os, sys, time, torch
from tlt_verl.drafter.checkpoint import CheckpointManager
mgr = CheckpointManager(sys.argv[1])
mgr.save({"w": torch.ones(1000), "step": 1}, 1)
real = os.fsync
def hang(fd):
    print("writing", flush=True)
    time.sleep(600)
os.fsync = hang
mgr.save({"w": torch.zeros(1000), "step": 2}, 2)
"""


def test_kill_mid_write_leaves_the_last_good_checkpoint(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(tmp_path)], stdout=subprocess.PIPE,
                            text=True, cwd=REPO)
    try:
        assert proc.stdout.readline().strip() == "writing"
        assert any(".tmp-" in p.name for p in tmp_path.iterdir())          # caught mid-write
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    loaded = load_latest(tmp_path)
    assert loaded.step == 1 and torch.equal(loaded.state["w"], torch.ones(1000)) and loaded.refused == []
    CheckpointManager(tmp_path)                                            # a new writer cleans up
    assert not any(".tmp-" in p.name for p in tmp_path.iterdir())


# ---------------------------------------------------------------- data parallel



def _ddp_worker(rank, path, steps):
    import torch.distributed as dist

    torch.set_num_threads(1)
    setup = torch.load(path / "setup.pt", weights_only=False)
    dist.init_process_group("gloo", init_method=f"file://{path / 'rdzv'}", rank=rank, world_size=2)
    try:
        target = tiny_target()
        target.load_state_dict(setup["target"])
        drafter = drafter_for(target)
        drafter.load_state_dict(setup["drafter"])
        buf = fill(DataBuffer(), setup["shards"][rank], [0] * len(setup["shards"][rank]))
        tr = DrafterTrainer(drafter, buf, small_cfg())
        hist = tr.train(max_steps=steps).history
        torch.save({"weights": _weights(tr), "losses": [h["loss"] for h in hist]}, path / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_data_parallel_ranks_stay_identical_and_match_one_process(target, tmp_path):
    import torch.multiprocessing as mp

    shards = [records(target, 10, seed=1), records(target, 10, seed=2)]
    init = drafter_for(target)
    torch.save({"target": target.state_dict(), "drafter": init.state_dict(), "shards": shards}, tmp_path / "setup.pt")
    mp.spawn(_ddp_worker, args=(tmp_path, 4), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert _same(r0["weights"], r1["weights"])
    bufs = [fill(DataBuffer(), s, [0] * len(s)) for s in shards]
    single = DrafterTrainer(drafter_for(target), Interleaved(*bufs), small_cfg(grad_accum=2))
    single.train(max_steps=4)
    assert _same(r0["weights"], _weights(single))
    assert not _same(r0["weights"], init.state_dict())


# ---------------------------------------------------------------- CLI

def _cli(capsys, *argv):
    from tlt_verl.cli import main

    rc = main(list(argv))
    return rc, capsys.readouterr()


def test_cli_refuses_bad_input_in_one_line(target, tmp_path, capsys):
    from tlt_verl.drafter.export import export_drafter, load_drafter

    tdir = tmp_path / "target"
    target.config.save_pretrained(tdir)
    other = tmp_path / "other"
    tiny_target(vocab_size=128).config.save_pretrained(other)
    cases = [
        (["warmup", "--target", str(tmp_path / "nope"), "--out", str(tmp_path / "o")],
         f"tlt-verl: --target={tmp_path / 'nope'}: no such model directory (no config.json)"),
        (["warmup", "--target", str(tdir), "--out", str(tmp_path / "o"), "--init", str(tmp_path / "nope")],
         f"tlt-verl: --init={tmp_path / 'nope'}: no such model directory (no config.json)"),
        (["export", "--checkpoint", str(tmp_path), "--target", str(tdir), "--out", str(tmp_path / "o")],
         f"tlt-verl: checkpoint directory {tmp_path}: no loadable checkpoint"),
    ]
    wrong_vocab = export_drafter(drafter_for(tiny_target(vocab_size=128)), tmp_path / "d128")
    cases.append((["warmup", "--target", str(tdir), "--out", str(tmp_path / "o"), "--init", str(wrong_vocab)],
                  f"tlt-verl: drafter {wrong_vocab}: vocab_size=128 does not match the target's vocab_size=96"))
    eagle = export_drafter(drafter_for(target), tmp_path / "e1")
    cases.append((["warmup", "--target", str(tdir), "--out", str(tmp_path / "o"), "--init", str(eagle), "--kind", "eagle3"],
                  f"tlt-verl: --init {eagle}: is an eagle drafter, but --kind eagle3"))
    buf = fill(DataBuffer(), records(target, 6), [0] * 6)
    tr = DrafterTrainer(drafter_for(target), buf, small_cfg())
    tr.train(max_steps=2)
    CheckpointManager(tmp_path / "ck").save(tr.state_dict(), tr.step)
    cases.append((["export", "--checkpoint", str(tmp_path / "ck"), "--target", str(other), "--out", str(tmp_path / "o")],
                  f"tlt-verl: checkpoint drafter does not fit target {other}: vocab_size=96, the target implies 128"))
    for argv, want in cases:
        rc, io = _cli(capsys, "drafter", *argv)
        assert rc == 1 and io.err == want + "\n", (argv, io.err)
        assert not (tmp_path / "o").exists()
    # The good case: the checkpoint exports to a folder that loads strictly, weights intact.
    rc, io = _cli(capsys, "drafter", "export", "--checkpoint", str(tmp_path / "ck"), "--target", str(tdir),
                  "--out", str(tmp_path / "x"), "--layout", "sglang")
    assert rc == 0, io.err
    back = load_drafter(tmp_path / "x", target.config, *target_tensors(target))
    assert _same(_weights(tr), back.state_dict())
    # As a command: one line on stderr, no traceback.
    p = subprocess.run([sys.executable, "-m", "tlt_verl.cli", "drafter", "export", "--checkpoint", str(tmp_path / "nope"),
                        "--target", str(tdir), "--out", str(tmp_path / "o")], capture_output=True, text=True, cwd=REPO)
    assert p.returncode == 1 and p.stderr == f"tlt-verl: checkpoint directory {tmp_path / 'nope'}: not found\n", p.stderr


@pytest.mark.slow
def test_warmup_on_the_sft_model_raises_agreement(assets, tmp_path):
    from tlt_verl.drafter.export import load_drafter
    from tlt_verl.drafter.warmup import WarmupConfig, run_warmup

    cfg = WarmupConfig(target=str(assets["model"]), out=str(tmp_path / "d"), num_prompts=24, max_new_tokens=160,
                       budget_s=60, max_steps=40, trainer=TrainerConfig(lr=1e-3, warmup_steps=5, total_steps=60,
                                                                        tokens_per_micro=1024, row_len=512))
    lines = []
    report = run_warmup(cfg, log=lines.append)
    t = report["training"]
    assert t["steps"] == 40 and t["last_loss"] < t["first_loss"]
    assert t["top1_agreement_after"] > t["top1_agreement_before"] + 0.1, t
    assert any(line.startswith("warmup: step 1 loss") for line in lines)
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(assets["model"])
    load_drafter(tmp_path / "d", target.config, *target_tensors(target))       # strict: what engines get
    saved = load_latest(tmp_path / "d" / "checkpoints")
    assert saved.step == t["steps"]
    # The cosine ran over the 40-step budget, not the trainer's 60: the last step is at the floor.
    assert saved.state["trainer_config"]["total_steps"] == report["config"]["trainer"]["total_steps"] == 40
    assert saved.state["schedule"]["lr"] == pytest.approx(1e-3 * TrainerConfig().min_lr_ratio)
