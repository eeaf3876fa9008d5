"""The drafter's footprint (issue 39, point 2), on a tiny random Qwen2 target on CPU.

- The target's embedding and LM head are held in the rollout's dtype, only on a rank whose drafter
  trains, in one segment the actor's process owns and the drafter's child maps: a weight sync
  sends the child a version number, never the tensors, and a sync of unchanged weights copies
  nothing; a restarted child maps the same segment again (tests/test_drafter_process.py).
- Capture asks the staging buffer's budget before it copies a sample off the device.
- A session's adoption moves the state's tensors themselves, behind a skeleton of a few KB.
"""
import io
import time
from dataclasses import replace
from multiprocessing import connection

import pytest
import torch
from tensordict import TensorDict

from test_drafter_service import VOCAB, records, service_cfg, tiny_target
from tlt_verl.capture import verl_capture
from tlt_verl.capture.staging import StagingBuffer
from tlt_verl.drafter.reducer import free_port
from tlt_verl.spot.drafter_process import DrafterProcess
from tlt_verl.spot.drafter_service import DrafterService, join_state, skeleton_specs, split_state, tensor_digest

HIDDEN = 32
BF16_BYTES = 2 * VOCAB * HIDDEN * 2            # embedding + LM head (untied) in bf16


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    model = tiny_target()
    folder = tmp_path_factory.mktemp("footprint") / "target"
    model.save_pretrained(folder)             # fp32 on disk: the rollout's bf16 is a cast
    return {"dir": str(folder), "model": model}


@pytest.fixture
def pipe_bytes(monkeypatch):
    """Bytes this process sends through any multiprocessing pipe (the drafter child's included)."""
    sent = [0]
    send = connection.Connection.send_bytes

    def counting(conn, buf, offset=0, size=None):
        sent[0] += memoryview(buf).nbytes if size is None else size
        return send(conn, buf, offset, size)

    monkeypatch.setattr(connection.Connection, "send_bytes", counting)
    return sent


def _weights(model, shift: float):
    return (model.model.embed_tokens.weight.detach() + shift, model.lm_head.weight.detach() + shift)


def _bf16_digest(embed, head):
    return tensor_digest(embed.to(torch.bfloat16), head.to(torch.bfloat16))


def test_target_crosses_once_per_version_through_shared_memory(target, pipe_bytes):
    proc = DrafterProcess(target["dir"], replace(service_cfg(), target_dtype="bfloat16"))
    try:
        # Started from the checkpoint, in bf16, on the training rank: read by the child in place.
        assert proc.target_version == 1
        m = proc.metrics()
        assert m["tlt/drafter/target_bytes"] == BF16_BYTES and m["tlt/drafter/target_version"] == 1
        assert proc.target_bytes_copied == BF16_BYTES

        embed, head = _weights(target["model"], 0.5)
        before = pipe_bytes[0]
        proc.set_target_tensors(embed, head)
        # A version number crossed, not 12 KB of tensors.
        assert pipe_bytes[0] - before < BF16_BYTES / 2
        assert proc.target_version == 2 and proc.metrics()["tlt/drafter/target_version"] == 2
        assert proc.target_digest() == _bf16_digest(embed, head)
        copied = proc.target_bytes_copied
        assert copied == 2 * BF16_BYTES

        # The same weights again (a frozen embedding, or a sync of unchanged weights): nothing copied.
        proc.set_target_tensors(*_weights(target["model"], 0.5))
        assert proc.target_version == 2 and proc.target_bytes_copied == copied

        # Straight from a weight stream's tensors, one at a time, as they pass.
        embed2, head2 = _weights(target["model"], 1.0)
        with proc.target_update() as write:
            write("embed", embed2)
            write("lm_head", head2)
        assert proc.target_version == 3 and proc.target_digest() == _bf16_digest(embed2, head2)

        # A restarted child maps the same segment again: tests/test_drafter_process.py SIGKILLs
        # the child and finds the digest of the tensors handed in before the kill (one spawn
        # fewer here).
    finally:
        proc.close()


def test_a_rank_that_does_not_train_holds_no_target_tensors(target):
    proc = DrafterProcess(target["dir"], service_cfg(), capture=False)
    try:
        m = proc.metrics()
        assert m["tlt/drafter/target_bytes"] == 0 and m["tlt/drafter/target_version"] == 0
        assert proc.target_version == 0 and proc._target is None
        with pytest.raises(RuntimeError, match="does not train"):
            proc.set_target_tensors(*_weights(target["model"], 0.0))
        with pytest.raises(RuntimeError, match="holds no target tensors"):
            proc.start_session("s", 0, 1, "127.0.0.1", free_port(), 0)
        # Still exports (its drafter's own weights): the serving push needs nothing else.
        assert proc.state_version == 0
    finally:
        proc.close()


