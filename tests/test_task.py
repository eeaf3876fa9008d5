"""Tests for the synthetic long-tail task (generator, reward, tokenizer, parquet, prepare caching).

No SFT training happens here; prepare's caching is tested with a stand-in trainer.
"""
import json
import random
import statistics
import time

import pandas as pd
import pytest

from tlt_verl.task import longtail, prepare as prepare_mod, reward, sft, tiny_model, tokenizer as tok_mod
from tlt_verl.task.longtail import generate_problems, make_problem, read_rows, sample_num_steps, write_parquet
from tlt_verl.task.reward import compute_score

N_SAMPLES = 4000
SEED = 20240611


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    return tok_mod.build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def problems():
    return list(generate_problems(N_SAMPLES, SEED))


def _quantile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# --- generator -------------------------------------------------------------------------------


def test_step_distribution_is_a_power_law_body_with_a_rare_long_tail():
    probs = longtail.step_probabilities()
    body, tail = longtail.BODY_MAX_STEPS, longtail.TAIL_MIN_STEPS
    assert len(probs) == longtail.MAX_STEPS == 64
    assert sum(probs) == pytest.approx(1.0)
    assert all(a > b for a, b in zip(probs[:body], probs[1:body])), "the body must decrease with the step count"
    assert sum(probs[body:tail - 1]) == 0, "a gap separates the body from the tail"
    assert sum(probs[tail - 1:]) == pytest.approx(longtail.TAIL_PROB)
    assert probs[-1] > 0, "64 steps must be reachable"


def test_step_counts_are_heavy_tailed(problems):
    steps = [p.num_steps for p in problems]
    assert 2 <= statistics.median(steps) <= 4
    assert 0.05 <= sum(k >= 16 for k in steps) / len(steps) <= 0.10
    assert 1 <= min(steps) and max(steps) <= 64
    assert max(steps) >= 40, "a few thousand samples should reach deep into the tail"


def test_sampling_is_deterministic():
    a = [sample_num_steps(random.Random(7)) for _ in range(3)]
    b = [sample_num_steps(random.Random(7)) for _ in range(3)]
    assert a == b
    assert [p.prompt for p in generate_problems(20, 3)] == [p.prompt for p in generate_problems(20, 3)]


def test_response_token_lengths_are_heavy_tailed(problems, hf_tokenizer):
    lengths = [len(hf_tokenizer.encode(p.solution + tok_mod.IM_END, add_special_tokens=False)) for p in problems]
    p50, p90 = _quantile(lengths, 0.5), _quantile(lengths, 0.9)
    assert p90 / p50 >= 3
    assert 10 <= max(lengths) / p50 <= 30
    longest = make_problem(random.Random(0), num_steps=64)
    assert 10 <= len(hf_tokenizer.encode(longest.solution, add_special_tokens=False)) / p50 <= 30


def test_problem_is_consistent_and_in_range(problems):
    for p in problems[:500]:
        lines = p.solution.split("\n")
        assert len(lines) == p.num_steps + 1
        assert lines[-1] == f"Answer: {p.answer}"
        assert p.prompt.startswith(f"Start at {p.start}. ") and p.prompt.endswith("Give the final value.")
        value = p.start
        for i, (line, op) in enumerate(zip(lines, p.operands), 1):
            assert 1 <= abs(op) <= 9
            assert f"{i}: {op:+d}" in p.prompt
            new = value + op
            assert 0 <= new <= 99
            assert line == f"{i}: {op:+d} {value}{op:+d}={new}"
            value = new
        assert value == p.answer


def test_make_problem_fixed_steps_and_bounds():
    p = make_problem(random.Random(1), num_steps=5)
    assert p.num_steps == 5 and p.solution.count("\n") == 5
    with pytest.raises(ValueError):
        make_problem(random.Random(1), num_steps=65)
    with pytest.raises(ValueError):
        make_problem(random.Random(1), num_steps=0)


