"""DrafterService: data-parallel drafter sessions over a changing set of member processes.

Two spawned member processes stand for two verl actor ranks, each hosting one service (and so one
capture buffer); the test drives them over a pipe as the coordinator drives the actor workers.
Tiny random Qwen2 targets on CPU."""
import io
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from transformers import Qwen2Config, Qwen2ForCausalLM

from _drafters import Interleaved, captured_records
from tlt_verl.capture import BufferConfig, DataBuffer
from tlt_verl.drafter import DrafterConfig, build_drafter
from tlt_verl.drafter.checkpoint import load_latest
from tlt_verl.drafter.export import load_drafter
from tlt_verl.drafter.reducer import free_port
from tlt_verl.drafter.target_weights import load_target_tensors
from tlt_verl.drafter.trainer import DrafterTrainer, TrainerConfig
from tlt_verl.spot.drafter_service import DrafterServiceConfig, LoadResult

torch.set_num_threads(1)
VOCAB = 96
HOST = "127.0.0.1"


def tiny_target(seed=0):
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=VOCAB, max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.2)).eval()


def records(target, n, seed=0, kind="eagle", lengths=(6, 20)):
    return captured_records(target, n, VOCAB, seed=seed, kind=kind, lengths=lengths)


def fill(buffer, recs, step=0):
    for r in recs:
        buffer.add(step, r["input_ids"], r["loss_mask"], r["final_hidden"], r["aux_hidden"])
    return buffer


def service_cfg(kind="eagle", init_seed=0, **trainer):
    base = dict(lr=3e-3, warmup_steps=2, total_steps=50, grad_accum=1, tokens_per_micro=48, row_len=48)
    return DrafterServiceConfig(kind=kind, init_seed=init_seed, trainer=TrainerConfig(**{**base, **trainer}),
                                idle_poll_s=0.02)


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def same_optimizer(a, b):
    """Bit-identical AdamW state (every moment and step count of every parameter)."""
    sa, sb = a["state"], b["state"]
    return sa.keys() == sb.keys() and all(same(sa[i], sb[i]) for i in sa) and a["param_groups"] == b["param_groups"]


# ---------------------------------------------------------------- member processes

_SERVICE = {}


