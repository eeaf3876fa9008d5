"""Benchmarks: each writes a JSON (and a PNG) of ratios measured side by side in one run."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# Settings that only say where scratch files went: meaningless on another machine.
SCRATCH_KEYS = ("work", "run_dir", "phase_out", "phase", "spec", "out")


def portable(value: Any) -> Any:
    """A path as the result file should record it: repo-relative, or a model folder by name and
    weights checksum, never this machine's absolute path."""
    if not isinstance(value, (str, Path)) or not os.path.isabs(str(value)):
        return value
    p = Path(value).resolve()
    if p.is_relative_to(REPO):
        return str(p.relative_to(REPO))
    weights = p / "model.safetensors"
    if weights.is_file():
        return {"folder": p.name, "sha256": hashlib.sha256(weights.read_bytes()).hexdigest()}
    return p.name


def portable_settings(settings: dict) -> dict:
    return {k: portable(v) for k, v in settings.items() if k not in SCRATCH_KEYS}