def test_the_target_is_held_and_trained_with_in_the_rollout_dtype(target, tmp_path):
    svc = DrafterService(target["dir"], replace(service_cfg(), target_dtype="bfloat16"), capture=False)
    try:
        t = svc.drafter.target
        assert t.embed_weight.dtype == t.lm_head_weight.dtype == torch.bfloat16
        assert svc.drafter.fc.weight.dtype == torch.float32        # the drafter's own weights stay fp32
        svc.set_target_tensors(*_weights(target["model"], 0.25))   # fp32 in: held as bf16
        assert svc.drafter.target.embed_weight.dtype == torch.bfloat16 and svc.target_version == 2
        svc.add_samples([(0, r["input_ids"], r["loss_mask"], r["final_hidden"], r["aux_hidden"])
                         for r in records(target["model"], 6)])
        svc.start_session("s", 0, 1, "127.0.0.1", free_port(), 0)
        deadline = time.monotonic() + 60
        while svc.state_version < 2:
            assert time.monotonic() < deadline and not svc._stats.get("error"), svc._stats.get("error")
            time.sleep(0.02)
        stats = svc.stop()
        assert stats["error"] is None and stats["last_loss"] == stats["last_loss"]   # finite, not NaN
    finally:
        svc.close()


def test_capture_applies_the_budget_before_the_host_copy(target):
    """Eight samples of 24 tokens, a budget that fits three: only the newest three are copied off
    the forward's activations; the other five are counted as dropped without a copy."""
    model = target["model"]
    n, length, prompt = 8, 24, 4
    ids = torch.randint(0, VOCAB, (n, length), generator=torch.Generator().manual_seed(0))
    per_sample = length * (8 + 1 + HIDDEN * 2)                  # int64 ids, bool mask, bf16 states

    class Recording(StagingBuffer):
        """A staging buffer that remembers what it was handed."""
        handed: list = []

        def add(self, step, input_ids, loss_mask, final_hidden, aux_hidden=None):
            self.handed.append(final_hidden)
            super().add(step, input_ids, loss_mask, final_hidden, aux_hidden)

    sink = Recording(3 * per_sample + per_sample // 2)
    verl_capture.enable("eagle", (), None, sink=sink)

    def nested(rows):
        return torch.nested.as_nested_tensor(list(rows), layout=torch.jagged)

    mb = TensorDict({"input_ids": nested(ids), "prompts": nested(ids[:, :prompt]),
                     "response_mask": nested(torch.ones(n, length - prompt, dtype=torch.bool)),
                     "global_steps": torch.full((n,), 7)}, batch_size=[n])
    try:
        with torch.no_grad(), verl_capture.capture_pass(object(), model) as cp:
            model(ids)
            assert cp.collect(mb, packed=False) == 3
    finally:
        verl_capture.disable()
    assert len(sink) == 3 and sink.dropped == 5 and len(sink.handed) == 3
    assert sink.nbytes == 3 * per_sample
    staged = sink.take()
    assert all(s[3].dtype == torch.bfloat16 and s[3].shape == (length, HIDDEN) for s in staged)
    # The newest three, as the buffer would have kept them had all eight been copied.
    assert [bool(torch.equal(s[1], ids[i])) for s, i in zip(staged, (5, 6, 7))] == [True] * 3


def test_adoption_moves_the_state_as_tensors(target):
    """What the source member broadcasts: a skeleton of a few KB, then each tensor of the state,
    which rebuild the state exactly."""
    src = DrafterService(target["dir"], service_cfg(init_seed=1), capture=False)
    dst = DrafterService(target["dir"], service_cfg(init_seed=2), capture=False)
    try:
        src.add_samples([(0, r["input_ids"], r["loss_mask"], r["final_hidden"], r["aux_hidden"])
                         for r in records(target["model"], 6)])
        src.trainer.train(max_steps=2)
        state = src.trainer.state_dict()
        skeleton, tensors = split_state(state, src.device)
        buf = io.BytesIO()
        torch.save(skeleton, buf)
        state_bytes = sum(t.numel() * t.element_size() for t in tensors)
        assert len(buf.getvalue()) < 32 << 10 < state_bytes
        assert [(tuple(t.shape), t.dtype) for t in tensors] == skeleton_specs(
            torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
        received = [torch.empty_like(t).copy_(t) for t in tensors]     # what a broadcast fills in
        dst.trainer.load_state_dict({**join_state(skeleton, received), "cursor": dst.trainer.cursor})
        for (k, a), b in zip(src.drafter.state_dict().items(), dst.drafter.state_dict().values()):
            assert torch.equal(a, b), k
        assert dst.trainer.step == src.trainer.step == 2
    finally:
        src.close()
        dst.close()