def _member_main(conn):
    """A member process: runs the ``_op_*`` function named by each message. Arguments and results
    travel as torch.save bytes (plain pickling would route tensors through shared-memory handles)."""
    torch.set_num_threads(1)
    while True:
        msg = conn.recv()
        if msg is None:
            break
        name, args = msg
        try:
            out = globals()[name](*torch.load(io.BytesIO(args), weights_only=False))
            buf = io.BytesIO()
            torch.save(out, buf)
            conn.send(("ok", buf.getvalue()))
        except BaseException as e:
            import traceback

            conn.send(("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    svc = _SERVICE.pop("svc", None)
    if svc is not None:
        svc.close()


def _svc():
    return _SERVICE["svc"]


def _op_new(target_dir, cfg, records_path=None):
    from tlt_verl.spot.drafter_service import DrafterService

    if "svc" in _SERVICE:
        _SERVICE.pop("svc").close()
    svc = _SERVICE["svc"] = DrafterService(target_dir, cfg)
    if records_path is not None:
        fill(svc.buffer, torch.load(records_path))
    return len(svc.buffer)


def _op_fill(records_path):
    fill(_svc().buffer, torch.load(records_path))
    return len(_svc().buffer)


def _op_start(*args):
    _svc().start_session(*args)


def _op_wait_version(n, timeout_s=60.0):
    svc, deadline = _svc(), time.monotonic() + timeout_s
    while svc.state_version < n:
        if svc._stats.get("error"):
            raise RuntimeError(svc._stats["error"])
        if time.monotonic() > deadline:
            raise TimeoutError(f"state_version {svc.state_version} < {n} after {timeout_s}s")
        time.sleep(0.005)
    return svc.state_version


def _op_wait_idle(timeout_s):
    """Seconds until the session thread ended without this member being stopped (None: it didn't)."""
    svc, t0 = _svc(), time.monotonic()
    while svc.is_training and time.monotonic() - t0 < timeout_s:
        time.sleep(0.005)
    return None if svc.is_training else time.monotonic() - t0


def _op_scheduling():
    """Whether the session's training thread and this member's own thread (the one that answers
    calls) run at idle priority, while the session runs."""
    from tlt_verl.utils.priority import is_idle

    stats = _svc()._stats
    return {"scheduling": stats["scheduling"], "session_idle": is_idle(stats["thread_id"]), "caller_idle": is_idle(0)}


def _op_stop(timeout_s):
    return _svc().stop(timeout_s)


def _op_state():
    tr = _svc().trainer
    return {"drafter": tr.drafter.state_dict(), "optimizer": tr.optimizer.state_dict(), "step": tr.step,
            "stats": dict(_svc()._stats), "metrics": _svc().metrics(reset=False)}


def _op_target():
    t = _svc().drafter.target
    return t.embed_weight, t.lm_head_weight


def _op_call(method, *args):
    out = getattr(_svc(), method)(*args)
    return out.wait() if hasattr(out, "wait") else out


def _op_swap_target_while_training(session_args, new_embed_value, new_head, swap_at, run_to):
    """Single-member session; new target tensors handed over mid-training. Records, per micro-step,
    whether each embedding the drafter's layer read was the old or the new one."""
    svc = _svc()
    d = svc.drafter
    micro, opt_ids = [], [id(p) for p in svc.trainer.optimizer.param_groups[0]["params"]]
    keys = set(d.state_dict())
    h1 = d.fc.register_forward_pre_hook(lambda m, a: micro.append([]))
    h2 = d.layers[0].input_layernorm.register_forward_pre_hook(
        lambda m, a: micro[-1].append("new" if bool((a[0] == new_embed_value).all()) else "old"))
    embed = torch.full((VOCAB, 32), new_embed_value)
    svc.start_session(*session_args)
    _op_wait_version(swap_at)
    svc.set_target_tensors(embed, new_head)
    embed.zero_()                                    # the caller's tensor is its own again
    _op_wait_version(run_to)
    stats = svc.stop(5.0)
    h1.remove(), h2.remove()
    t = d.target
    return {
        "micro": micro, "stats": stats,
        "embed_is_new": bool((t.embed_weight == new_embed_value).all()), "head_is_new": torch.equal(t.lm_head_weight, new_head),
        "optimizer_params_unchanged": [id(p) for p in svc.trainer.optimizer.param_groups[0]["params"]] == opt_ids
        and opt_ids == [id(p) for p in d.trainable_parameters()],
        "target_not_trainable": not t.embed_weight.requires_grad and all(p.data_ptr() not in (t.embed_weight.data_ptr(), t.lm_head_weight.data_ptr()) for p in d.parameters()),
        "state_keys_unchanged": set(d.state_dict()) == keys,
    }


class Member:
    def __init__(self, ctx):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_member_main, args=(child,), daemon=True)
        self.proc.start()

    def __call__(self, fn, *args, timeout=120.0):
        buf = io.BytesIO()
        torch.save(args, buf)
        self.conn.send((fn.__name__, buf.getvalue()))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"member {self.proc.pid}: {fn.__name__} took more than {timeout}s")
        status, payload = self.conn.recv()
        if status == "err":
            raise AssertionError(f"member {self.proc.pid}: {payload}")
        return torch.load(io.BytesIO(payload), weights_only=False)

    def close(self):
        try:
            self.conn.send(None)
            self.proc.join(15)
        finally:
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()


@pytest.fixture(scope="module")
def members():
    ctx = mp.get_context("spawn")
    pair = [Member(ctx), Member(ctx)]
    yield pair
    for m in pair:
        m.close()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("svc")
    target = tiny_target()
    target.save_pretrained(root / "target")
    paths = {"target": str(root / "target"), "root": root, "target_model": target}
    for name, recs in {
        "a": records(target, 10, seed=1), "b": records(target, 10, seed=2),
        "long_a": records(target, 24, seed=3, lengths=(150, 250)), "long_b": records(target, 24, seed=4, lengths=(150, 250)),
        "e3": records(target, 12, seed=5, kind="eagle3"),
    }.items():
        torch.save(recs, root / f"{name}.pt")
        paths[name] = str(root / f"{name}.pt")
    return paths




# ---------------------------------------------------------------- tests

