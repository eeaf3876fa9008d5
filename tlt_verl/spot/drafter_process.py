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
the buffer) and gets the latest target tensors; calls wait for it. verl's
own checkpoints are untouched: the drafter's were written whole before verl marked the step.

Messages are ``torch.save`` bytes: pickling tensors over a multiprocessing pipe would route them
through shared-memory handles, whose lifetime is tied to a process that may be the one that died.
"""
from __future__ import annotations

import io
import logging
import multiprocessing as mp
import os
import threading
import time
from pathlib import Path
from typing import Any, Optional

import torch

from tlt_verl.capture.staging import StagingBuffer
from tlt_verl.spot.drafter_service import DrafterServiceConfig, _session_stats

log = logging.getLogger(__name__)

# DrafterService attributes a caller may reach through the pipe (methods, or properties read).
CALLS = ("start_session", "stop", "set_target_tensors", "save_checkpoint", "load_checkpoint", "export",
         "metrics", "add_samples", "state_version", "is_training", "aux_layer_ids", "target_digest")
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


def _serve(conn, target_dir: str, cfg: dict, core: Optional[int]) -> None:
    """The child: one DrafterService, answering calls in order until told to close or orphaned."""
    from tlt_verl.spot.drafter_service import DrafterService

    if core is not None and hasattr(os, "sched_setaffinity"):
        # The replica's own core, one thread: the other replicas' engines still decode on theirs.
        os.sched_setaffinity(0, {core})
        torch.set_num_threads(1)
    try:
        svc = DrafterService(target_dir, DrafterServiceConfig.from_dict(cfg), capture=False)
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


def _same(held: torch.Tensor, new: torch.Tensor) -> bool:
    return held.shape == new.shape and held.dtype == new.dtype and torch.equal(held, new.detach().to("cpu"))


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
        self._target: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self._last_checkpoint: Optional[str] = None
        self._session: Optional[tuple[str, int, int, int]] = None
        self.restarts = 0
        self._generation = 0                      # which child: a death is acted on once
        self.pid, aux = self._spawn()
        self._ready.set()
        self.staging = StagingBuffer(cfg.buffer.budget_bytes)
        if capture:
            verl_capture.enable(cfg.kind, aux, cfg.buffer, sink=self.staging)

    # ------------------------------------------------------------------ the child

    def _spawn(self) -> tuple[int, tuple[int, ...]]:
        ctx = mp.get_context("spawn")            # a forked child would inherit the actor's threads
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(child, self._target_dir, self.cfg.to_dict(), self._core),
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
                if self._target is not None:
                    self._rpc("set_target_tensors", *self._target)
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
                while staged := self.staging.take(stage_message_bytes(self.staging.budget_bytes)):
                    self._rpc("add_samples", staged)
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
        """Takes ownership of host tensors (the caller must not change them afterwards). Sent once per change: an unchanged embedding and LM head (frozen, or a sync of the same
        weights) cost a comparison, not a copy through the pipe."""
        if self._target is not None and _same(self._target[0], embed) and _same(self._target[1], lm_head):
            return
        # Host tensors are taken as they are (the adapter hands over copies of its own); only
        # device tensors are copied here.
        e = embed.detach().to("cpu")
        h = e if lm_head is embed else lm_head.detach().to("cpu")
        self._target = (e, h)                  # a restart applies the latest
        if self._ready.is_set():
            self._call("set_target_tensors", e, h)

    def target_digest(self) -> str:
        """As ``DrafterService.target_digest``: of the tensors the child holds (after a restart, the
        latest handed in, re-applied)."""
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
        from tlt_verl.spot.drafter_service import PREFIX

        return {**self._call("metrics", reset), PREFIX + "restarts": float(self.restarts)}

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
