"""DrafterService: the drafter a verl actor worker process hosts, trained while the rank is idle.

One service per process. It owns the drafter (bound to the target's frozen embedding / LM head),
its optimizer and trainer, and the process-local DataBuffer that ``verl_capture`` fills from the
actor's update forward. The coordinator drives it:

    start_session(id, rank, size, host, port, source_rank)   join a group of the idle ranks,
                                                             adopt the source member's state,
                                                             train in a background thread
    stop(timeout_s) -> stats                                 preempt: returns within a micro-step

A session is one fixed set of members. They start identical (the source member broadcasts its
weights, optimizer state and step; the freshest member is the coordinator's pick, by
``state_version``) and stay identical (the trainer all-reduces gradients and agrees on stopping,
so one member being stopped stops the whole session). A member whose buffer is still empty
trains nothing and adds zero gradients; if no member has data the session idles, polling, and
stays stoppable.

Everything else that touches the state (new target tensors from the per-step weight sync, a
checkpoint snapshot, an export) happens at a micro-step boundary of the training thread while a
session runs, or at once when none does, so no micro-step ever sees a half-swapped target and no
snapshot a half-applied optimizer step.

The target's embedding and LM head are held in the rollout's dtype (``target_dtype``), and only
by a drafter that trains: one built with ``holds_target=False`` binds zero-byte stand-ins and
refuses sessions. A drafter in a child process reads its host's segment in place
(``shared_target``): the host holds it (``hold_target``) while it rewrites the segment and hands
the new version over with ``release_target``.
"""
from __future__ import annotations

import hashlib
import io
import logging
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from tlt_verl.capture.buffer import KINDS, BufferConfig, DataBuffer
from tlt_verl.drafter import DrafterConfig, build_drafter
from tlt_verl.drafter.checkpoint import CheckpointError, CheckpointManager, SaveHandle, load_latest, snapshot
from tlt_verl.drafter.export import LAYOUTS, export_drafter, load_drafter, read_drafter_config
from tlt_verl.drafter.reducer import BACKEND_OF_DEVICE, LocalReducer, SessionAborted, SpotSession
from tlt_verl.drafter.target_weights import DTYPES, load_target_tensors, rollout_dtype
from tlt_verl.drafter.trainer import DrafterTrainer, TrainerConfig
from tlt_verl.utils.priority import idle_priority

log = logging.getLogger(__name__)

PREFIX = "tlt/drafter/"
# How long a held target may stay held before the training thread gives up on it (the host
# rewrites it in about a second; longer means the host is gone or stuck).
HOLD_TIMEOUT_S = 600.0
# TrainerConfig fields every member of a session must share: they decide the update each member
# applies (lr schedule, optimizer, clipping) and how many collectives a step runs (grad_accum).
# The data-side fields (seed, tokens per micro-batch, recency) may differ per member.
SHARED_TRAINER_FIELDS = ("lr", "min_lr_ratio", "warmup_steps", "total_steps", "weight_decay", "beta1", "beta2",
                         "grad_clip", "grad_accum")


