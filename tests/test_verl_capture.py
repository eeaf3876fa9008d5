"""Hidden states from verl's actor update, without an extra target forward.

verl's real ActorRolloutRefWorker (FSDP2 over gloo, one CPU rank, gradient checkpointing) runs
update_actor in a child process (tests/_capture_child.py) in the recipe's layout (one epoch of
several mini-batches); here its buffer samples are checked against a direct HF forward
(tlt_verl.capture.hf_capture, the offline path's capture) of the weights each sample's forward ran
with: the rollout's for the first mini-batch, those the optimizer steps before it left for each
later one. At the child's learning rate the states of consecutive weights differ beyond the
tolerance, so a capture from any other point (after the update, a later epoch) fails.
"""
from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import _capture_child as child
from tlt_verl.capture import BufferConfig, DataBuffer, capture_hidden, capture_samples
from tlt_verl.capture.hooks import HiddenStateHooks
from tlt_verl.capture.verl_capture import CaptureConfig
from tlt_verl.patches import PatchError

HERE = Path(__file__).resolve().parent
# bf16 storage of fp32 states: at most half a bf16 ulp (2**-8 relative) apart, plus fp32 noise.
BF16 = dict(rtol=2 ** -7, atol=1e-5)


def _write_model(out: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tlt_verl.task.tiny_model import TinyModelSpec, build_tiny_model

    vocab = {f"t{i}": i for i in range(child.PAD)} | {"<pad>": child.PAD, "<eos>": child.PAD + 1}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    hf_tok.save_pretrained(out)
    spec = TinyModelSpec(hidden_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=128, max_position_embeddings=256)
    build_tiny_model(hf_tok, spec, seed=0).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return _write_model(tmp_path_factory.mktemp("capture_target"))


@pytest.fixture(scope="module")
def result(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("capture_run") / "result.pt"
    env = dict(os.environ, VERL_PLATFORM="cpu", PYTHONUNBUFFERED="1")
    p = subprocess.run([sys.executable, str(HERE / "_capture_child.py"), str(model_dir), str(out)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-6000:])
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def target(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="sdpa").float().eval()


def _by_sequence(samples, seqs):
    """Buffer samples in the order of the input sequences (the engine regroups them)."""
    index = {tuple(s["input_ids"].tolist()): s for s in samples}
    assert len(index) == len(samples) == len(seqs)
    return [index[tuple(torch.cat([p, r]).tolist())] for p, r, _ in seqs]


def _with_weights(target, weights):
    import copy

    model = copy.deepcopy(target)
    model.load_state_dict({k: v.float() for k, v in weights.items()})
    return model.eval()


def _forwards_ran(target, update) -> list:
    """The model each sample's forward ran in ``update`` (one epoch in order, mini-batches of
    ``child.MINI_BATCH``): the weights before its mini-batch's optimizer step."""
    models = [_with_weights(target, w) for w in update["before_step"]]
    assert len(models) == -(-len(child.SAMPLES) // child.MINI_BATCH)
    return [models[i // child.MINI_BATCH] for i in range(len(child.SAMPLES))]


def _assert_matches_hf(target, samples, seqs, aux_layer_ids):
    """``target``: the model every sample's forward ran, or one model per sample."""
    models = target if isinstance(target, list) else [target] * len(seqs)
    for (p, r, m), s, target in zip(seqs, _by_sequence(samples, seqs), models):
        ids = torch.cat([p, r])
        ref = capture_hidden(target, ids[None], aux_layer_ids=aux_layer_ids)
        assert s["final"].dtype == torch.bfloat16 and s["final"].shape == (len(ids), target.config.hidden_size)
        torch.testing.assert_close(s["final"].float(), ref.final[0], **BF16)
        if aux_layer_ids:
            assert s["aux"].shape == (len(ids), len(aux_layer_ids) * target.config.hidden_size)
            torch.testing.assert_close(s["aux"].float(), ref.aux[0], **BF16)
        else:
            assert s["aux"] is None
        assert torch.equal(s["loss_mask"], torch.cat([torch.zeros(len(p), dtype=torch.bool), m.bool()]))


# ---------------------------------------------------------------------------------------- verl

def test_patch_is_applied_by_the_plugin(result):
    assert result["patched"]


def test_update_moves_states_beyond_the_tolerance(result, target):
    """The premise of the checks below: the first mini-batch's forward ran the weights of the model
    folder, and each optimizer step moved every sequence's states (final and aux) by more than
    the bf16 tolerance, so states from weights before and after an update cannot pass for each
    other."""
    on = result["on"]
    first = on["before_step"][0]
    assert first.keys() == target.state_dict().keys()
    assert all(torch.equal(first[k], v) for k, v in target.state_dict().items())
    steps = [_with_weights(target, w) for w in on["before_step"] + [on["weights"]]]
    assert len(steps) == 1 + -(-len(child.SAMPLES) // child.MINI_BATCH) >= 3   # several mini-batches
    for before, after in zip(steps, steps[1:]):
        for p, r, _ in result["sequences"]:
            ids = torch.cat([p, r])[None]
            a = capture_hidden(before, ids, aux_layer_ids=result["aux_layer_ids"])
            b = capture_hidden(after, ids, aux_layer_ids=result["aux_layer_ids"])
            assert not torch.allclose(a.final, b.final, **BF16)
            assert not torch.allclose(a.aux, b.aux, **BF16)


def test_packed_capture_matches_hf_forward(result, target):
    """Trainer v1's layout, remove-padding engine (verl's default), EAGLE-3 aux + final states;
    the recipe's one epoch of several mini-batches, each of one or more micro-batches: each
    sample's states are those of the weights its mini-batch's forward ran."""
    assert result["aux_layer_ids"] == (0, 2, 3)
    stats = dict(result["stats"])
    # The time capture added to the update (its collect calls), reported per step by TLT.
    assert 0 < stats.pop("seconds") < result["on_s"]
    assert stats == {"passes": 1, "micro_batches": len(result["hooks_on"]), "samples": 6, "skipped": 0}
    assert stats["micro_batches"] > len(result["on"]["before_step"])   # some mini-batch split
    _assert_matches_hf(_forwards_ran(target, result["on"]), result["v1"], result["sequences"],
                       result["aux_layer_ids"])


def test_same_record_as_the_offline_path(result, target):
    """Where the response mask has no holes (single-turn), the sample is the offline path's:
    capture_samples + DataBuffer.add on prompt + response."""
    seqs = result["sequences"]
    aux = result["aux_layer_ids"]
    offline = DataBuffer(BufferConfig(kind="eagle3"))
    whole = [i for i, (_, _, m) in enumerate(seqs) if bool(m.all())]
    assert len(whole) >= 2
    models = _forwards_ran(target, result["on"])
    for i in whole:
        [rec] = capture_samples(models[i], [torch.cat(seqs[i][:2])], [len(seqs[i][0])], aux_layer_ids=aux)
        offline.add(0, rec["input_ids"], rec["loss_mask"], rec["final_hidden"], rec["aux_hidden"])
    captured = _by_sequence(result["v1"], seqs)
    for i, ref in zip(whole, (offline.get(j) for j in offline.ids())):
        got = captured[i]
        assert got["input_ids"].dtype == ref.input_ids.dtype and torch.equal(got["input_ids"], ref.input_ids)
        assert torch.equal(got["loss_mask"], ref.loss_mask)
        assert got["final"].dtype == ref.final_hidden.dtype and got["aux"].dtype == ref.aux_hidden.dtype
        torch.testing.assert_close(got["final"].float(), ref.final_hidden.float(), **BF16)
        torch.testing.assert_close(got["aux"].float(), ref.aux_hidden.float(), **BF16)


def test_step_tags(result):
    seqs = result["sequences"]
    assert [s["step"] for s in _by_sequence(result["v1"], seqs)] == result["steps_v1"]
    # v0: sampled with the weights pushed after step v, so captured in step v + 1.
    assert [s["step"] for s in _by_sequence(result["v0"], seqs)] == [v + 1 for v in result["versions_v0"]]


def test_training_unchanged_by_capture(result):
    """The same update from the same weights, with capture off and on: same gradients, same weights."""
    assert result["on"]["grad_norm"] == result["off"]["grad_norm"] and min(result["off"]["grad_norm"]) > 0
    for name, w in result["off"]["weights"].items():
        assert torch.equal(result["on"]["weights"][name], w), name


def test_hooks_only_while_capturing(result):
    stock = result["hooks_stock"]
    forwards = len(result["hooks_off"])
    # One epoch of several mini-batches; gradient checkpointing re-runs the decoder's layers in
    # the backward pass, not the decoder, so only the forwards are counted here.
    assert forwards >= 4 and result["hooks_off"] == [stock] * forwards
    assert result["hooks_on"] == [stock + 2 + len(result["aux_layer_ids"])] * forwards
    assert result["hooks_after_on"] == stock                             # removed after the pass
    assert result["hooks_off_again"] == [stock] * forwards and result["hooks_after_off"] == stock
    assert result["disabled_returns_buffer"]
    # Two epochs (the v0 update, EAGLE-1: final states only): hooked in the first epoch only, the
    # second runs as stock verl does.
    v0 = result["hooks_v0"]
    assert len(v0) >= 4 and v0 == [stock + 2] * (len(v0) // 2) + [stock] * (len(v0) // 2)


def test_only_the_update_is_captured(result):
    # The engine's log-prob pass (bypass mode off runs it; so does the reference's path) leaves
    # the buffer alone.
    assert result["after_log_prob_pass"] == len(result["v1"]) == 6


def test_trainer_v0_layout_eagle(result, target):
    """Left/right-padded prompts and responses (main_ppo_v0), EAGLE-1: final states only; two
    epochs of one mini-batch, captured from the first, whose forwards ran the rollout's weights
    (the second epoch's ran those the first epoch's step moved)."""
    assert len(result["v0_update"]["before_step"]) == 2
    _assert_matches_hf(target, result["v0"], result["sequences"], ())


def test_padded_engine(result, target):
    """actor_rollout_ref.model.use_remove_padding=False: one right-padded row per sample."""
    _assert_matches_hf(_forwards_ran(target, result["padded_update"]), result["padded"], result["sequences"],
                       result["aux_layer_ids"])
    torch.testing.assert_close(result["padded_update"]["grad_norm"], result["off"]["grad_norm"], rtol=1e-4, atol=0)


# ------------------------------------------------------------------------------------ in-process

def test_patch_names_what_is_missing():
    from tlt_verl.patches.verl_capture import patch_engine, patch_worker

    with pytest.raises(PatchError, match=r"stand_in\.ActorRolloutRefWorker does not exist"):
        patch_worker(types.ModuleType("stand_in"))
    mod = types.ModuleType("stand_in")
    mod.ActorRolloutRefWorker = type("ActorRolloutRefWorker", (), {})
    with pytest.raises(PatchError, match=r"ActorRolloutRefWorker\.update_actor does not exist"):
        patch_worker(mod)

    mod = types.ModuleType("stand_in")
    mod.FSDPEngineWithLMHead = type("FSDPEngineWithLMHead", (), {"prepare_model_outputs": lambda self: None})
    with pytest.raises(PatchError, match=r"FSDPEngineWithLMHead\._gather_and_unpad_packed does not exist"):
        patch_engine(mod)
    mod.FSDPEngineWithLMHead._gather_and_unpad_packed = lambda self, t, pad: t
    mod.tu = object()
    with pytest.raises(PatchError, match="prepare_model_outputs takes"):
        patch_engine(mod)


def test_patch_is_idempotent():
    import verl.workers.engine.fsdp.transformer_impl as impl
    import verl.workers.engine_workers as ew

    from tlt_verl.patches import verl_capture

    verl_capture.apply()
    fn, prep = ew.ActorRolloutRefWorker.update_actor, impl.FSDPEngineWithLMHead.prepare_model_outputs
    assert getattr(fn, "_tlt_capture", False) and getattr(prep, "_tlt_capture", False)
    verl_capture.patch_worker(ew)
    verl_capture.patch_engine(impl)
    assert ew.ActorRolloutRefWorker.update_actor is fn
    assert impl.FSDPEngineWithLMHead.prepare_model_outputs is prep
    assert not getattr(fn.__wrapped__, "_tlt_capture", False)
    # verl's dispatch reads register()'s metadata off the method the worker group binds.
    from verl.single_controller.base.decorator import MAGIC_ATTR

    assert getattr(fn, MAGIC_ATTR) == getattr(fn.__wrapped__, MAGIC_ATTR)


def test_sample_count_of_either_batch_form():
    from tensordict import TensorDict
    from transfer_queue import KVBatchMeta

    from tlt_verl.capture.verl_batch import sample_count

    assert sample_count(TensorDict({"x": torch.zeros(5, 2)}, batch_size=[5])) == 5
    assert sample_count(KVBatchMeta(keys=["a", "b", "c"], tags=[{}, {}, {}])) == 3
    assert sample_count(object()) is None


def test_capture_config_refuses_mismatches():
    with pytest.raises(ValueError, match="only for kind='eagle3'"):
        CaptureConfig("eagle", (1,), BufferConfig(kind="eagle"))
    with pytest.raises(ValueError, match="eagle3 needs"):
        CaptureConfig("eagle3", (), BufferConfig(kind="eagle3"))
    with pytest.raises(ValueError, match="eagle3 needs"):
        CaptureConfig("eagle3", (2, 1), BufferConfig(kind="eagle3"))
    with pytest.raises(ValueError, match="differs from kind"):
        CaptureConfig("eagle3", (0, 1), BufferConfig(kind="eagle"))


def test_enable_disable_api():
    from tlt_verl.capture import verl_capture

    assert not verl_capture.enabled() and verl_capture.buffer() is None
    buf = verl_capture.enable("eagle3", [0, 2])
    try:
        assert verl_capture.enabled() and verl_capture.buffer() is buf and buf.cfg.kind == "eagle3"
        assert verl_capture.config().aux_layer_ids == (0, 2)
    finally:
        assert verl_capture.disable() is buf
    assert not verl_capture.enabled() and verl_capture.disable() is None


def test_hooks_take_one_forward_and_leave_nothing(target):
    ids = torch.randint(0, child.PAD, (1, 9))
    before = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in target.modules())
    with HiddenStateHooks(target, (0, 3)) as hooks:
        with torch.no_grad():
            target(input_ids=ids)
        final, aux = hooks.take()
        with pytest.raises(RuntimeError, match="no forward"):
            hooks.take()
    ref = capture_hidden(target, ids, aux_layer_ids=(0, 3))
    assert torch.equal(final, ref.final) and torch.equal(aux, ref.aux)
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in target.modules()) == before
    with pytest.raises(ValueError, match="ids must be in"):
        HiddenStateHooks(target, (4,))


def test_hooks_ignore_the_layers_gradient_checkpointing_reruns(model_dir):
    """A training forward with checkpointed layers: the backward pass re-runs the aux layers, and
    what they see then (the same states, recomputed) is not taken for a next forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="sdpa").float().train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    calls = []
    model.model.layers[3].register_forward_pre_hook(lambda *_: calls.append(1))
    ids = torch.randint(0, child.PAD, (1, 9))
    with HiddenStateHooks(model, (0, 3)) as hooks:
        model(input_ids=ids).logits.sum().backward()
        assert len(calls) == 2                      # the forward, and the backward's recompute
        final, aux = hooks.take()
        assert not hooks.pending
    ref = capture_hidden(model.eval(), ids, aux_layer_ids=(0, 3))
    torch.testing.assert_close(final, ref.final)
    torch.testing.assert_close(aux, ref.aux)
