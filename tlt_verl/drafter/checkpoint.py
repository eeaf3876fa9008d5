"""Selective, asynchronous, atomic drafter checkpoints.

A checkpoint is what ``DrafterTrainer.state_dict()`` returns (trainable weights, optimizer
state, step, lr-schedule state, data cursor, drafter and trainer configs) plus whatever the
caller adds (the buffer's metadata). The frozen target embedding / LM head are never in it.

On disk, per checkpoint, in one directory:

    ckpt-<step>-<tag>.pt      torch.save of the state
    ckpt-<step>-<tag>.json    manifest: file name, size, sha256; written last

Each file is written to a temporary name in the same directory, fsynced and renamed, so a
reader sees either nothing or a whole file; the manifest is the commit record, so a data file
without one (a writer killed between the two renames) is ignored. Older checkpoints are pruned
only after the new manifest is in place: the previous good checkpoint survives any crash.
``load_latest`` re-hashes the data file and refuses a checkpoint that does not match, falling
back to the next older one.
"""
from __future__ import annotations

import json
import os
import threading
import time
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tlt_verl.utils.files import sha256_file

FORMAT = 1
TMP_MARK = ".tmp-"


class CheckpointError(ValueError):
    pass


def snapshot(state: Any) -> Any:
    """A copy of ``state`` whose tensors are detached CPU clones: training may go on mutating
    the live tensors while a background thread writes the copy."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: snapshot(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(snapshot(v) for v in state)
    return state




def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomically(path: Path, write) -> None:
    tmp = path.with_name(f"{path.name}{TMP_MARK}{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@dataclass
class Loaded:
    path: Path                       # the data file
    step: int
    state: dict
    refused: list[str] = field(default_factory=list)   # one line per newer checkpoint refused


def manifests(directory: Path) -> list[Path]:
    """Committed manifests, newest first: names sort by (step, write time)."""
    return sorted((p for p in directory.glob("ckpt-*.json") if TMP_MARK not in p.name),
                  key=lambda p: p.name, reverse=True)


class SaveHandle:
    """A checkpoint being written in the background; ``wait()`` returns its data file."""

    def __init__(self, fn):
        self._result: Path | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name="drafter-ckpt", daemon=True)
        self._thread.start()

    def _run(self, fn):
        try:
            self._result = fn()
        except BaseException as e:  # handed to wait()
            self._error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> Path:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"checkpoint still being written after {timeout}s")
        if self._error is not None:
            raise self._error
        return self._result


class CheckpointManager:
    def __init__(self, directory: str | Path, keep: int = 2):
        if keep < 1:
            raise ValueError(f"CheckpointManager.keep={keep}: must be >= 1")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self._pending: SaveHandle | None = None
        # Temporaries of a writer that died (this manager is the directory's only writer).
        for stale in self.dir.glob(f"*{TMP_MARK}*"):
            stale.unlink(missing_ok=True)

    def save_async(self, state: dict, step: int) -> SaveHandle:
        """Copy ``state`` now, write it in a background thread. Saves run one at a time, in
        call order."""
        if self._pending is not None:
            self._pending.wait()
        copy = snapshot(state)
        self._pending = SaveHandle(lambda: self._write(copy, int(step)))
        return self._pending

    def save(self, state: dict, step: int) -> Path:
        return self.save_async(state, step).wait()

    def wait(self) -> None:
        if self._pending is not None:
            self._pending.wait()

    def _write(self, state: dict, step: int) -> Path:
        stem = f"ckpt-{step:08d}-{time.time_ns():x}{uuid.uuid4().hex[:6]}"
        data = self.dir / f"{stem}.pt"
        _write_atomically(data, lambda f: torch.save(state, f))
        manifest = {"format": FORMAT, "step": step, "file": data.name, "bytes": data.stat().st_size,
                    "sha256": sha256_file(data), "written_ns": time.time_ns()}
        _write_atomically(self.dir / f"{stem}.json",
                          lambda f: f.write((json.dumps(manifest, indent=1) + "\n").encode()))
        _fsync_dir(self.dir)
        self._prune()
        return data

    def _prune(self) -> None:
        for old in manifests(self.dir)[self.keep:]:
            old.unlink(missing_ok=True)              # uncommit first, then drop the data
            old.with_suffix(".pt").unlink(missing_ok=True)
        # Data files whose manifest never got written (killed between the two renames).
        committed = {p.with_suffix(".pt").name for p in manifests(self.dir)}
        for data in self.dir.glob("ckpt-*.pt"):
            if data.name not in committed:
                data.unlink(missing_ok=True)

    def load_latest(self) -> Loaded:
        return load_latest(self.dir)


def verify(manifest_path: Path) -> tuple[Path, dict]:
    """The data file and manifest of a checkpoint, or a one-line CheckpointError."""
    try:
        m = json.loads(manifest_path.read_text())
        data = manifest_path.with_name(m["file"])
        want_sha, want_bytes = m["sha256"], m["bytes"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {manifest_path}: unreadable manifest ({type(e).__name__})") from None
    if m.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {manifest_path}: format {m.get('format')!r}, expected {FORMAT}")
    if not data.exists():
        raise CheckpointError(f"checkpoint {data}: missing")
    if data.stat().st_size != want_bytes or sha256_file(data) != want_sha:
        raise CheckpointError(f"checkpoint {data}: sha256 does not match its manifest (corrupt or truncated)")
    return data, m


def load(manifest_path: str | Path) -> Loaded:
    data, m = verify(Path(manifest_path))
    try:
        state = torch.load(data, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"checkpoint {data}: cannot be read ({type(e).__name__})") from None
    return Loaded(data, int(m["step"]), state)


def load_latest(directory: str | Path) -> Loaded:
    """The newest checkpoint in ``directory`` that verifies. Each newer one refused is warned
    about in one line (and listed in ``Loaded.refused``); none loadable is a CheckpointError."""
    d = Path(directory)
    if not d.is_dir():
        raise CheckpointError(f"checkpoint directory {d}: not found")
    refused: list[str] = []
    for manifest in manifests(d):
        try:
            loaded = load(manifest)
        except CheckpointError as e:
            refused.append(str(e))
            warnings.warn(f"{e}; refusing it", stacklevel=2)
            continue
        loaded.refused = refused
        return loaded
    why = f" ({len(refused)} refused; newest: {refused[0]})" if refused else ""
    raise CheckpointError(f"checkpoint directory {d}: no loadable checkpoint{why}")
