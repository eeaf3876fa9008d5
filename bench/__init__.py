"""Benchmarks: each writes a JSON (and a PNG) of ratios measured side by side in one run."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# Settings that only say where scratch files went: meaningless on another machine.
SCRATCH_KEYS = ("work", "run_dir", "phase_out", "phase", "spec", "out")


# Where benches keep scratch folders inside the repo (ignored by git): a path there names nothing
# another machine has.
SCRATCH_DIR = REPO / ".cache" / "tlt" / "work"


def portable(value: Any) -> Any:
    """A path as the result file should record it: repo-relative, or a model folder by name and
    weights checksum, never this machine's absolute path or scratch folder."""
    if not isinstance(value, (str, Path)) or not str(value):
        return value
    if not os.path.isabs(str(value)) and not (REPO / str(value)).exists():
        return value  # not a path here (a name, a list of sizes)
    p = (REPO / str(value)).resolve()
    if p.is_relative_to(REPO) and not p.is_relative_to(SCRATCH_DIR):
        return str(p.relative_to(REPO))
    weights = p / "model.safetensors"
    if weights.is_file():
        return {"folder": p.name, "sha256": hashlib.sha256(weights.read_bytes()).hexdigest()}
    return p.name


def portable_settings(settings: dict) -> dict:
    return {k: portable(v) for k, v in settings.items() if k not in SCRATCH_KEYS}


def default_prompts(target: str | Path) -> str:
    """"task" for the task's own targets, "chat" (tlt_verl.task.chat_longtail) for a pretrained LM.

    The task's tokenizer is trained on the task's text alone (TARGET_VOCAB_SIZE tokens at most):
    a target with a larger vocabulary is a pretrained LM, to which the task's format means nothing.
    """
    import json

    from tlt_verl.task.tokenizer import TARGET_VOCAB_SIZE

    vocab = json.loads((Path(target) / "config.json").read_text())["vocab_size"]
    return "task" if vocab <= TARGET_VOCAB_SIZE else "chat"


def kv_cache_bytes(target: str | Path, seqs: int, model_len: int) -> int:
    """KV cache that holds ``seqs`` sequences of ``model_len`` tokens of the fp32 target plus a
    one-layer drafter, and never less than the rollout server's CPU default: a real LM's cache
    outgrows that default at a full batch of long responses, and a short cache would preempt
    requests and time the preemptions instead of the decoding."""
    import json

    from tlt_verl.launch.memory_plan import ModelShape
    from tlt_verl.rollout.engine.server import DEFAULT_CPU_KV_CACHE_BYTES

    shape = ModelShape.from_hf_config(json.loads((Path(target) / "config.json").read_text()))
    per_token = shape.kv_bytes_per_token(4, extra_layers=1)
    return max(DEFAULT_CPU_KV_CACHE_BYTES, int(seqs * model_len * per_token * 1.2))
