"""Driver side of a drafter hot-swap: check a weights file against the serving drafter, then send it.

A failed collective_rpc kills the engine (`EngineDeadError`), so nothing goes to the workers
until the file has been read here and matched, name for name, dtype and shape, against the
drafter the engine was started with (its folder's `model.safetensors`, which the folder's
config.json describes). The worker checks again before touching the model (drafter_reload.py).
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from tlt_verl.rollout.engine.drafter_reload import check_tensors

# safetensors header dtype -> torch dtype name
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
           "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
# Modules the drafter takes from the target: a push carrying them would overwrite the target's.
TARGET_OWNED = ("embed_tokens.weight", "lm_head.weight")


def read_header(path: str | Path) -> dict[str, list]:
    """{name: [dtype, shape]} from a safetensors file, its layout checked against its size."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if not 0 < n <= size - 8:
                raise ValueError(f"header length {n} does not fit a {size}-byte file")
            header = json.loads(f.read(n))
    except (OSError, struct.error, UnicodeDecodeError, json.JSONDecodeError, ValueError) as e:
        raise ValueError(f"drafter weights {path}: not a safetensors file ({e})") from None
    header.pop("__metadata__", None)
    out, end = {}, 0
    for name, info in header.items():
        dtype = _DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise ValueError(f"drafter weights {path}: {name} has unknown dtype {info.get('dtype')!r}")
        out[name] = [dtype, list(info["shape"])]
        end = max(end, info["data_offsets"][1])
    if 8 + n + end != size:
        raise ValueError(f"drafter weights {path}: {size} bytes, header describes {8 + n + end} (truncated?)")
    return out


@dataclass(frozen=True)
class DrafterManifest:
    """What the serving drafter's weights file holds: {name: [dtype, shape]}."""
    tensors: dict

    @classmethod
    def from_folder(cls, folder: str | Path) -> "DrafterManifest":
        folder = Path(folder)
        if not (folder / "config.json").is_file():
            raise ValueError(f"drafter {folder}: no config.json")
        cfg = json.loads((folder / "config.json").read_text())
        tensors = read_header(folder / "model.safetensors")
        fc = tensors.get("fc.weight")
        if fc is None or fc[1][0] != cfg.get("hidden_size"):
            raise ValueError(f"drafter {folder}: fc.weight {fc and fc[1]} does not match "
                             f"hidden_size={cfg.get('hidden_size')} in its config.json")
        return cls(tensors)

    def check(self, path: str | Path) -> None:
        """Raise a one-line ValueError unless `path` can replace the serving drafter's weights."""
        header = read_header(path)
        owned = [n for n in header if n in TARGET_OWNED and n not in self.tensors]
        if owned:
            raise ValueError(f"drafter weights {path}: carries {owned}, which the drafter shares with the target")
        stub = {name: torch.empty(0) for name in header}
        problem = check_tensors(stub, self.tensors) if set(header) != set(self.tensors) else None
        if problem is None:
            for name, (dtype, shape) in self.tensors.items():
                if header[name] != [dtype, shape]:
                    problem = f"{name}: {header[name][0]} {header[name][1]}, the serving drafter has {dtype} {shape}"
                    break
        if problem is None:
            try:
                problem = check_tensors(load_file(str(path)), self.tensors)
            except Exception as e:  # noqa: BLE001 - any unreadable file is the same one-line refusal
                problem = f"unreadable ({type(e).__name__}: {e})"
        if problem is not None:
            raise ValueError(f"drafter weights {path}: {problem}")


def _result(results: list, path) -> str:
    for r in results:
        if not r.get("ok"):
            raise ValueError(f"drafter weights {path}: refused by the engine: {r.get('error')}")
    return results[0]["sha256"]


def push_drafter(llm, manifest: DrafterManifest, path: str | Path) -> str:
    """Validate `path`, load it into a running `vllm.LLM`'s drafter; the sha256 of what it serves."""
    manifest.check(path)
    return _result(llm.collective_rpc("tlt_reload_drafter_weights", args=(str(path), manifest.tensors)), path)


async def push_drafter_async(engine, manifest: DrafterManifest, path: str | Path) -> str:
    """The same for an `AsyncLLM` (the rollout server's engine)."""
    manifest.check(path)
    return _result(await engine.collective_rpc("tlt_reload_drafter_weights",
                                               args=(str(path), manifest.tensors)), path)