# --- reward ----------------------------------------------------------------------------------

SCRATCH = "1: +5 37+5=42\n2: -3 42-3=39\n"


@pytest.mark.parametrize(
    "response",
    [
        SCRATCH + "Answer: 39",
        SCRATCH + "Answer: 39<|im_end|>",
        SCRATCH + "Answer: 39\n",
        SCRATCH + "Answer: 39 <|im_end|>\n",
        SCRATCH + "Answer: 39<|im_end|><|endoftext|>",
        "Answer:39",
    ],
)
def test_reward_correct(response):
    out = compute_score("tlt_longtail", response, "39")
    assert (out["score"], out["acc"], out["format_ok"]) == (1.0, 1.0, 1.0)


@pytest.mark.parametrize(
    ("response", "truth", "steps_ok"),
    [
        (SCRATCH + "Answer: 40", "39", 2 / 2),  # both worked lines right, final line wrong
        (SCRATCH + "Answer: 3<|im_end|>", "39", 2 / 2),
        ("1: +5 37+5=43\n2: -3 43-3=40\nAnswer: 40", "39", 1 / 2),  # arithmetic slip in line 1
        ("1: +5 37+5=42\n2: -3 41-3=38\nAnswer: 38", "39", 1 / 2),  # line 2 does not chain
        ("1: +5 37+5=42\n3: -3 42-3=39\nAnswer: 40", "39", 1 / 2),  # misnumbered
        ("1: +5 37+5=42\nAnswer: 42", "39", 1 / 2),  # a step skipped (2 expected)
        ("Answer: 0", 7, 0.0),
    ],
)
def test_reward_wrong_gets_partial_credit_for_right_lines(response, truth, steps_ok):
    out = compute_score("tlt_longtail", response, truth, extra_info={"num_steps": 2})
    assert (out["acc"], out["format_ok"]) == (0.0, 1.0)
    assert out["step_acc"] == pytest.approx(steps_ok)
    assert out["score"] == pytest.approx(reward.WRONG_SCORE + reward.PARTIAL_CREDIT * steps_ok)
    assert out["score"] < reward.CORRECT_SCORE


@pytest.mark.parametrize(
    "response",
    [
        "",
        "<|im_end|>",
        SCRATCH,  # truncated before the answer
        SCRATCH + "Answer:",
        SCRATCH + "Answer: 39x",
        SCRATCH + "Answer: 39\n3: +1 39+1=40",  # kept going after answering
        SCRATCH + "The answer is 39",
    ],
)
def test_reward_malformed(response):
    assert compute_score("tlt_longtail", response, "39") == {"score": -1.0, "acc": 0.0, "format_ok": 0.0}


def test_reward_constants_and_bad_truth():
    assert (reward.CORRECT_SCORE, reward.WRONG_SCORE, reward.MALFORMED_SCORE) == (1.0, 0.0, -1.0)
    assert compute_score("x", "Answer: 5", "5", extra_info={"index": 1}, unused=True)["score"] == 1.0
    with pytest.raises(ValueError, match="ground_truth"):
        compute_score("tlt_longtail", "Answer: 5", "five")


def test_reward_on_generated_solutions(problems):
    for p in problems[:200]:
        assert compute_score(longtail.DATA_SOURCE, p.solution, str(p.answer))["score"] == 1.0
        wrong = compute_score(longtail.DATA_SOURCE, p.solution, str(p.answer + 1), extra_info={"num_steps": p.num_steps})
        assert wrong["acc"] == 0.0 and wrong["step_acc"] == 1.0


# --- tokenizer -------------------------------------------------------------------------------


def test_tokenizer_loads_as_qwen2(hf_tokenizer, tmp_path):
    from transformers import AutoTokenizer

    hf_tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert type(loaded).__name__ == "Qwen2Tokenizer"
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] == "Qwen2Tokenizer"
    assert loaded.eos_token == "<|im_end|>" and loaded.pad_token == "<|endoftext|>"
    assert loaded.eos_token_id != loaded.pad_token_id
    assert 256 < len(loaded) <= tok_mod.TARGET_VOCAB_SIZE


