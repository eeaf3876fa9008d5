"""The two target tensors a drafter shares (token embedding, LM head), read from an HF folder
without loading the rest of the model: a drafter service starts inside an actor process that
already holds the model once, sharded, and must not hold a second full copy."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

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


def load_target_tensors(folder: str | Path, tie_word_embeddings: bool,
                        dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding, LM head) of the target in ``folder``, as ``dtype`` CPU tensors; the same tensor
    twice when the target ties them."""
    folder = Path(folder)
    where = _files_holding(folder)
    if EMBED not in where:
        raise ValueError(f"target {folder}: no {EMBED} in its safetensors")
    if LM_HEAD not in where and not tie_word_embeddings:
        raise ValueError(f"target {folder}: no {LM_HEAD} in its safetensors and tie_word_embeddings is false")

    def read(name: str) -> torch.Tensor:
        with safe_open(str(where[name]), framework="pt") as f:
            return f.get_tensor(name).to(dtype)

    embed = read(EMBED)
    # A tied checkpoint may still store the head; the model would use the embedding regardless.
    head = embed if tie_word_embeddings else read(LM_HEAD)
    return embed, head
