"""The real LM's long-tail chat workload (tlt_verl.task.chat_longtail): deterministic, the kinds in
their shares, and its parquet file what `./tlt drafter warmup --prompts` reads."""
from __future__ import annotations

from collections import Counter

from tlt_verl.drafter.warmup import read_chat_prompts
from tlt_verl.task.chat_longtail import KINDS, generate_conversations, write_parquet


def test_same_seed_same_prompts_and_kind_shares():
    a, b = generate_conversations(2000, 3), generate_conversations(2000, 3)
    assert a == b and a != generate_conversations(2000, 4)
    shares = Counter(kind for kind, _ in a)
    for kind in KINDS:
        assert abs(shares[kind.name] / 2000 - kind.weight) < 0.04, (kind.name, shares)
    assert all(len(m) == 1 and m[0]["role"] == "user" and "{" not in m[0]["content"] for _, m in a)


def test_parquet_is_warmup_input(tmp_path):
    path = write_parquet(tmp_path / "chat.parquet", 24, 0)
    assert read_chat_prompts(path) == [m for _, m in generate_conversations(24, 0)]
