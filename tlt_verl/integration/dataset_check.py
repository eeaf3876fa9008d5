"""Row-level check of an RL parquet file, so that a malformed row is named before verl reads it."""
from __future__ import annotations

from typing import Optional

import pyarrow.parquet as pq


def check_rl_parquet(path: str, prompt_key: str = "prompt") -> Optional[str]:
    """Return a one-line description of the first problem in `path`, or None."""
    try:
        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the user's to fix
        return f"{path} is not a readable parquet file ({type(e).__name__})"
    if prompt_key not in table.column_names:
        return f"{path}: no column {prompt_key!r} (data.prompt_key); columns are {table.column_names}"
    prompts = table.column(prompt_key).to_pylist()
    rm = table.column("reward_model").to_pylist() if "reward_model" in table.column_names else None
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, list) or not prompt:
            return f"{path} row {i}: column {prompt_key!r} must be a non-empty list of chat messages"
        for m in prompt:
            if not isinstance(m, dict) or not isinstance(m.get("content"), str) or not m.get("role"):
                return f"{path} row {i}: column {prompt_key!r} has a message without 'role'/'content'"
        if rm is not None and (not isinstance(rm[i], dict) or rm[i].get("ground_truth") is None):
            return f"{path} row {i}: column 'reward_model' has no 'ground_truth'"
    return None
