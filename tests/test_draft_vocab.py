"""An EAGLE-3 drafter over a reduced vocabulary (`./tlt drafter warmup --draft-vocab N`): the
vocabulary is the responses' most frequent tokens and its coverage is what an independent count
says; a bad value is refused in one line before any weights load; and a warm-up on the toy target
with 64 of its 320 tokens exports a drafter whose d2t map vLLM loads, drafting only mapped tokens
(the draft ids are read off the engine's own proposer)."""
from __future__ import annotations

import json
import random
import shutil
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _subproc import child_main, run_in_subprocess  # noqa: E402

from tlt_verl.drafter.draft_vocab import (AUTO_SIZE, coverage_curve, parse_draft_vocab, resolve_draft_vocab,
                                          token_counts)

REDUCED = 64
K = 3


def _tiny_config():
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def _zipf_responses(n: int, vocab: int, seed: int) -> list[list[int]]:
    weights = [1 / (r + 1) for r in range(vocab)]
    ids = list(range(vocab))
    # One ranking for every split; frequency must not follow id order, or "lowest ids" would pass too.
    random.Random(0).shuffle(ids)
    rng = random.Random(seed)
    return [rng.choices(ids, weights, k=rng.randint(1, 40)) for _ in range(n)]


def _top(counter: Counter, n: int, vocab: int = 320) -> set[int]:
    # Most frequent first, ties (unseen tokens among them) to the lower id: the choice written
    # down independently.
    return set(sorted(range(vocab), key=lambda t: (-counter.get(t, 0), t))[:n])


def _covered(counter: Counter, chosen: set[int]) -> float:
    return sum(c for t, c in counter.items() if t in chosen) / sum(counter.values())


def test_vocabulary_is_the_most_frequent_tokens_and_coverage_matches_a_count():
    from tlt_verl.drafter import DrafterConfig, build_drafter
    from tlt_verl.drafter.warmup import draft_vocab_report

    tc = _tiny_config()
    torch.manual_seed(0)
    embed, head = torch.randn(tc.vocab_size, tc.hidden_size), torch.randn(tc.vocab_size, tc.hidden_size)
    drafter = build_drafter(DrafterConfig.from_target(tc, kind="eagle3", draft_vocab_size=REDUCED), embed, head)
    train, heldout = _zipf_responses(200, tc.vocab_size, 1), _zipf_responses(50, tc.vocab_size, 2)
    report = draft_vocab_report(drafter, train, heldout, choose=True)

    train_c, held_c = Counter(t for r in train for t in r), Counter(t for r in heldout for t in r)
    chosen = _top(train_c, REDUCED)
    assert set(drafter.draft_to_target.tolist()) == chosen
    assert torch.equal(torch.nonzero(drafter.t2d).flatten(), drafter.draft_to_target)
    # The head starts from the target's rows for exactly those tokens.
    assert torch.equal(drafter.lm_head.weight, head[drafter.draft_to_target])
    assert report["draft_vocab_size"] == REDUCED
    assert report["draft_vocab_coverage"] == pytest.approx(_covered(train_c, chosen), abs=1e-12)
    assert report["draft_vocab_coverage_heldout"] == pytest.approx(_covered(held_c, chosen), abs=1e-12)
    assert report["distinct_response_tokens"] == len(train_c)
    assert report["response_tokens"] == sum(train_c.values())
    assert 0.3 < report["draft_vocab_coverage_heldout"] < report["draft_vocab_coverage"] < 1

    curve = coverage_curve(token_counts(train, tc.vocab_size), token_counts(heldout, tc.vocab_size), (16, 64, 320))
    assert curve[64] == pytest.approx(_covered(held_c, chosen), abs=1e-12)
    assert curve[16] == pytest.approx(_covered(held_c, _top(train_c, 16)), abs=1e-12)
    assert 320 not in curve   # a size as large as the vocabulary is no reduction


def test_auto_keeps_a_small_vocabulary_whole_and_reduces_a_large_one():
    assert resolve_draft_vocab("auto", 320, "eagle3") is None            # the toy: unchanged
    assert resolve_draft_vocab("auto", 49152, "eagle3") == AUTO_SIZE
    assert resolve_draft_vocab(64, 320, "eagle3") == 64
    assert resolve_draft_vocab(320, 320, "eagle3") is None
    assert resolve_draft_vocab("auto", 49152, "eagle") is None
    assert parse_draft_vocab("auto") == "auto" and parse_draft_vocab("64") == 64


@pytest.fixture(scope="module")
def config_only_target(tmp_path_factory) -> Path:
    """The toy's tokenizer (trained on few problems) and model config, no weights: a refusal must
    come before any weights load."""
    from tlt_verl.task.tiny_model import tiny_qwen2_config
    from tlt_verl.task.tokenizer import build_tokenizer, training_corpus

    folder = tmp_path_factory.mktemp("target")
    tok = build_tokenizer(folder, corpus=training_corpus(300))
    tiny_qwen2_config(tok).save_pretrained(folder)
    return folder


BAD = {
    ("abc", "eagle3"): "--draft-vocab abc: must be 'auto' or a token count >= 1",
    ("0", "eagle3"): "--draft-vocab 0: must be 'auto' or a token count >= 1",
    ("-5", "eagle3"): "--draft-vocab -5: must be 'auto' or a token count >= 1",
    ("100000", "eagle3"): "--draft-vocab 100000: more than the target's vocabulary (",
    ("64", "eagle"): "--draft-vocab 64: only with --kind eagle3",
}