def test_tokenizer_round_trip_and_single_tokens(hf_tokenizer, problems):
    for p in problems[:200]:
        text = sft.prompt_text(p.prompt) + p.solution + tok_mod.IM_END
        ids = hf_tokenizer.encode(text, add_special_tokens=False)
        assert hf_tokenizer.decode(ids) == text
    assert len(hf_tokenizer.encode("\n", add_special_tokens=False)) == 1
    assert len(hf_tokenizer.encode("1234567890", add_special_tokens=False)) == 10
    for special in tok_mod.SPECIAL_TOKENS:
        assert len(hf_tokenizer.encode(special, add_special_tokens=False)) == 1
    assert hf_tokenizer.decode(hf_tokenizer.encode("héllo wörld ✓", add_special_tokens=False)) == "héllo wörld ✓"


def test_chat_template(hf_tokenizer):
    messages = [{"role": "user", "content": "Start at 3. Apply the steps in order. 1: +2 Give the final value."}]
    text = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == sft.prompt_text(messages[0]["content"])
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    ids = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids == hf_tokenizer.encode(text, add_special_tokens=False)


# --- parquet ---------------------------------------------------------------------------------


def test_parquet_rows_are_in_verl_format(tmp_path):
    path = write_parquet(tmp_path / "train.parquet", n=50, seed=5, split="train")
    rows = read_rows(path)
    assert len(rows) == 50
    expected = list(generate_problems(50, 5))
    for i, (row, p) in enumerate(zip(rows, expected)):
        assert row["data_source"] == longtail.DATA_SOURCE
        assert row["prompt"] == [{"role": "user", "content": p.prompt}]
        assert row["ability"] == "arithmetic"
        assert row["reward_model"] == {"style": "rule", "ground_truth": str(p.answer)}
        assert row["extra_info"] == {"split": "train", "index": i, "num_steps": p.num_steps}
    assert list(pd.read_parquet(path).columns) == list(longtail.REQUIRED_COLUMNS)


def _write_rows(path, rows):
    pd.DataFrame(rows).to_parquet(path, index=False)
    return path


@pytest.mark.parametrize(
    ("column", "bad_value"),
    [
        ("prompt", []),
        ("prompt", [{"role": "user"}]),
        ("reward_model", {"style": "rule", "ground_truth": "forty"}),
        ("data_source", ""),
        ("extra_info", None),
    ],
)
def test_malformed_row_names_file_row_and_column(tmp_path, column, bad_value):
    rows = [longtail.to_row(p, "train", i) for i, p in enumerate(generate_problems(6, 1))]
    rows[4][column] = bad_value
    path = _write_rows(tmp_path / "bad.parquet", rows)
    with pytest.raises(ValueError) as info:
        read_rows(path)
    message = str(info.value)
    assert str(path) in message and "row 4" in message and f"'{column}'" in message
    assert "\n" not in message


def test_missing_column_and_unreadable_file(tmp_path):
    rows = [longtail.to_row(p, "train", i) for i, p in enumerate(generate_problems(3, 1))]
    for row in rows:
        del row["reward_model"]
    path = _write_rows(tmp_path / "nocol.parquet", rows)
    with pytest.raises(ValueError, match=r"nocol\.parquet: row 0: missing column 'reward_model'"):
        read_rows(path)
    junk = tmp_path / "junk.parquet"
    junk.write_text("not parquet")
    with pytest.raises(ValueError, match="junk.parquet: cannot read as parquet") as info:
        read_rows(junk)
    assert "\n" not in str(info.value)


# --- model and SFT data ------------------------------------------------------------------------


