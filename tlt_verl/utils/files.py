"""Small file helpers shared by components that must agree on them (checkpoints, weight pushes,
assets, exports)."""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")


def sha256_file(path: str | Path, chunk_bytes: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks so multi-GB weight files need no extra memory."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(chunk_bytes), b""):
            h.update(chunk)
    return h.hexdigest()


def build_dir_atomically(target: str | Path, build: Callable[[Path], T]) -> T:
    """Run ``build(tmp)`` on a fresh temporary directory beside ``target`` and move the finished
    directory to ``target`` in one rename (an existing ``target`` is replaced): a reader sees the
    old directory or the new one, never a half-written one; a failed build leaves nothing."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    old = target.parent / f".{target.name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        out = build(tmp)
        if target.exists():
            target.rename(old)
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return out
