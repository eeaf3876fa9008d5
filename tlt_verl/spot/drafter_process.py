"""DrafterProcess: the rank's DrafterService in a child process, restarted when that process dies.

Drafter training runs beside verl's actor on cores the long tail left idle; if it crashes (or is
killed: OOM, a SIGKILL from an operator) the RL run must not. So the actor worker hosts this
proxy, and the service itself, with its optimizer, trainer thread and buffer, lives in a spawned
child. Capture still happens in the actor's update forward, into a ``StagingBuffer`` here; staged
samples go to the child in one message before each call.

When the child dies the proxy says so once (a warning, ``restarts`` in the metrics), answers the
session's ``stop`` at once with the death as its error, and starts a new child in the background.
The new one resumes from the last checkpoint this proxy saved or loaded (training since then is
lost, nothing older; in-memory samples are not checkpointed, and the next actor update refills
the buffer) and maps the latest target tensors; calls wait for it. verl's
own checkpoints are untouched: the drafter's were written whole before verl marked the step.

Messages are ``torch.save`` bytes: pickling tensors over a multiprocessing pipe would route them
through shared-memory handles, whose lifetime is tied to a process that may be the one that died.
The one exception is the target's embedding and LM head, which this process owns
(``SharedTarget``: shared memory on CPU, CUDA IPC on GPU) and the child only maps: the child's
death cannot free them, and a restarted child is handed a fresh handle. They exist only on a rank
whose drafter trains, in the rollout's dtype; a weight sync rewrites them in place and sends the
child a version number.
"""
from __future__ import annotations

import io
import logging
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import torch

from tlt_verl.capture.staging import StagingBuffer
from tlt_verl.spot.drafter_service import DrafterServiceConfig, _session_stats
from tlt_verl.spot.shared_target import SharedTarget, TargetRef

log = logging.getLogger(__name__)

# DrafterService attributes a caller may reach through the pipe (methods, or properties read).
CALLS = ("start_session", "stop", "hold_target", "release_target", "save_checkpoint", "load_checkpoint", "export",
         "metrics", "add_samples", "state_version", "is_training", "aux_layer_ids", "target_digest",
         "target_version")
# Errors the child's methods raise for a caller's mistake: re-raised here as themselves.
ERRORS = {e.__name__: e for e in (ValueError, RuntimeError, TimeoutError, FileNotFoundError, KeyError)}


class DrafterProcessError(RuntimeError):
    """The child could not start, or died and could not be restarted."""


def _dumps(obj) -> memoryview:
    buf = io.BytesIO()
    torch.save(obj, buf)
    # A view, not getvalue()'s copy: a message of staged states is not held twice on the way out.
    return buf.getbuffer()


def _loads(data: bytes):
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


def _serve(conn, target_dir: str, cfg: dict, core: Optional[int], target: Optional[TargetRef] = None) -> None:
    """The child: one DrafterService, answering calls in order until told to close or orphaned.
    ``target``: the host's shared target tensors, mapped here (None: a drafter that does not train)."""
    from tlt_verl.spot.drafter_service import DrafterService

    if core is not None and hasattr(os, "sched_setaffinity"):
        # The replica's own core, one thread: the other replicas' engines still decode on theirs.
        os.sched_setaffinity(0, {core})
        torch.set_num_threads(1)
    try:
        shared = None if target is None else (*target.open(), target.version)
        svc = DrafterService(target_dir, DrafterServiceConfig.from_dict({**cfg, "holds_target": False}),
                             capture=False, shared=shared)
    except BaseException as e:
        conn.send_bytes(_dumps(("error", type(e).__name__, str(e))))
        return
    conn.send_bytes(_dumps(("ok", os.getpid(), svc.aux_layer_ids)))
    while True:
        try:
            name, args, kwargs = _loads(conn.recv_bytes())
        except (EOFError, OSError):
            break                                  # the actor is gone: so is its drafter
        if name == "close":
            svc.close(*args)
            conn.send_bytes(_dumps(("ok", None)))
            break
        try:
            attr = getattr(svc, name)
            out = attr(*args, **kwargs) if callable(attr) else attr
            reply = ("ok", out)
        except BaseException as e:
            reply = ("error", type(e).__name__, f"{e}".splitlines()[0] if str(e) else "")
        conn.send_bytes(_dumps(reply))