def test_tiny_model_config(hf_tokenizer):
    spec = tiny_model.TinyModelSpec()
    config = tiny_model.tiny_qwen2_config(hf_tokenizer, spec)
    assert config.model_type == "qwen2"
    assert config.hidden_size // config.num_attention_heads in (32, 64)
    assert config.vocab_size >= len(hf_tokenizer) and config.vocab_size % 64 == 0
    assert config.tie_word_embeddings is False and config.max_position_embeddings == 2048
    assert config.eos_token_id == hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    with pytest.raises(ValueError, match="head_dim"):
        tiny_model.tiny_qwen2_config(hf_tokenizer, tiny_model.TinyModelSpec(num_attention_heads=1))


def test_sft_labels_cover_response_and_im_end(hf_tokenizer):
    examples = sft.encode_examples(hf_tokenizer, list(generate_problems(40, 3)))
    batches = sft.make_batches(examples, tokens_per_batch=512, rng=random.Random(0))
    assert sorted(i for b in batches for i in b) == list(range(40))
    input_ids, labels, attention = sft.collate(examples, batches[0], hf_tokenizer.pad_token_id)
    im_end = hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    for row, i in enumerate(batches[0]):
        ids, prompt_len = examples[i]
        assert (labels[row, :prompt_len] == sft.IGNORE_INDEX).all()
        assert labels[row, prompt_len : len(ids)].tolist() == ids[prompt_len:]
        assert ids[-1] == im_end and attention[row].sum() == len(ids)
        assert hf_tokenizer.decode(ids[prompt_len:]).startswith("1: ")


def test_slipped_demonstrations_carry_the_wrong_value_on():
    p = make_problem(random.Random(5), num_steps=6)
    text, value = longtail.worked_solution(p.start, p.operands, slips={3})
    assert value != p.answer and text.endswith(f"Answer: {value}")
    lines = text.split("\n")[:-1]
    assert lines[:2] == p.solution.split("\n")[:2] and lines[2] != p.solution.split("\n")[2]
    # The slipped line is the one line the reward's partial credit refuses; the rest chain on.
    assert reward.step_accuracy(text, p.num_steps) == pytest.approx(5 / 6)
    assert compute_score(longtail.DATA_SOURCE, text, str(p.answer))["acc"] == 0.0
    assert longtail.worked_solution(p.start, p.operands) == (p.solution, p.answer)


def test_noisy_teacher_rates():
    problems = list(generate_problems(3000, 11))
    rng = random.Random(0)
    slipped = sum(sft.demonstration(p, rng, slip_prob=0.08) != p.solution for p in problems)
    expected = sum(1 - 0.92 ** p.num_steps for p in problems)
    sd = sum((1 - 0.92 ** p.num_steps) * 0.92 ** p.num_steps for p in problems) ** 0.5
    assert abs(slipped - expected) < 4 * sd
    texts = [sft.demonstration(p, rng, omit_answer_prob=0.3) for p in problems]
    omitted = [t for t, p in zip(texts, problems) if t != p.solution]
    assert abs(len(omitted) - 900) < 4 * (3000 * 0.3 * 0.7) ** 0.5
    for text, p in zip(texts, problems):
        if text != p.solution:  # the worked lines, without the final answer: malformed for the reward
            assert p.solution.startswith(text + "\nAnswer: ")
            assert compute_score(longtail.DATA_SOURCE, text, str(p.answer))["score"] == reward.MALFORMED_SCORE
    assert all(sft.demonstration(p, rng) == p.solution for p in problems[:200])