@dataclass(frozen=True)
class DrafterServiceConfig:
    kind: str = "eagle"
    init: str | None = None                 # an EAGLE folder to warm-start from
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    buffer: BufferConfig | None = None      # None: BufferConfig(kind=kind)
    checkpoint_keep: int = 2
    init_seed: int = 0                      # drafter init when there is no ``init``
    device: str = "cpu"                     # "cpu", "cuda" or "cuda:<n>"
    idle_poll_s: float = 0.05               # session with no data anywhere: re-check period
    target_dtype: str | None = None         # the rollout's dtype; None: the target's config.json's
    holds_target: bool = True               # False: no target tensors (a rank that never trains)

    def __post_init__(self):
        def need(cond: bool, msg: str):
            if not cond:
                raise ValueError(f"DrafterServiceConfig.{msg}")

        need(self.kind in KINDS, f"kind={self.kind!r}: must be one of {', '.join(KINDS)}")
        need(self.init is None or (isinstance(self.init, str) and self.init != ""),
             f"init={self.init!r}: must be None or a folder path")
        need(isinstance(self.trainer, TrainerConfig), f"trainer={type(self.trainer).__name__}: must be a TrainerConfig")
        if self.buffer is None:
            object.__setattr__(self, "buffer", BufferConfig(kind=self.kind))
        need(isinstance(self.buffer, BufferConfig), f"buffer={type(self.buffer).__name__}: must be a BufferConfig")
        need(self.buffer.kind == self.kind, f"buffer.kind={self.buffer.kind!r}: differs from kind={self.kind!r}")
        need(isinstance(self.checkpoint_keep, int) and self.checkpoint_keep >= 1,
             f"checkpoint_keep={self.checkpoint_keep!r}: must be an int >= 1")
        need(isinstance(self.init_seed, int), f"init_seed={self.init_seed!r}: must be an int")
        need(isinstance(self.device, str) and (self.device in ("cpu", "cuda") or self.device.startswith("cuda:")),
             f"device={self.device!r}: must be 'cpu', 'cuda' or 'cuda:<n>'")
        need(self.idle_poll_s > 0, f"idle_poll_s={self.idle_poll_s}: must be > 0")
        need(self.target_dtype is None or self.target_dtype in DTYPES,
             f"target_dtype={self.target_dtype!r}: must be None or one of {', '.join(DTYPES)}")
        need(isinstance(self.holds_target, bool), f"holds_target={self.holds_target!r}: must be a bool")

    def to_dict(self) -> dict:
        return {**asdict(self), "trainer": self.trainer.to_dict(), "buffer": asdict(self.buffer)}

    @classmethod
    def from_dict(cls, d: dict) -> "DrafterServiceConfig":
        d = dict(d)
        if isinstance(d.get("trainer"), dict):
            d["trainer"] = TrainerConfig.from_dict({"loss": {}, **d["trainer"]})
        if isinstance(d.get("buffer"), dict):
            d["buffer"] = BufferConfig(**{"kind": d.get("kind", "eagle"), **d["buffer"]})
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"DrafterServiceConfig.{unknown[0]}: unknown option")
        return cls(**d)


@dataclass(frozen=True)
class LoadResult:
    """What ``load_checkpoint`` did; true when a checkpoint was loaded."""
    loaded: bool
    path: str | None = None
    global_step: int | None = None
    state_version: int = 0
    refused: tuple[str, ...] = ()          # newer checkpoints refused (corrupt), one line each
    reason: str | None = None              # why nothing was loaded

    def __bool__(self) -> bool:
        return self.loaded


def tensor_digest(*tensors: torch.Tensor) -> str:
    """sha256 over the tensors' shapes, dtypes and bytes: what was handed to a drafter, compared
    with what it holds (``DrafterService.target_digest``) without moving the tensors back."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().to("cpu").contiguous()
        h.update(f"{tuple(t.shape)} {t.dtype};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class _Slot:
    """Where a broadcast tensor goes back into a state skeleton."""

    def __init__(self, index: int, shape: tuple[int, ...], dtype: torch.dtype):
        self.index, self.shape, self.dtype = index, shape, dtype


# A skeleton is read with torch.load(weights_only=True): slots are the one class it may hold.
torch.serialization.add_safe_globals([_Slot])


def split_state(state: Any, device: torch.device) -> tuple[Any, list[torch.Tensor]]:
    """(skeleton, tensors): ``state`` with each tensor on ``device`` holding more than one element
    replaced by a ``_Slot``, and those tensors in order. Scalars (Adam's step counts, kept on the
    host) stay in the skeleton."""
    tensors: list[torch.Tensor] = []

    def walk(x):
        if isinstance(x, torch.Tensor) and x.numel() > 1 and x.device == device:
            tensors.append(x.detach().contiguous())
            return _Slot(len(tensors) - 1, tuple(x.shape), x.dtype)
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(walk(v) for v in x)
        return x

    return walk(state), tensors


def skeleton_specs(skeleton: Any) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of each slot, in order."""
    slots: list[_Slot] = []

    def walk(x):
        if isinstance(x, _Slot):
            slots.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(skeleton)
    return [(s.shape, s.dtype) for s in sorted(slots, key=lambda s: s.index)]


