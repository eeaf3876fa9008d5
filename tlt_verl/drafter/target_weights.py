"""The two target tensors a drafter shares (token embedding, LM head), read from an HF folder
without loading the rest of the model: a drafter service starts inside an actor process that
already holds the model once, sharded, and must not hold a second full copy."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

# The dtypes a rollout may run the target in, by the names verl's configs and HF's config.json use.
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "half": torch.float16, "float32": torch.float32, "fp32": torch.float32, "float": torch.float32}


def rollout_dtype(name: str | torch.dtype | None, target_config=None) -> torch.dtype:
    """The dtype the target's embedding and LM head are held in by a drafter: the rollout's
    (``name``), else the one the target's config.json names, else fp32."""
    if name is None and target_config is not None:
        name = getattr(target_config, "torch_dtype", None) or getattr(target_config, "dtype", None)
    if name is None:
        return torch.float32
    if isinstance(name, torch.dtype):
        return name
    key = str(name).removeprefix("torch.")
    if key not in DTYPES:
        raise ValueError(f"rollout dtype {name!r}: must be one of {', '.join(DTYPES)}")
    return DTYPES[key]

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"


def _files_holding(folder: Path) -> dict[str, Path]:
    """{tensor name: safetensors file} for the names we read."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return {k: folder / v for k, v in weight_map.items() if k in (EMBED, LM_HEAD)}
    single = folder / "model.safetensors"
    if not single.is_file():
        raise ValueError(f"target {folder}: no model.safetensors or model.safetensors.index.json")
    with safe_open(str(single), framework="pt") as f:
        return {k: single for k in f.keys() if k in (EMBED, LM_HEAD)}


def _checked_files(folder: Path, tie_word_embeddings: bool) -> dict[str, Path]:
    """`_files_holding`, refusing a target without the tensors the drafter reads."""
    where = _files_holding(folder)
    if EMBED not in where:
        raise ValueError(f"target {folder}: no {EMBED} in its safetensors")
    if LM_HEAD not in where and not tie_word_embeddings:
        raise ValueError(f"target {folder}: no {LM_HEAD} in its safetensors and tie_word_embeddings is false")
    return where


def load_target_tensors(folder: str | Path, tie_word_embeddings: bool,
                        dtype: torch.dtype | None = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding, LM head) of the target in ``folder``, as ``dtype`` CPU tensors (None: as
    stored); the same tensor twice when the target ties them."""
    where = _checked_files(Path(folder), tie_word_embeddings)

    def read(name: str) -> torch.Tensor:
        with safe_open(str(where[name]), framework="pt") as f:
            t = f.get_tensor(name)
            return t if dtype is None else t.to(dtype)

    embed = read(EMBED)
    # A tied checkpoint may still store the head; the model would use the embedding regardless.
    head = embed if tie_word_embeddings else read(LM_HEAD)
    return embed, head


def copy_target_tensors(folder: str | Path, tie_word_embeddings: bool, embed_out: torch.Tensor,
                        head_out: torch.Tensor, chunk_bytes: int = 64 << 20) -> None:
    """Read the target's embedding and LM head into ``embed_out`` / ``head_out`` (any dtype and
    device: cast and moved on the way), a few rows at a time: no full-size copy on the host."""
    where = _checked_files(Path(folder), tie_word_embeddings)
    names = ((EMBED, embed_out),) if tie_word_embeddings else ((EMBED, embed_out), (LM_HEAD, head_out))
    for name, out in names:
        with safe_open(str(where[name]), framework="pt") as f:
            part = f.get_slice(name)
            shape = tuple(part.get_shape())
            if shape != tuple(out.shape):
                raise ValueError(f"target {folder}: {name} has shape {shape}, expected {tuple(out.shape)}")
            rows = max(1, chunk_bytes // max(1, shape[1] * 4))
            for a in range(0, shape[0], rows):
                out[a:a + rows].copy_(part[a:a + rows])