def test_teacher_forced_accuracy_counts_argmax_hits(hf_tokenizer):
    import torch

    examples = sft.encode_examples(hf_tokenizer, list(generate_problems(6, 4)))
    _, labels, _ = sft.collate(examples, list(range(6)), hf_tokenizer.pad_token_id)
    vocab = 320

    class Oracle(torch.nn.Module):
        """Predicts every label, except in the rows listed in ``wrong`` (one token off)."""

        def __init__(self, wrong):
            super().__init__()
            self.wrong = wrong

        def forward(self, input_ids, attention_mask):
            nxt = labels[:, 1:].clamp(min=0)
            for row in self.wrong:
                first = int((labels[row, 1:] != sft.IGNORE_INDEX).nonzero()[0])
                nxt[row, first] = (nxt[row, first] + 1) % vocab
            logits = torch.nn.functional.one_hot(nxt, vocab).float()
            return type("Out", (), {"logits": torch.cat([logits, logits[:, -1:]], dim=1)})

    token_acc, exact = sft.teacher_forced_accuracy(Oracle([]), examples, hf_tokenizer.pad_token_id)
    assert (token_acc, exact) == (1.0, 1.0)
    token_acc, exact = sft.teacher_forced_accuracy(Oracle([0, 3]), examples, hf_tokenizer.pad_token_id)
    n_labels = int((labels[:, 1:] != sft.IGNORE_INDEX).sum())
    assert exact == pytest.approx(4 / 6) and token_acc == pytest.approx(1 - 2 / n_labels)


# --- prepare caching (with a stand-in for SFT) -----------------------------------------------------


def test_two_preparers_of_one_folder_build_it_once(tmp_path):
    """Parallel test workers (or two runs started together) preparing the same assets: one builds,
    the other waits for it and finds the artifact up to date."""
    import threading

    builds, results, started = [], [], threading.Event()

    def build(tmp):
        started.set()
        time.sleep(0.5)              # the other preparer arrives while this one builds
        builds.append(tmp)
        (tmp / "weights").write_text("w")
        return {}

    def preparer():
        results.append(prepare_mod.build_stage(tmp_path / "sft_model", {"v": 1}, build)[0])

    first = threading.Thread(target=preparer)
    first.start()
    started.wait(5)
    second = threading.Thread(target=preparer)
    second.start()
    first.join(10), second.join(10)
    assert len(builds) == 1 and sorted(results) == ["built", "cached"]
    assert (tmp_path / "sft_model" / "weights").read_text() == "w"


def test_an_sft_model_stopped_by_its_cap_is_built_again(tmp_path, monkeypatch):
    """A model the wall-clock cap stopped short of max_steps serves the run that built it, but is
    not reused: the next prepare trains it again."""
    runs = []

    def capped_train_sft(tokenizer, out_dir, cfg, spec, log=print):
        runs.append(out_dir)
        (out_dir / "config.json").write_text("{}")
        return {"steps": cfg.max_steps - 1 if len(runs) == 1 else cfg.max_steps}

    monkeypatch.setattr(prepare_mod, "train_sft", capped_train_sft)
    settings = prepare_mod.PrepareSettings(n_train=32, n_val=8)
    first = prepare_mod.prepare(tmp_path, settings=settings, log=lambda *_: None)
    assert first["report"]["model"]["status"] == "built" and (first["model"] / "config.json").exists()
    second = prepare_mod.prepare(tmp_path, settings=settings, log=lambda *_: None)
    assert second["report"]["model"]["status"] == "built" and len(runs) == 2
    third = prepare_mod.prepare(tmp_path, settings=settings, log=lambda *_: None)
    assert third["report"]["model"]["status"] == "cached" and len(runs) == 2