def test_config_validation_in_one_line(setup):
    with pytest.raises(ValueError, match=r"^DrafterServiceConfig.kind='medusa': must be one of eagle, eagle3$"):
        DrafterServiceConfig(kind="medusa")
    with pytest.raises(ValueError, match=r"^DrafterServiceConfig.buffer.kind='eagle': differs from kind='eagle3'$"):
        DrafterServiceConfig(kind="eagle3", buffer=BufferConfig(kind="eagle"))
    with pytest.raises(ValueError, match=r"^DrafterServiceConfig.checkpoint_keep=0: must be an int >= 1$"):
        DrafterServiceConfig(checkpoint_keep=0)
    with pytest.raises(ValueError, match=r"^DrafterServiceConfig.device='tpu'"):
        DrafterServiceConfig(device="tpu")
    assert DrafterServiceConfig(kind="eagle3").buffer == BufferConfig(kind="eagle3")
    cfg = service_cfg(kind="eagle3", init_seed=3)
    assert DrafterServiceConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match=r"^DrafterServiceConfig.lr: unknown option$"):
        DrafterServiceConfig.from_dict({"lr": 1.0})
    embed, head = load_target_tensors(setup["target"], tie_word_embeddings=False)
    t = setup["target_model"]
    assert torch.equal(embed, t.model.embed_tokens.weight) and torch.equal(head, t.lm_head.weight)


def test_a_later_session_with_more_members_adopts_the_freshest_state(members, setup):
    m0, m1 = members
    m0(_op_new, setup["target"], service_cfg(init_seed=0), setup["a"])
    port = free_port()
    m0(_op_start, "grow-1", 0, 1, HOST, port, 0)
    m0(_op_wait_version, 5)
    solo = m0(_op_stop, 5.0)
    assert solo["error"] is None and solo["steps"] >= 5 and solo["state_version"] == solo["steps"]
    v1 = solo["state_version"]

    m1(_op_new, setup["target"], service_cfg(init_seed=1), setup["b"])
    before, s1 = m0(_op_state), m1(_op_state)
    assert not same(before["drafter"], s1["drafter"]) and s1["step"] == 0 and s1["optimizer"]["state"] == {}

    port = free_port()
    # The newcomer asks first: it waits for rank 0, which hosts the rendezvous, to come up.
    m1(_op_start, "grow-2", 1, 2, HOST, port, 0)
    m0(_op_start, "grow-2", 0, 2, HOST, port, 0)
    m1(_op_wait_version, v1 + 5)
    st1 = m1(_op_stop, 5.0)                       # stopping one member stops the session
    st0 = m0(_op_stop, 5.0)
    assert st0["error"] is None and st1["error"] is None, (st0, st1)
    s0, s1 = m0(_op_state), m1(_op_state)
    assert same(s0["drafter"], s1["drafter"])
    assert same_optimizer(s0["optimizer"], s1["optimizer"])
    assert st0["steps"] == st1["steps"] >= 5
    assert s0["step"] == s1["step"] == v1 + st0["steps"] == st1["state_version"]      # the count continues
    assert not same(s0["drafter"], before["drafter"])


def test_two_members_equal_one_process_accumulating_both_shards(members, setup):
    m0, m1 = members
    m0(_op_new, setup["target"], service_cfg(init_seed=0), setup["a"])
    m1(_op_new, setup["target"], service_cfg(init_seed=7), setup["b"])
    init = m0(_op_state)["drafter"]
    port = free_port()
    for rank, m in enumerate(members):
        m(_op_start, "dp", rank, 2, HOST, port, 0)
    m0(_op_wait_version, 4)
    st0, st1 = m0(_op_stop, 5.0), m1(_op_stop, 5.0)
    k = st0["steps"]
    assert k == st1["steps"] >= 4 and st0["tokens"] > 0 and st1["tokens"] > 0
    s0, s1 = m0(_op_state), m1(_op_state)
    assert same(s0["drafter"], s1["drafter"])

    embed, head = load_target_tensors(setup["target"], tie_word_embeddings=False)
    drafter = build_drafter(DrafterConfig.from_target(setup["target_model"].config), embed, head)
    drafter.load_state_dict(init)
    bufs = [fill(DataBuffer(), torch.load(setup[s])) for s in ("a", "b")]
    single = DrafterTrainer(drafter, Interleaved(*bufs), service_cfg(grad_accum=2).trainer)
    single.train(max_steps=k)
    want = drafter.state_dict()
    for name in want:
        torch.testing.assert_close(s0["drafter"][name], want[name], atol=1e-6, rtol=0)
    assert not same(want, init)
    assert s0["metrics"]["tlt/drafter/steps"] == k and s0["metrics"]["tlt/drafter/buffer_samples"] == 10


