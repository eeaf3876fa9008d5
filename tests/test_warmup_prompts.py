"""The drafter warm-up's own prompts (`./tlt drafter warmup --prompts FILE.parquet`): verl's dataset
format read, put through the target's chat template, and bad files refused in one line before any
weights load. No engine and no model weights: the target is the toy task's tokenizer beside a
model config."""
from __future__ import annotations

from pathlib import Path

import pytest

from tlt_verl.drafter.warmup import chat_prompts, read_chat_prompts, task_prompts

CONVERSATIONS = [
    [{"role": "system", "content": "Answer in one line."}, {"role": "user", "content": "What is 7 plus 5?"}],
    [{"role": "user", "content": "Start at 3. Add 4, then double it."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
     {"role": "user", "content": "Count to 3."}],
]


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    """The toy task's tokenizer (its recipe, trained on fewer problems: seconds, not minutes) and
    its model's config, without weights."""
    from tlt_verl.task.tiny_model import tiny_qwen2_config
    from tlt_verl.task.tokenizer import build_tokenizer, training_corpus

    folder = tmp_path_factory.mktemp("target")
    tok = build_tokenizer(folder, corpus=training_corpus(300))
    tiny_qwen2_config(tok).save_pretrained(folder)
    return folder


def write_rows(path: Path, rows: list[dict]) -> Path:
    import pandas as pd

    pd.DataFrame(rows).to_parquet(path, index=False)
    return path


def test_chat_template_round_trip(target, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    # Other columns of verl's format ride along, as in a real RL file.
    path = write_rows(tmp_path / "chat.parquet", [{"data_source": "mine", "prompt": c, "extra_info": {"index": i}}
                                                 for i, c in enumerate(CONVERSATIONS)])
    conversations = read_chat_prompts(path)
    assert conversations == CONVERSATIONS
    assert read_chat_prompts(path, limit=2) == CONVERSATIONS[:2]
    ids = chat_prompts(tok, conversations)
    for messages, got in zip(CONVERSATIONS, ids):
        turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        assert tok.decode(got) == turns + "<|im_start|>assistant\n"
    # The task's own RL file read this way gives the very tokens of the default (generated) prompts.
    from tlt_verl.task.longtail import write_parquet

    task_file = write_parquet(tmp_path / "task.parquet", 6, 7, "train")
    assert chat_prompts(tok, read_chat_prompts(task_file)) == task_prompts(tok, 6, 7)


def _empty(path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    pq.write_table(pa.table({"prompt": pa.array([], type=pa.list_(message))}), path)
    return path


def _csv(path: Path) -> Path:
    path.write_text("prompt\nWhat is 2+2?\n")
    return path


BAD_FILES = {
    "missing": (lambda p: p, "no such file"),
    "not parquet": (_csv, "cannot read as parquet: "),
    "no prompt column": (lambda p: write_rows(p, [{"question": "What is 2+2?"}]),
                         "no column 'prompt' (verl's chat messages); its columns: question"),
    "plain text prompts": (lambda p: write_rows(p, [{"prompt": "What is 2+2?"}]),
                           "row 0: column 'prompt' is not chat messages: expected a non-empty list of chat messages, "
                           "got 'What is 2+2?'"),
    "message without content": (lambda p: write_rows(p, [{"prompt": CONVERSATIONS[1]}, {"prompt": [{"role": "user"}]}]),
                                "row 1: column 'prompt' is not chat messages: message 0 must be a dict with string "
                                "'role' and 'content'"),
    "empty conversation": (lambda p: write_rows(p, [{"prompt": []}]),
                           "row 0: column 'prompt' is not chat messages: expected a non-empty list"),
    "no rows": (_empty, "column 'prompt' has no rows"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_prompts_file_refused_in_one_line(case, target, tmp_path, capsys):
    from tlt_verl.cli import main

    make, expect = BAD_FILES[case]
    path = make(tmp_path / "prompts.parquet")
    out = tmp_path / "drafter"
    assert main(["drafter", "warmup", "--target", str(target), "--out", str(out), "--prompts", str(path)]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"tlt-verl: --prompts {path}: {expect}"), err
    assert not out.exists()   # refused before anything was written


def test_num_prompts_only_with_a_file(target, tmp_path, capsys):
    from tlt_verl.cli import main

    args = ["drafter", "warmup", "--target", str(target), "--out", str(tmp_path / "d"), "--prompts", "8",
            "--num-prompts", "4"]
    assert main(args) == 1
    assert capsys.readouterr().err.strip() == ("tlt-verl: --num-prompts: only with --prompts FILE (--prompts 8 is "
                                               "already a count)")