def test_prepare_builds_once_then_caches(tmp_path, monkeypatch):
    calls = []

    def fake_train_sft(tokenizer, out_dir, cfg, spec, log=print):
        calls.append(out_dir)
        (out_dir / "config.json").write_text("{}")
        return {"steps": cfg.max_steps}

    monkeypatch.setattr(prepare_mod, "train_sft", fake_train_sft)
    settings = prepare_mod.PrepareSettings(n_train=32, n_val=8)
    quiet = lambda *_: None

    paths = prepare_mod.prepare(tmp_path, settings=settings, log=quiet)
    assert {s["status"] for s in paths["report"].values()} == {"built"}
    assert len(read_rows(paths["train"])) == 32 and len(read_rows(paths["val"])) == 8
    assert (paths["model"] / "config.json").exists() and len(calls) == 1
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir()), "temporary directories left behind"

    again = prepare_mod.prepare(tmp_path, settings=settings, log=quiet)
    assert {s["status"] for s in again["report"].values()} == {"cached"} and len(calls) == 1

    changed = prepare_mod.PrepareSettings(n_train=32, n_val=8, sft=sft.SFTConfig(max_steps=2))
    third = prepare_mod.prepare(tmp_path, settings=changed, log=quiet)
    statuses = {name: s["status"] for name, s in third["report"].items()}
    assert statuses == {"tokenizer": "cached", "data": "cached", "model": "built"} and len(calls) == 2

    forced = prepare_mod.prepare(tmp_path, force=True, settings=changed, log=quiet)
    assert {s["status"] for s in forced["report"].values()} == {"built"} and len(calls) == 3


def test_sft_schedule_follows_update_count():
    cfg = sft.SFTConfig(max_steps=100, warmup_steps=10, peak_lr=1e-3, min_lr_ratio=0.1)
    assert sft.lr_at(0, 0.0, cfg) == pytest.approx(1e-4)
    assert sft.lr_at(50, 0.0, cfg) == pytest.approx(1e-3)
    assert sft.lr_at(50, 0.5, cfg) == pytest.approx(0.55e-3)
    assert sft.lr_at(50, 1.0, cfg) == pytest.approx(1e-4)
    assert sft.progress(0, cfg) == 0.0
    assert sft.progress(75, cfg) == pytest.approx(0.75)
    assert sft.progress(100, cfg) == 1.0 and sft.progress(150, cfg) == 1.0


def test_stratified_train_order_gives_every_batch_the_same_length_mix(tmp_path):
    n, batch = 256, 16
    path = write_parquet(tmp_path / "train.parquet", n, seed=5, split="train", batch_size=batch)
    rows = read_rows(path)
    problems = list(generate_problems(n, 5))
    # Same problems, each exactly once, each row pointing back at its place in the stream.
    assert sorted(r["extra_info"]["index"] for r in rows) == list(range(n))
    for r in rows:
        assert r["reward_model"]["ground_truth"] == str(problems[r["extra_info"]["index"]].answer)
    steps = [r["extra_info"]["num_steps"] for r in rows]
    batches = [steps[b : b + batch] for b in range(0, n, batch)]
    ranked = sorted(steps)
    # Batch b holds the b-th problem of every length stratum: its i-th shortest problem lies
    # between the i-th stratum's bounds, so no batch is all short or holds two of the longest.
    for lengths in batches:
        for i, k in enumerate(sorted(lengths)):
            assert ranked[i * len(batches)] <= k <= ranked[(i + 1) * len(batches) - 1]
    tails = [sum(k >= longtail.TAIL_MIN_STEPS for k in b) for b in batches]
    assert max(tails) - min(tails) <= 1 and max(tails) >= 1, tails
    # Batches without a tail problem (fewer tail problems than batches) come last.
    has_tail = [t > 0 for t in tails]
    assert has_tail == sorted(has_tail, reverse=True) and has_tail[0], tails
    # Unstratified order (the default) keeps the generated stream.
    plain = read_rows(write_parquet(tmp_path / "plain.parquet", n, seed=5, split="train"))
    assert [r["extra_info"]["index"] for r in plain] == list(range(n))