class _Died(Exception):
    def __init__(self, reason: str, generation: int):
        super().__init__(reason)
        self.generation = generation


# The largest add_samples message (see DrafterProcess._call): 64 MiB, and at most a quarter of
# the staging budget, so that the message (whose torch.save buffer grows by doubling) adds at most
# about half a budget to the budget already staged.
STAGE_MESSAGE_BYTES = 64 << 20


def stage_message_bytes(budget_bytes: int | None) -> int:
    if budget_bytes is None:
        return STAGE_MESSAGE_BYTES
    return max(1 << 20, min(STAGE_MESSAGE_BYTES, budget_bytes // 4))


class DrafterProcess:
    def __init__(self, target_dir: str, cfg: DrafterServiceConfig, core: Optional[int] = None,
                 start_timeout_s: float = 300.0, capture: bool = True):
        """Start the child (and wait until its service is built: a bad ``cfg`` fails here) and,
        with ``capture``, capture this process's actor update into the staging buffer."""
        from tlt_verl.capture import verl_capture

        self.cfg, self._target_dir, self._core = cfg, str(target_dir), core
        # Whether this rank's drafter trains: only then does it read the actor update and the
        # target's embedding and LM head (tlt_verl/rollout/engine/adapter.py).
        self.capture = capture
        self._start_timeout_s = start_timeout_s
        self._lock = threading.RLock()            # one call on the pipe at a time
        self._ready = threading.Event()
        self._failure: Optional[str] = None       # why the last restart failed
        self._proc = self._conn = None
        # One writer of the shared target at a time; and no digest read while it is rewritten.
        self._target_lock = threading.Lock()
        self._target = self._shared_target(cfg) if capture else None
        self._last_checkpoint: Optional[str] = None
        self._session: Optional[tuple[str, int, int, int]] = None
        self.restarts = 0
        self._generation = 0                      # which child: a death is acted on once
        # What this rank's drafter costs the actor's own process, since the last metrics(): the
        # capture in the actor update, the staged states' hand-over to the child, the target's
        # embedding and LM head written for it at a weight sync.
        self._host_s = {"capture_s": 0.0, "stage_s": 0.0, "target_handover_s": 0.0}
        self._captured_s = 0.0                    # verl_capture's running total at the last read
        self.pid, aux = self._spawn()
        self._ready.set()
        self.staging = StagingBuffer(cfg.buffer.budget_bytes)
        if capture:
            verl_capture.enable(cfg.kind, aux, cfg.buffer, sink=self.staging)

    # ------------------------------------------------------------------ the child

    def _shared_target(self, cfg: DrafterServiceConfig) -> SharedTarget:
        """The target's embedding and LM head in the rollout's dtype on the drafter's device, read
        from the checkpoint until the first weight sync overwrites them."""
        from transformers import AutoConfig

        from tlt_verl.drafter.target_weights import rollout_dtype

        tc = AutoConfig.from_pretrained(self._target_dir)
        tied = bool(getattr(tc, "tie_word_embeddings", False))
        target = SharedTarget(tc.vocab_size, tc.hidden_size, rollout_dtype(cfg.target_dtype, tc), cfg.device, tied)
        target.load(self._target_dir, tied)
        return target

    def _spawn(self) -> tuple[int, tuple[int, ...]]:
        ctx = mp.get_context("spawn")            # a forked child would inherit the actor's threads
        parent, child = ctx.Pipe()
        ref = None if self._target is None else self._target.ref()
        proc = ctx.Process(target=_serve, args=(child, self._target_dir, self.cfg.to_dict(), self._core, ref),
                           name="tlt-drafter", daemon=True)
        proc.start()
        child.close()
        if not parent.poll(self._start_timeout_s):
            proc.kill()
            raise DrafterProcessError(f"drafter process: not ready after {self._start_timeout_s:.0f}s")
        try:
            reply = _loads(parent.recv_bytes())
        except (EOFError, OSError):
            proc.join(5)
            raise DrafterProcessError(f"drafter process: exited while starting (exit code {proc.exitcode})")
        if reply[0] != "ok":
            proc.join(5)
            raise ERRORS.get(reply[1], DrafterProcessError)(reply[2])
        self._proc, self._conn = proc, parent
        return reply[1], tuple(reply[2])

    def _rpc(self, name: str, *args, **kwargs) -> Any:
        with self._lock:
            try:
                self._conn.send_bytes(_dumps((name, args, kwargs)))
                reply = _loads(self._conn.recv_bytes())
            except (EOFError, OSError) as e:
                raise _Died(self._death(), self._generation) from e
        if reply[0] == "ok":
            return reply[1]
        raise ERRORS.get(reply[1], RuntimeError)(reply[2])

    def _death(self) -> str:
        self._proc.join(5)
        code = self._proc.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return f"drafter process {self.pid} died ({how})"

    def _restart(self, died: _Died) -> None:
        """Once per death (the first call that meets it): a new child, in the background."""
        reason = str(died)
        with self._lock:
            if died.generation != self._generation or not self._ready.is_set():
                return
            self._ready.clear()
            self._conn.close()
        self.restarts += 1
        log.warning("tlt: %s; restarting it from %s", reason, self._last_checkpoint or "its initial drafter")
        print(f"tlt: {reason}; restarting it from {self._last_checkpoint or 'its initial drafter'}", flush=True)
        threading.Thread(target=self._respawn, name="tlt-drafter-restart", daemon=True).start()

    def _respawn(self) -> None:
        try:
            with self._lock:
                self._generation += 1
                self.pid, _ = self._spawn()
                if self._last_checkpoint is not None:
                    res = self._rpc("load_checkpoint", self._last_checkpoint)
                    print(f"tlt: drafter process {self.pid} resumed from {res.path or res.reason} "
                          f"(state version {res.state_version})", flush=True)
            self._failure = None
        except BaseException as e:
            self._failure = f"{type(e).__name__}: {e}".splitlines()[0]
            log.error("tlt: drafter process could not be restarted: %s", self._failure)
        finally:
            self._ready.set()

    def _call(self, name: str, *args, **kwargs) -> Any:
        for attempt in (0, 1):
            self._ready.wait()
            if self._failure is not None:
                raise DrafterProcessError(f"drafter process: restart failed: {self._failure}")
            try:
                # In messages of at most stage_message_bytes(): a message is pickled whole, so one
                # step's states in one message would double them on the host for a moment.
                if len(self.staging):
                    t = time.perf_counter()
                    while staged := self.staging.take(stage_message_bytes(self.staging.budget_bytes)):
                        self._rpc("add_samples", staged)
                    self._host_s["stage_s"] += time.perf_counter() - t
                return self._rpc(name, *args, **kwargs)
            except _Died as e:
                self._restart(e)
                if attempt:
                    raise DrafterProcessError(str(e)) from None
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ DrafterService's interface

    @property
    def state_version(self) -> int:
        return self._call("state_version")

    @property
    def is_training(self) -> bool:
        return self._call("is_training")

    def start_session(self, session_id: str, rank: int, size: int, host: str, port: int, source_rank: int,
                      timeout_s: float = 300.0) -> None:
        self._call("start_session", session_id, rank, size, host, port, source_rank, timeout_s)
        self._session = (session_id, rank, size, source_rank)

    def stop(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """As ``DrafterService.stop``; a child that died in the session gives its stats with the
        death as ``error`` at once, without waiting for the restart."""
        session, self._session = self._session, None
        if self._ready.is_set() and self._failure is None:
            try:
                return self._rpc("stop", timeout_s)
            except _Died as e:
                reason = str(e)
                self._restart(e)
        else:
            reason = f"drafter process {self.pid} is restarting"
        stats = _session_stats(*(session or ("", 0, 1, 0)))
        return {**stats, "stopped": True, "error": reason, "timed_out": False, "state_version": 0}

    def set_target_tensors(self, embed: torch.Tensor, lm_head: torch.Tensor) -> None:
        """The target's embedding and LM head after a weight sync, written into the shared segment
        the child reads (cast to the rollout's dtype on the way) while the child holds; the child
        is then told the new version. Nothing of the tensors crosses the pipe, and unchanged
        values (frozen, or a sync of the same weights) are compared, not copied: the version stays.
        The caller keeps its tensors. Only a rank whose drafter trains holds the target."""
        with self.target_update() as write:
            write("embed", embed)
            write("lm_head", lm_head)

    @contextmanager
    def target_update(self) -> Iterator[Callable[[str, torch.Tensor], None]]:
        """A weight sync's embedding and LM head written straight into the shared segment as the
        weight stream passes them (``write("embed" | "lm_head", tensor)``, any device and dtype):
        no host copy of the stream first. The child holds for the duration and is told the new
        version at the end."""
        if self._target is None:
            raise RuntimeError("set_target_tensors: this rank's drafter does not train and holds no target tensors")
        # Timed: the hold, each write and the release, not the weight stream they wrap (verl's
        # own sync) nor the staged states' hand-over that goes first (stage_s).
        def timed(fn, *args):
            t, staged = time.perf_counter(), self._host_s["stage_s"]
            try:
                return fn(*args)
            finally:
                self._host_s["target_handover_s"] += time.perf_counter() - t - (self._host_s["stage_s"] - staged)

        with self._target_lock:
            timed(self._call, "hold_target")
            try:
                yield lambda name, tensor: timed(self._target.write_part, name, tensor)
            finally:
                # A child restarted meanwhile mapped the segment as written so far; this release
                # (retried on it) names the version it holds now.
                timed(lambda: (self._target.commit(), self._call("release_target", self._target.version)))

    @property
    def target_version(self) -> int:
        """Version of the target tensors this rank holds (0: none, a rank that does not train);
        each weight sync that changes them adds one."""
        return 0 if self._target is None else self._target.version

    @property
    def target_bytes_copied(self) -> int:
        """Bytes written into the shared target since this drafter started (the checkpoint's, then
        each changed sync's)."""
        return 0 if self._target is None else self._target.bytes_copied

    def target_digest(self) -> str:
        """As ``DrafterService.target_digest``: of the tensors the child reads (after a restart, the
        same shared ones)."""
        with self._target_lock:
            return self._call("target_digest")

    def save_checkpoint(self, directory: str | Path, global_step: int, wait: bool = True) -> Path:
        """Written before this returns (``wait`` is accepted for DrafterService's signature)."""
        path = self._call("save_checkpoint", str(directory), global_step, wait=True)
        self._last_checkpoint = str(directory)
        return path

    def load_checkpoint(self, directory: str | Path):
        res = self._call("load_checkpoint", str(directory))
        if res.loaded:
            self._last_checkpoint = str(directory)
        return res

    def export(self, out_dir: str | Path, engine: str = "vllm") -> Path:
        return self._call("export", str(out_dir), engine)

    def metrics(self, reset: bool = True) -> dict[str, float]:
        """The child's metrics, this host's restarts of it, and what the drafter cost the actor's
        process since the last call (``host/*``: seconds of capture, hand-over and target writes)."""
        from tlt_verl.capture import verl_capture
        from tlt_verl.spot.drafter_service import PREFIX

        out = {**self._call("metrics", reset), PREFIX + "restarts": float(self.restarts)}
        stats = verl_capture.stats() if self.capture else None
        if stats is not None:
            self._host_s["capture_s"] += stats.seconds - self._captured_s
            self._captured_s = stats.seconds
        out.update({f"{PREFIX}host/{k}": v for k, v in self._host_s.items()})
        if reset:
            self._host_s = dict.fromkeys(self._host_s, 0.0)
        return out

    def close(self, timeout_s: float = 30.0) -> None:
        from tlt_verl.capture import verl_capture

        if verl_capture.buffer() is self.staging:
            verl_capture.disable()
        self._ready.wait(self._start_timeout_s)
        try:
            self._rpc("close", timeout_s)
        except (_Died, RuntimeError):
            pass
        if self._proc is not None:
            self._proc.join(timeout_s)
            if self._proc.is_alive():
                self._proc.kill()
        self._target = None                      # the child is gone: nothing maps the segment now