def test_stop_while_training_is_prompt_and_leaves_members_identical(members, setup):
    m0, m1 = members
    big = dict(grad_accum=2, tokens_per_micro=1024, row_len=256)
    m0(_op_new, setup["target"], service_cfg(**big), setup["long_a"])
    m1(_op_new, setup["target"], service_cfg(init_seed=3, **big), setup["long_b"])
    port = free_port()
    for rank, m in enumerate(members):
        m(_op_start, "stop", rank, 2, HOST, port, 1)
    m0(_op_wait_version, 3)
    # Training harvests idle cycles only: its thread yields the core to anything else, while the
    # member still answers calls (this stop) at its own priority.
    assert m0(_op_scheduling) == {"scheduling": "SCHED_IDLE", "session_idle": True, "caller_idle": False}
    t0 = time.perf_counter()
    st0 = m0(_op_stop, 10.0)
    rpc_s = time.perf_counter() - t0
    ended_after = m1(_op_wait_idle, 5.0)          # the peer's thread ends by agreement, unasked
    st1 = m1(_op_stop, 5.0)
    assert st0["error"] is None and st1["error"] is None, (st0, st1)
    micro_s = st0["seconds"] / max(2 * st0["steps"], 1)
    print(f"stop latency {st0['stop_latency_s']:.3f}s (rpc {rpc_s:.3f}s), micro-step {micro_s:.3f}s, "
          f"peer ended {ended_after:.4f}s later")
    # At most the micro-step in flight, then the agreement; the slack covers a loaded machine.
    assert st0["stop_latency_s"] < min(5.0, 3 * micro_s + 1.0) and rpc_s < 5.0
    assert ended_after is not None and st1["stop_latency_s"] == 0.0
    s0, s1 = m0(_op_state), m1(_op_state)
    assert same(s0["drafter"], s1["drafter"]) and same_optimizer(s0["optimizer"], s1["optimizer"])
    assert s0["step"] == s1["step"] == st0["steps"] == st1["steps"]


def test_members_that_cannot_agree_fail_together_instead_of_hanging(members, setup):
    m0, m1 = members
    m0(_op_new, setup["target"], service_cfg(init_seed=0), setup["a"])
    m1(_op_new, setup["target"], service_cfg(init_seed=1, lr=1e-3), setup["b"])
    port = free_port()
    for rank, m in enumerate(members):
        m(_op_start, "mismatch", rank, 2, HOST, port, 0)
    assert m0(_op_wait_idle, 30.0) is not None and m1(_op_wait_idle, 30.0) is not None
    st0, st1 = m0(_op_stop, 5.0), m1(_op_stop, 5.0)
    assert st1["error"] == ("ValueError: session mismatch: cannot adopt rank 0's drafter: TrainerConfig.lr=0.001 "
                            "differs from the source member's 0.003")
    assert st0["error"] == "RuntimeError: session mismatch: another member could not adopt rank 0's drafter"
    assert st0["steps"] == st1["steps"] == 0
    assert m0(_op_state)["metrics"]["tlt/drafter/training"] == 0.0


def test_a_session_stopped_before_everyone_joined_is_called_off(members, setup):
    m0, m1 = members
    m0(_op_new, setup["target"], service_cfg(init_seed=0), setup["a"])
    m1(_op_new, setup["target"], service_cfg(init_seed=1), setup["b"])
    port = free_port()
    m0(_op_start, "off", 0, 2, HOST, port, 0)            # rank 1 is not there (yet)
    time.sleep(0.3)
    st0 = m0(_op_stop, 5.0)
    assert st0["aborted"] == "session off: a member gave up before all had joined" and st0["error"] is None
    assert st0["steps"] == 0 and st0["stop_latency_s"] < 1.0
    m1(_op_start, "off", 1, 2, HOST, port, 0)            # the latecomer learns the session is off
    assert m1(_op_wait_idle, 10.0) < 2.0
    assert m1(_op_stop, 5.0)["aborted"]
    # A member waiting for a rank 0 that never comes stops as promptly.
    m1(_op_start, "nobody", 1, 2, HOST, free_port(), 0)
    time.sleep(0.3)
    st1 = m1(_op_stop, 5.0)
    assert st1["aborted"] and st1["error"] is None and st1["stop_latency_s"] < 2.5, st1
    assert m0(_op_state)["step"] == m1(_op_state)["step"] == 0