def test_deeper_targets_get_their_own_assets_and_sft_budget():
    default = prepare_mod.PrepareSettings()
    assert prepare_mod.settings_for_layers(None) == default
    assert prepare_mod.settings_for_layers(default.model.num_hidden_layers) == default
    deep = prepare_mod.settings_for_layers(16)
    assert deep.model.num_hidden_layers == 16 and deep.model.hidden_size == default.model.hidden_size
    assert deep.sft.budget_s == 16 * prepare_mod.SFT_BUDGET_S_PER_LAYER > default.sft.budget_s
    assert deep.sft.max_steps == default.sft.max_steps  # the same recipe, only deeper
    stages = prepare_mod._stage_settings
    assert stages(deep)["model"] != stages(default)["model"] and stages(deep)["data"] == stages(default)["data"]
    assert prepare_mod.assets_dirname(None) == prepare_mod.assets_dirname(4) == "assets"
    assert prepare_mod.assets_dirname(16) == "assets_L16"
    with pytest.raises(ValueError, match="layers=0"):
        prepare_mod.settings_for_layers(0)


def test_prepare_cli_refuses_a_bad_depth_in_one_line():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "tlt_verl.cli", "prepare", "--layers", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and out.stderr.strip() == "tlt-verl: prepare --layers=0: must be >= 1"


def test_warm_drafter_is_built_once_per_sft_model(tmp_path):
    from tlt_verl.task import warm_drafter

    with pytest.raises(ValueError, match="no finished SFT model"):
        warm_drafter.prepare_warm_drafter(tmp_path)
    # A finished SFT model and a warm drafter stamped for it: reused as it is, nothing trains.
    model, drafter = tmp_path / "sft_model", tmp_path / warm_drafter.DIRNAME
    stamp = {"hash": "m1", "elapsed_s": 1.0}
    model.mkdir()
    (model / prepare_mod.STAMP_NAME).write_text(json.dumps(stamp))
    settings = warm_drafter.settings_for(stamp)
    drafter.mkdir()
    full = warm_drafter.SETTINGS["max_steps"]
    (drafter / prepare_mod.STAMP_NAME).write_text(json.dumps({"hash": prepare_mod._hash(settings), "elapsed_s": 180.0,
                                                              "info": {"steps": full}}))
    said = []
    assert warm_drafter.is_current(tmp_path)
    assert warm_drafter.prepare_warm_drafter(tmp_path, log=said.append) == drafter
    assert "up to date" in said[0]
    # One its time cap stopped short of its steps is built again (and fails here, on the stand-in).
    (drafter / prepare_mod.STAMP_NAME).write_text(json.dumps({"hash": prepare_mod._hash(settings), "elapsed_s": 600.0,
                                                              "info": {"steps": full - 1}}))
    assert not warm_drafter.is_current(tmp_path)
    said.clear()
    with pytest.raises(Exception):
        warm_drafter.prepare_warm_drafter(tmp_path, log=said.append)
    assert "building" in said[-1]
    # A new SFT model makes it stale, and so does the same settings' model trained again (another
    # build: other weights): the build starts (and fails here on the stand-in model, leaving the
    # cached folder as it was: the build is atomic).
    for new_model in ({**stamp, "hash": "m2"}, {**stamp, "elapsed_s": 2.0}):
        (model / prepare_mod.STAMP_NAME).write_text(json.dumps(new_model))
        said.clear()
        with pytest.raises(Exception):
            warm_drafter.prepare_warm_drafter(tmp_path, log=said.append)
        assert "building" in said[-1] and (drafter / prepare_mod.STAMP_NAME).is_file()


def test_sft_threads_and_cap_are_not_part_of_the_models_cache_key():
    """The test session builds the assets in the background on one thread with a looser cap
    (tests/conftest.py); what it builds must be what `./tlt run` finds up to date."""
    from dataclasses import replace

    base = prepare_mod.PrepareSettings()
    key = lambda s: prepare_mod._hash(prepare_mod._stage_settings(s)["model"])  # noqa: E731
    assert key(replace(base, sft=replace(base.sft, threads=1, budget_s=3600.0))) == key(base)
    assert key(replace(base, sft=replace(base.sft, max_steps=base.sft.max_steps - 1))) != key(base)