@pytest.mark.parametrize("value,kind", list(BAD))
def test_bad_draft_vocab_refused_in_one_line(value, kind, config_only_target, tmp_path, capsys):
    from tlt_verl.cli import main

    out = tmp_path / "d"
    argv = ["drafter", "warmup", "--target", str(config_only_target), "--out", str(out), "--kind", kind,
            f"--draft-vocab={value}"]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"tlt-verl: {BAD[value, kind]}"), err
    assert not out.exists()


# ---------------------------------------------------------------------------- engine side

def _engine(spec: dict) -> dict:
    """One engine with the drafter; every draft its proposer returns is recorded in the worker."""
    from vllm import SamplingParams

    from tlt_verl.rollout.engine.offline import offline_llm
    from tlt_verl.rollout.engine.spec_metrics import mean_acceptance_length, spec_decode_counters

    llm = offline_llm(spec["target"], speculative_config={"method": "eagle3", "model": spec["drafter"],
                                                          "num_speculative_tokens": K},
                      skip_tokenizer_init=True, max_model_len=512, max_num_seqs=8)

    def record(worker):
        proposer = worker.model_runner.drafter
        seen = proposer._tlt_test_drafts = []
        original = proposer.propose

        def propose(*args, **kwargs):
            out = original(*args, **kwargs)
            ids = out[0] if isinstance(out, tuple) else out
            seen.extend(torch.as_tensor(ids).flatten().tolist())
            return out

        proposer.propose = propose
        model = proposer.model
        return None if model.draft_id_to_target_id is None else model.draft_id_to_target_id.tolist()

    def drafts(worker):
        return worker.model_runner.drafter._tlt_test_drafts

    try:
        (loaded_d2t,) = llm.collective_rpc(record)
        res = {"loaded_d2t": loaded_d2t}
        for name, params in (("T0", SamplingParams(temperature=0, max_tokens=96, detokenize=False)),
                             ("T1", SamplingParams(temperature=1.0, top_k=0, max_tokens=96, detokenize=False))):
            llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params, use_tqdm=False)
        res["drafts"] = llm.collective_rpc(drafts)[0]
        res["acceptance_length"] = mean_acceptance_length(spec_decode_counters(llm.get_metrics()))
        return res
    finally:
        llm.llm_engine.engine_core.shutdown()


@pytest.mark.slow
def test_reduced_vocab_warmup_serves_in_vllm_drafting_only_mapped_tokens(assets, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tlt_verl.drafter.config import LossConfig
    from tlt_verl.drafter.trainer import TrainerConfig
    from tlt_verl.drafter.warmup import WarmupConfig, generate_hf, run_warmup, task_prompts

    target = str(shutil.copytree(assets["model"], tmp_path / "target"))
    trainer = TrainerConfig(lr=1e-2, warmup_steps=5, total_steps=60, tokens_per_micro=2048, row_len=256,
                            loss=LossConfig(prob_weight=1.0))
    cfg = WarmupConfig(target=target, out=str(tmp_path / "drafter"), kind="eagle3", draft_vocab=REDUCED,
                       budget_s=8.0, num_prompts=32, max_new_tokens=160, generator="hf", gen_batch=32,
                       eval_fraction=0.0, trainer=trainer)
    report = run_warmup(cfg, log=lambda msg: None)
    saved = json.loads((tmp_path / "drafter" / "warmup_report.json").read_text())
    for key in ("draft_vocab_size", "draft_vocab_coverage", "trainer_tokens_per_s", "warmup_seconds"):
        assert saved[key] == report[key], key
    assert saved["draft_vocab_size"] == REDUCED and saved["trainer_tokens_per_s"] > 0
    assert 0 < saved["warmup_seconds"] and saved["training"]["tokens"] > 0

    # An independent count: the same (seeded) responses again, counted here.
    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    responses = generate_hf(model, tok, task_prompts(tok, cfg.num_prompts, cfg.prompt_seed), cfg)
    counts = Counter(t for r in responses for t in r)
    chosen = _top(counts, REDUCED, model.config.vocab_size)
    assert saved["draft_vocab_coverage"] == pytest.approx(_covered(counts, chosen), abs=1e-9)

    folder = tmp_path / "drafter"
    assert json.loads((folder / "config.json").read_text())["draft_vocab_size"] == REDUCED
    d2t = load_file(str(folder / "model.safetensors"))["d2t"]
    mapped = set((torch.arange(REDUCED) + d2t).tolist())
    assert mapped == chosen

    spec = {"target": target, "drafter": str(folder),
            "prompts": task_prompts(tok, 8, 2)}   # the val split's seed: not the warm-up's prompts
    res = run_in_subprocess(__file__, spec, tmp_path / "engine", timeout=600)
    assert res["loaded_d2t"] == d2t.tolist()        # vLLM read the map, not a default
    assert len(res["drafts"]) > 100
    assert set(res["drafts"]) <= mapped, sorted(set(res["drafts"]) - mapped)[:10]
    assert res["acceptance_length"] > 1.0           # drafts are accepted, not only proposed
    print(f"\n[draft_vocab] {len(res['drafts'])} draft tokens, {len(set(res['drafts']))} distinct, all among the "
          f"{REDUCED} mapped; coverage {saved['draft_vocab_coverage']:.4f}; acceptance length "
          f"{res['acceptance_length']:.2f}")


if __name__ == "__main__":
    child_main(_engine)
