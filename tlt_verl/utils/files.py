"""Small file helpers shared by components that must agree on them (checkpoints, weight pushes)."""
from __future__ import annotations

import hashlib
from pathlib import Path


def sha256_file(path: str | Path, chunk_bytes: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks so multi-GB weight files need no extra memory."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(chunk_bytes), b""):
            h.update(chunk)
    return h.hexdigest()