def join_state(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    def walk(x):
        if isinstance(x, _Slot):
            return tensors[x.index]
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(walk(v) for v in x)
        return x

    return walk(skeleton)


def _check_model_dir(path: str | Path, what: str) -> Path:
    p = Path(path)
    if not (p / "config.json").is_file():
        raise ValueError(f"{what}={str(path)!r}: no such model folder (no config.json)")
    return p


def _session_stats(session_id: str, rank: int, size: int, source_rank: int) -> dict[str, Any]:
    return {"session_id": session_id, "rank": rank, "size": size, "source_rank": source_rank,
            "steps": 0, "tokens": 0, "seconds": 0.0, "last_loss": None, "stop_latency_s": None,
            "join_s": None, "broadcast_s": None, "idle_polls": 0, "discarded_micro_steps": 0,
            "stopped": False, "aborted": None, "error": None, "scheduling": None, "thread_id": None}


def _stand_ins(vocab_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-byte [vocab, hidden] tensor (stride 0): satisfies the drafter's shape checks without
    holding the target's tensors."""
    return torch.zeros(1, hidden_size, dtype=dtype, device=device).expand(vocab_size, hidden_size)


class DrafterService:
    def __init__(self, target_dir: str, cfg: DrafterServiceConfig | None = None, capture: bool = True,
                 shared: tuple[torch.Tensor, torch.Tensor, int] | None = None):
        """``capture``: fill the buffer from this process's actor update (verl_capture);
        False: the buffer is filled through ``add_samples`` (a service hosted in a child process).
        ``shared``: (embed, lm_head, version) to read in place, owned by another process
        (``shared_target``); None: read from ``target_dir`` (unless ``cfg.holds_target`` is False)."""
        from transformers import AutoConfig

        self.cfg = cfg = cfg or DrafterServiceConfig()
        target = _check_model_dir(target_dir, "target_dir")
        target_config = AutoConfig.from_pretrained(target)
        drafter_cfg = DrafterConfig.from_target(target_config, kind=cfg.kind)
        if cfg.init is not None:
            init = _check_model_dir(cfg.init, "DrafterServiceConfig.init")
            init_kind = read_drafter_config(init, target_config).kind
            if init_kind != cfg.kind:
                raise ValueError(f"DrafterServiceConfig.init={cfg.init!r}: is an {init_kind} drafter, "
                                 f"but kind={cfg.kind!r}")
        self.device = torch.device(cfg.device)
        self.target_dtype = rollout_dtype(cfg.target_dtype, target_config)
        self.target_version = 0                # of the target tensors bound; 0: none (stand-ins)
        stand_ins = None
        if shared is not None:
            embed, head, self.target_version = shared
        elif cfg.holds_target or cfg.init is not None:
            # A warm start may start its LM head from the target's rows (EAGLE-3): read them even
            # for a drafter that holds none, and let them go once it is built.
            embed, head = load_target_tensors(target, bool(getattr(target_config, "tie_word_embeddings", False)),
                                              self.target_dtype)
            self.target_version = 1
        if shared is None and not cfg.holds_target:
            stand_ins = _stand_ins(drafter_cfg.vocab_size, drafter_cfg.hidden_size, self.target_dtype, self.device)
            if cfg.init is None:
                embed = head = stand_ins
            self.target_version = 0
        # Seeded without disturbing the actor's own random stream.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.init_seed)
            if cfg.init is not None:
                drafter = load_drafter(cfg.init, target_config, embed, head, warm_start=True)
            else:
                drafter = build_drafter(drafter_cfg, embed, head)
        if stand_ins is not None:
            drafter.target.bind(stand_ins, stand_ins)
            del embed, head
        self.drafter = drafter.to(self.device)
        self._captures = capture
        if not capture:
            self.buffer = DataBuffer(cfg.buffer)
        else:
            # Only a service that captures needs verl (its batch layout): one fed by
            # add_samples (a child process, a bare GPU image) runs on torch alone.
            from tlt_verl.capture import verl_capture

            if verl_capture.enabled():
                log.warning("drafter service: capture was already enabled in this process; its buffer is replaced")
            self.buffer = verl_capture.enable(cfg.kind, self.drafter.cfg.aux_layer_ids, cfg.buffer)
        self.trainer = DrafterTrainer(self.drafter, self.buffer, cfg.trainer, reducer=LocalReducer())

        self._lock = threading.Lock()
        self._gate = threading.Event()         # cleared while the target's owner rewrites it
        self._gate.set()
        self._active = False                  # a session thread exists (joining, adopting or training)
        self._training = False                # ... and it has reached its training loop
        self._pending_target: tuple[torch.Tensor, torch.Tensor] | None = None
        self._pending_ops: list[tuple[Callable[[], Any], Future]] = []
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._stats: dict[str, Any] = {}
        self._checkpoints: dict[Path, CheckpointManager] = {}
        # Counters since the last metrics() call; gauges are read live.
        self._counts = {"steps": 0, "tokens": 0, "train_seconds": 0.0, "sessions": 0}
        self._last_loss: float | None = None
        self._last_stop_latency: float | None = None

    # ------------------------------------------------------------------ state

    @property
    def state_version(self) -> int:
        """Optimizer steps behind the current weights (adopted from the source in a session,
        restored from a checkpoint): the freshest member has the highest."""
        return self.trainer.step

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        """The target layers whose states the drafter reads (besides the last): what capture hooks."""
        return tuple(self.drafter.cfg.aux_layer_ids)

    def target_digest(self) -> str:
        """``tensor_digest(embed, lm_head)`` of the target tensors the drafter trains with now (new
        ones handed in during a session count from the micro-step boundary that binds them)."""
        if not self.target_version:
            raise RuntimeError("target_digest: this drafter holds no target tensors (it does not train)")
        t = self.drafter.target
        return self._at_boundary(lambda: tensor_digest(t.embed_weight, t.lm_head_weight))

    @property
    def target_bytes(self) -> int:
        """Bytes of the target tensors the drafter is bound to (0 for stand-ins; shared ones count)."""
        t = self.drafter.target
        tensors = {x.data_ptr(): x for x in (t.embed_weight, t.lm_head_weight) if x.stride()[0] != 0}
        return sum(x.numel() * x.element_size() for x in tensors.values())

    def add_samples(self, samples: list[tuple]) -> int:
        """Store captured samples (``DataBuffer.add`` arguments, oldest first); returns the buffer size."""
        for sample in samples:
            self.buffer.add(*sample)
        return len(self.buffer)

    @property
    def is_training(self) -> bool:
        """A session is running on this member (joining, adopting the source's state or training)."""
        th = self._thread
        return th is not None and th.is_alive()

    def _boundary(self) -> None:
        """Runs on the training thread before every micro-step."""
        self._take_and_apply()
        if not self._gate.is_set():
            # The target's owner is rewriting it in place: no micro-step may read it until it is done.
            if not self._gate.wait(HOLD_TIMEOUT_S):
                raise RuntimeError(f"target tensors held for {HOLD_TIMEOUT_S:.0f}s without a release")
            self._take_and_apply()

    def _take_and_apply(self) -> None:
        with self._lock:
            target, self._pending_target = self._pending_target, None
            ops, self._pending_ops = self._pending_ops, []
        self._apply(target, ops)

    def _apply(self, target, ops) -> None:
        if target is not None:
            self.drafter.target.bind(*target)
        for fn, fut in ops:
            try:
                fut.set_result(fn())
            except BaseException as e:  # handed to the caller waiting on the future
                fut.set_exception(e)

    def _at_boundary(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` at the next micro-step boundary when a session runs (the caller waits at most a
        micro-step once training, longer while the session is still joining), else at once."""
        with self._lock:
            if not self._active:
                return fn()
            fut: Future = Future()
            self._pending_ops.append((fn, fut))
        return fut.result()

    def set_target_tensors(self, embed: torch.Tensor, lm_head: torch.Tensor) -> None:
        """The target's current embedding and LM head (after an RL step's weight sync). Copied now,
        in the rollout's dtype, and used from the next micro-step on; the caller may free or
        overwrite its tensors. (A drafter in a child process reads its host's copy in place
        instead: ``hold_target`` / ``release_target``.)"""
        want = (self.drafter.cfg.vocab_size, self.drafter.cfg.hidden_size)
        for name, t in (("embed", embed), ("lm_head", lm_head)):
            if tuple(t.shape) != want:
                raise ValueError(f"set_target_tensors: {name} has shape {tuple(t.shape)}, the drafter expects {want}")
        dtype = self.target_dtype
        e = embed.detach().to(self.device, dtype, copy=True)
        h = e if lm_head is embed else lm_head.detach().to(self.device, dtype, copy=True)
        with self._lock:
            self.target_version += 1
            if self._active:
                self._pending_target = (e, h)      # only the latest matters
                return
            self.drafter.target.bind(e, h)

    def hold_target(self) -> None:
        """From when this returns until ``release_target``, no micro-step reads the target tensors:
        their owner (the host process) rewrites them in place. A running session parks at its next
        micro-step boundary; one started meanwhile parks at its first."""
        with self._lock:
            self._gate.clear()
            if not self._training:
                return                          # not past its first boundary yet: it will park there
            reached: Future = Future()
            self._pending_ops.append((lambda: None, reached))
        reached.result()

    def release_target(self, version: int) -> None:
        """The owner has written version ``version`` of the shared target tensors: reads resume."""
        self.target_version = int(version)
        self._gate.set()

    # ------------------------------------------------------------------ sessions

    def start_session(self, session_id: str, rank: int, size: int, host: str, port: int, source_rank: int,
                      timeout_s: float = 300.0) -> None:
        """Join session ``session_id`` as ``rank`` of ``size`` (rank 0 hosts the rendezvous at
        ``host:port``) and train until stopped, in a background thread; returns at once. Every
        member must be given the same ``size``, ``host:port`` and ``source_rank``."""
        if not 0 <= rank < size:
            raise ValueError(f"start_session: rank={rank}, size={size}: need 0 <= rank < size")
        if not 0 <= source_rank < size:
            raise ValueError(f"start_session: source_rank={source_rank}: not a member of a {size}-rank session")
        if not self.target_version:
            raise RuntimeError(f"start_session {session_id}: this drafter holds no target tensors "
                               f"(a rank whose drafter does not train)")
        with self._lock:
            if self._active:
                raise RuntimeError(f"start_session {session_id}: session {self._stats.get('session_id')} "
                                   f"is still running; stop it first")
            self._active = True
            self._stop = threading.Event()
            self._stats = _session_stats(session_id, rank, size, source_rank)
            self._counts["sessions"] += 1
            self._thread = threading.Thread(target=self._run_session,
                                            args=(session_id, rank, size, host, port, source_rank, timeout_s),
                                            name=f"drafter-session-{session_id}", daemon=True)
            self._thread.start()

    def _run_session(self, session_id, rank, size, host, port, source_rank, timeout_s) -> None:
        stats, session = self._stats, None
        # Training harvests idle cycles only: this thread yields its core to anything else that
        # wants it (the replicas still decoding, verl's agent loop); calls on the service (stop,
        # metrics, a save) are answered by the caller's thread at its own priority.
        stats.update(scheduling=idle_priority(), thread_id=threading.get_native_id())
        try:
            t0 = time.perf_counter()
            session = SpotSession.join(host, port, session_id, rank, size, timeout_s, abort=self._stop.is_set,
                                       backend=BACKEND_OF_DEVICE[self.device.type])
            t1 = time.perf_counter()
            self._adopt(session, source_rank)
            t2 = time.perf_counter()
            stats.update(join_s=t1 - t0, broadcast_s=t2 - t1)
            self.trainer.reducer = session
            with self._lock:
                self._training = True
            while True:
                res = self.trainer.train(stop=self._stop, on_step=self._on_step, before_micro=self._boundary)
                stats["discarded_micro_steps"] += res.discarded_micro_steps
                if res.stopped:
                    break
                # No member has data: the next train() call re-checks (and agrees on stopping).
                stats["idle_polls"] += 1
                time.sleep(self.cfg.idle_poll_s)
            stats["seconds"] = time.perf_counter() - t2
            stats["stopped"] = True
        except SessionAborted as e:
            # Stopped (here or at a peer) before every member had joined: nothing to report but that.
            stats.update(stopped=True, aborted=str(e))
        except BaseException as e:  # reported by stop() and metrics; the peers fail on their timeout
            stats["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
            log.exception("drafter session %s (rank %d of %d) failed", session_id, rank, size)
        finally:
            self.trainer.reducer = LocalReducer()
            if session is not None:
                session.close()
            # Requests queued after the last micro-step run here, under the lock, so a request
            # arriving now (applied at once) cannot be overtaken by an older queued one.
            with self._lock:
                self._active = self._training = False
                target, self._pending_target = self._pending_target, None
                ops, self._pending_ops = self._pending_ops, []
                self._apply(target, ops)

    def _adopt(self, session: SpotSession, source_rank: int) -> None:
        """Every member takes the source's weights, optimizer state and step (not its data cursor:
        that indexes the source's own buffer). A member that cannot (a different drafter or
        trainer config) makes the whole session fail, agreed by all, rather than hang it.

        The state moves as its tensors: the source broadcasts a small skeleton (the state with
        each large tensor replaced by its shape and dtype), the members check it and agree, then
        every large tensor is broadcast on its own, on the drafter's device, with no
        serialisation of the weights and optimizer moments."""
        if session.size == 1:
            return
        skeleton, tensors = None, []
        if session.rank == source_rank:
            skeleton, tensors = split_state(self.trainer.state_dict(), self.device)
            buf = io.BytesIO()
            torch.save(skeleton, buf)              # kilobytes: no tensor of the state is in it
            payload = torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)
        n = torch.tensor([0 if skeleton is None else payload.numel()], dtype=torch.int64)
        session.broadcast_(n, source_rank)
        if skeleton is None:
            payload = torch.empty(int(n.item()), dtype=torch.uint8)
        session.broadcast_(payload, source_rank)
        error = None
        if session.rank != source_rank:
            try:
                skeleton = torch.load(io.BytesIO(payload.numpy().tobytes()), map_location="cpu", weights_only=True)
                mine, theirs = self.trainer.cfg.to_dict(), skeleton["trainer_config"]
                diff = [k for k in SHARED_TRAINER_FIELDS if mine[k] != theirs[k]]
                if diff:
                    raise ValueError(f"TrainerConfig.{diff[0]}={mine[diff[0]]!r} differs from the source "
                                     f"member's {theirs[diff[0]]!r}")
                d = skeleton["drafter_config"]
                theirs_cfg = DrafterConfig(**{**d, "aux_layer_ids": tuple(d["aux_layer_ids"])})
                if theirs_cfg != self.drafter.cfg:
                    diff = [k for k in d if getattr(theirs_cfg, k) != getattr(self.drafter.cfg, k)]
                    raise ValueError(f"drafter config differs from the source member's in {', '.join(diff)}")
            except (ValueError, KeyError, RuntimeError) as e:
                error = e
        # Agreed before any tensor moves: a member that cannot adopt would leave the others
        # waiting in a broadcast it never joins.
        failed = session.all_reduce_max_(torch.tensor([0 if error is None else 1], dtype=torch.int32))
        if error is not None:
            raise ValueError(f"session {session.session_id}: cannot adopt rank {source_rank}'s drafter: {error}")
        if failed.item():
            raise RuntimeError(f"session {session.session_id}: another member could not adopt rank "
                               f"{source_rank}'s drafter")
        if session.rank != source_rank:
            tensors = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in skeleton_specs(skeleton)]
        for t in tensors:
            session.broadcast_(t, source_rank)
        if session.rank != source_rank:
            self.trainer.load_state_dict({**join_state(skeleton, tensors), "cursor": self.trainer.cursor})

    def _on_step(self, step: int, m: dict) -> None:
        s, c = self._stats, self._counts
        s["steps"] += 1
        s["tokens"] += m["tokens"]
        c["steps"] += 1
        c["tokens"] += m["tokens"]
        c["train_seconds"] += m["step_s"]
        if m["micro_steps"]:
            s["last_loss"] = self._last_loss = m["loss"]

    def stop(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """Stop this member's session (and so the whole session) and return its stats: steps and
        tokens this member trained in it, training seconds, last loss, stop latency (signal to
        thread exit; 0 if a peer had already stopped it). Stopped before all members had joined,
        the session is called off for all of them (``aborted`` says why). ``timed_out``: the
        thread was still alive after ``timeout_s``."""
        th = self._thread
        if th is None:
            return {**(dict(self._stats) or _session_stats("", 0, 1, 0)), "state_version": self.state_version}
        t0 = time.perf_counter()
        was_alive = th.is_alive()
        self._stop.set()
        th.join(timeout_s)
        if th.is_alive():
            return {**self._stats, "timed_out": True}
        latency = time.perf_counter() - t0 if was_alive else 0.0
        self._stats["stop_latency_s"] = self._last_stop_latency = latency
        self._thread = None
        return {**self._stats, "timed_out": False, "state_version": self.state_version}

    # ------------------------------------------------------------------ checkpoints and export

    def _manager(self, directory: str | Path) -> CheckpointManager:
        key = Path(directory).resolve()
        if key not in self._checkpoints:
            self._checkpoints[key] = CheckpointManager(key, keep=self.cfg.checkpoint_keep)
        return self._checkpoints[key]

    def save_checkpoint(self, directory: str | Path, global_step: int, wait: bool = False) -> SaveHandle | Path:
        """Snapshot the trainer state (at a micro-step boundary if training) and write it in the
        background; returns the ``SaveHandle`` (its ``wait()`` gives the file), or with ``wait``
        the written file. Named and ordered by ``global_step`` (the RL step)."""
        mgr = self._manager(directory)

        def snap() -> SaveHandle:
            state = {**self.trainer.state_dict(), "buffer": self.buffer.state_dict(),
                     "service": {"global_step": int(global_step), "state_version": self.state_version}}
            return mgr.save_async(state, int(global_step))

        handle = self._at_boundary(snap)
        return handle.wait() if wait else handle

    def load_checkpoint(self, directory: str | Path) -> LoadResult:
        """Load the newest good checkpoint in ``directory`` (a corrupt newest one falls back to the
        previous one). None loadable: the current drafter is kept and the result says why. Not
        during a session: its members must keep holding the same state."""
        with self._lock:
            if self._active:
                raise RuntimeError("load_checkpoint: a session is running; stop it first")
            for mgr in self._checkpoints.values():
                mgr.wait()
            try:
                with warnings.catch_warnings(record=True):
                    warnings.simplefilter("always")
                    loaded = load_latest(directory)
            except CheckpointError as e:
                log.warning("drafter service: %s; keeping the current drafter (step %d)", e, self.state_version)
                return LoadResult(False, state_version=self.state_version, reason=str(e))
            before = snapshot(self.trainer.state_dict())
            try:
                self.trainer.load_state_dict(loaded.state)
            except (ValueError, KeyError, RuntimeError) as e:
                self.trainer.load_state_dict(before)
                reason = f"checkpoint {loaded.path}: {e}".splitlines()[0]
                log.warning("drafter service: %s; keeping the current drafter (step %d)", reason, self.state_version)
                return LoadResult(False, state_version=self.state_version, refused=tuple(loaded.refused), reason=reason)
            for line in loaded.refused:
                log.warning("drafter service: refused %s", line)
            return LoadResult(True, str(loaded.path), loaded.step, self.state_version, tuple(loaded.refused))

    def export(self, out_dir: str | Path, engine: str = "vllm") -> Path:
        """The drafter as a serving-engine folder (``config.json`` + ``model.safetensors``); the
        weights are copied at a micro-step boundary and written without holding up training."""
        if (engine, self.drafter.cfg.kind) not in LAYOUTS:
            raise ValueError(f"export: engine={engine!r}: must be vllm or sglang")
        weights = self._at_boundary(lambda: snapshot(self.drafter.state_dict()))
        cfg = self.drafter.cfg
        # Export writes the drafter's own weights only: stride-0 stand-ins satisfy the target
        # shape checks without another copy of the embedding.
        stand_in = torch.zeros(1, cfg.hidden_size).expand(cfg.vocab_size, cfg.hidden_size)
        shadow = build_drafter(cfg, stand_in, stand_in).to(self.drafter.fc.weight.dtype)
        shadow.load_state_dict(weights)
        return export_drafter(shadow, out_dir, engine=engine)

    # ------------------------------------------------------------------ metrics and teardown

    def metrics(self, reset: bool = True) -> dict[str, float]:
        """For verl's step metrics: counters (steps, tokens, train seconds, sessions) since the
        previous call, gauges (last loss, state version, buffer) as of now."""
        c = dict(self._counts)
        if reset:
            self._counts.update(steps=0, tokens=0, train_seconds=0.0, sessions=0)
        nan = float("nan")
        out = {
            "loss": self._last_loss if self._last_loss is not None else nan,
            "steps": c["steps"], "tokens": c["tokens"], "train_seconds": c["train_seconds"],
            "sessions": c["sessions"], "version": self.state_version,
            "buffer_samples": len(self.buffer), "buffer_bytes": self.buffer.memory_bytes + self.buffer.spill_bytes,
            "stop_latency_s": self._last_stop_latency if self._last_stop_latency is not None else nan,
            "training": int(self.is_training),
            "target_bytes": self.target_bytes, "target_version": self.target_version,
        }
        return {PREFIX + k: float(v) for k, v in out.items()}

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop any session, finish pending checkpoint writes and stop capturing into this buffer."""
        if self._thread is not None:
            self.stop(timeout_s)
        for mgr in self._checkpoints.values():
            mgr.wait()
        if self._captures:
            from tlt_verl.capture import verl_capture

            if verl_capture.buffer() is self.buffer:
                verl_capture.disable()