def test_empty_buffers_idle_the_session_without_hanging_it(members, setup):
    m0, m1 = members
    m0(_op_new, setup["target"], service_cfg(init_seed=0))
    m1(_op_new, setup["target"], service_cfg(init_seed=1))
    port = free_port()
    for rank, m in enumerate(members):
        m(_op_start, "empty", rank, 2, HOST, port, 0)
    # Until the session has polled its empty buffers (a busy box may take a while to get there).
    deadline = time.monotonic() + 20
    while (s0 := m0(_op_state))["stats"].get("idle_polls", 0) == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert s0["step"] == 0 and s0["stats"]["idle_polls"] > 0 and s0["metrics"]["tlt/drafter/training"] == 1.0
    # Data reaches one member only (the other's shard had nothing): training starts, the empty
    # member adds zero gradients and the two stay identical.
    m1(_op_fill, setup["b"])
    m0(_op_wait_version, 3)
    st0, st1 = m0(_op_stop, 5.0), m1(_op_stop, 5.0)
    assert st0["error"] is None and st1["error"] is None
    assert st0["tokens"] == 0 and st1["tokens"] > 0 and st0["steps"] == st1["steps"] >= 3
    s0, s1 = m0(_op_state), m1(_op_state)
    assert same(s0["drafter"], s1["drafter"]) and same_optimizer(s0["optimizer"], s1["optimizer"])


def test_new_target_tensors_apply_between_micro_steps(members, setup):
    m0, _ = members
    m0(_op_new, setup["target"], service_cfg(kind="eagle3", grad_accum=2), setup["e3"])
    new_head = torch.randn(VOCAB, 32)
    out = m0(_op_swap_target_while_training, ("swap", 0, 1, HOST, free_port(), 0), 0.25, new_head, 3, 7)
    assert out["stats"]["error"] is None
    micro = [m for m in out["micro"] if m]
    kinds = [set(m) for m in micro]
    assert all(len(k) == 1 for k in kinds), "a micro-step saw both the old and the new embedding"
    seq = [k.pop() for k in kinds]
    assert seq[0] == "old" and seq[-1] == "new" and "old" not in seq[seq.index("new"):]
    assert all(len(m) == 3 for m in micro)                    # one read per unrolled EAGLE-3 step
    assert out["embed_is_new"] and out["head_is_new"]
    assert out["optimizer_params_unchanged"] and out["target_not_trainable"] and out["state_keys_unchanged"]
    # Not training: applied at once.
    m0(_op_call, "set_target_tensors", torch.zeros(VOCAB, 32), new_head)
    embed, head = m0(_op_target)
    assert bool((embed == 0).all()) and torch.equal(head, new_head)


def test_checkpoint_round_trip_falls_back_from_a_corrupt_latest_and_exports(members, setup, tmp_path):
    m0, m1 = members
    ck = tmp_path / "ck"
    m0(_op_new, setup["target"], service_cfg(init_seed=0), setup["a"])
    m0(_op_start, "ck", 0, 1, HOST, free_port(), 0)
    m0(_op_wait_version, 3)
    first = Path(m0(_op_call, "save_checkpoint", ck, 1))       # taken at a micro-step boundary
    v = m0(_op_wait_version, load_latest(ck).state["step"] + 3)
    second = Path(m0(_op_call, "save_checkpoint", ck, 2))
    m0(_op_stop, 5.0)
    final = m0(_op_state)
    exported = m0(_op_call, "export", tmp_path / "export")
    saved = [torch.load(p, weights_only=True) for p in (first, second)]
    assert saved[0]["service"]["global_step"] == 1 and saved[1]["step"] >= v > saved[0]["step"] >= 3

    m1(_op_new, setup["target"], service_cfg(init_seed=9))
    res = m1(_op_call, "load_checkpoint", ck)
    assert isinstance(res, LoadResult) and res and res.global_step == 2 and res.refused == ()
    s1 = m1(_op_state)
    assert s1["step"] == saved[1]["step"] == res.state_version
    assert same(s1["drafter"], saved[1]["drafter"]) and same_optimizer(s1["optimizer"], saved[1]["optimizer"])

    data = bytearray(second.read_bytes())
    data[len(data) // 2] ^= 0xFF
    second.write_bytes(bytes(data))
    res = m1(_op_call, "load_checkpoint", ck)
    assert res and res.global_step == 1 and len(res.refused) == 1 and "sha256" in res.refused[0]
    s1 = m1(_op_state)
    assert same(s1["drafter"], saved[0]["drafter"]) and s1["step"] == saved[0]["step"]

    first.write_bytes(b"x")
    res = m1(_op_call, "load_checkpoint", ck)
    assert not res and "no loadable checkpoint" in res.reason and "\n" not in res.reason
    assert same(m1(_op_state)["drafter"], saved[0]["drafter"])            # kept what it had

    embed, head = load_target_tensors(setup["target"], tie_word_embeddings=False)
    back = load_drafter(exported, setup["target_model"].config, embed, head)
    assert same(back.state_dict(), final["drafter"])
