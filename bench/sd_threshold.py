"""Where speculative decoding stops paying: decode step time with and without SD by running batch.

    .venv/bin/python bench/sd_threshold.py --out bench/results/sd_threshold.json

Target: the project's tiny SFT model (tlt_verl.task.prepare). Drafter: a randomly initialised
EAGLE-1 drafter for it (tlt_verl.drafter, exported in vLLM's layout). Random drafts are almost
never accepted, so this measures the cost side only: how much longer a step gets with k drafts
(drafter forwards + verifying k+1 positions) at each batch size. The benefit side is a model:
with per-token acceptance rate a, a step emits E(k) = (1 - a^(k+1)) / (1 - a) tokens per request,
so SD with k pays at batch b when E(k) * t_plain(b) / t_k(b) > 1. The threshold is the largest
measured batch size up to which some k pays (for every smaller size too).

Two engines: one without SD, one with SD (num_speculative_tokens = max k) whose k is changed at
run time through the engine core (patches/vllm_sd/runtime.py); its k=0 row is "SD configured but
off", which since patches/vllm_sd/catch_up.py runs no drafter (bench/sd_off_cost.py measures it
against plain decoding on its own). Step times are medians of the engine's own per-step records,
decode steps only.

`--drafter DIR` measures an exported (e.g. warmed-up) drafter instead, and `--prompts task` feeds
it task prompts with long worked solutions, so the SD rows' acceptance is real rather than ~0.
`--gpu` runs both engines on CUDA as a GPU rollout would (bf16, CUDA graphs); bench/gpu_check.py
uses it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench import portable, portable_settings  # noqa: E402


def _random_drafter(model_dir: Path, out: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tlt_verl.drafter import DrafterConfig, build_drafter, target_tensors
    from tlt_verl.drafter.export import export_drafter

    cfg = DrafterConfig.from_target(AutoConfig.from_pretrained(model_dir), kind="eagle")
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return export_drafter(build_drafter(cfg, *target_tensors(target)), out, engine="vllm")


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab - 8) for _ in range(length)] for _ in range(n)]


# Task problems whose worked solution runs past the measured tokens: the drafter is then
# measured on the text it was trained on, not on what follows an end-of-sequence token.
MIN_TASK_STEPS = 8


def task_prompt_source(model: Path):
    """``(n, seed) -> n tokenized task prompts`` with long solutions, and the longest prompt."""
    from transformers import AutoTokenizer

    from tlt_verl.task.longtail import generate_problems
    from tlt_verl.task.sft import prompt_text

    tok = AutoTokenizer.from_pretrained(model)
    pool = [p for p in generate_problems(2048, 11) if p.num_steps >= MIN_TASK_STEPS]
    ids = tok([prompt_text(p.prompt) for p in pool], add_special_tokens=False)["input_ids"]

    def make(n: int, seed: int) -> list[list[int]]:
        return [ids[(seed * 97 + i) % len(ids)] for i in range(n)]

    return make, max(map(len, ids))


def _measure(llm, sizes, tokens, prompt_len, vocab, repeats, set_k=None, ks=(None,), make_prompts=None):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from tlt_verl.rollout.engine import sd_control

    sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, detokenize=False)
    rows = []
    for k in ks:
        if set_k is not None:
            set_k(k)
        for b in sizes:
            best = None
            for r in range(repeats):
                ids = make_prompts(b, r) if make_prompts else _prompts(b, prompt_len, vocab, seed=r)
                prompts = [TokensPrompt(prompt_token_ids=p) for p in ids]
                sd_control.take_sd_metrics(llm)
                t = time.perf_counter()
                llm.generate(prompts, sp, use_tqdm=False)
                wall = time.perf_counter() - t
                steps = [m for m in sd_control.take_sd_metrics(llm) if m.prefill_reqs == 0 and m.batch == b]
                step_s = statistics.median(m.step_s for m in steps)
                drafts = sum(m.draft_tokens for m in steps)
                accepted = sum(sum(m.accepted_per_pos) for m in steps)
                row = {"k": k, "batch": b, "wall_tok_s": b * tokens / wall, "decode_step_ms": step_s * 1e3,
                       "decode_steps": len(steps), "draft_tokens": drafts, "accepted": accepted}
                if best is None or row["decode_step_ms"] < best["decode_step_ms"]:
                    best = row
            best["decode_tok_s"] = best["batch"] / (best["decode_step_ms"] / 1e3) * (
                1 + best["accepted"] / max(best["draft_tokens"] / max(best["k"] or 1, 1), 1))
            rows.append(best)
            print(json.dumps({k_: round(v, 2) if isinstance(v, float) else v for k_, v in best.items()}), flush=True)
    return rows


def expected_tokens(k: int, a: float) -> float:
    return (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1.0


def analyse(plain, sd, acceptance_rates) -> dict:
    t_plain = {r["batch"]: r["decode_step_ms"] for r in plain}
    t_sd = {(r["k"], r["batch"]): r["decode_step_ms"] for r in sd}
    sizes = sorted(t_plain)
    ks = sorted({k for k, _ in t_sd if k})
    out = {"break_even_tokens_per_step": {str(b): {str(k): t_sd[k, b] / t_plain[b] for k in ks} for b in sizes},
           "threshold": {}}
    for a in acceptance_rates:
        speedup = {b: max(expected_tokens(k, a) * t_plain[b] / t_sd[k, b] for k in ks) for b in sizes}
        best_k = {b: max(ks, key=lambda k: expected_tokens(k, a) * t_plain[b] / t_sd[k, b]) for b in sizes}
        threshold = 0
        for b in sizes:
            if speedup[b] <= 1:
                break
            threshold = b
        out["threshold"][str(a)] = {"threshold": threshold, "speedup": {str(b): speedup[b] for b in sizes},
                                    "best_k": {str(b): best_k[b] for b in sizes}}
    return out


def measured(plain, sd) -> dict:
    """With a real drafter: each size's best measured SD throughput (acceptance included) over
    plain decoding's, and the largest size up to which SD pays at every size."""
    t_plain = {r["batch"]: r["decode_tok_s"] for r in plain}
    best = {}
    for r in sd:
        if r["k"] and (r["batch"] not in best or r["decode_tok_s"] > best[r["batch"]]["decode_tok_s"]):
            best[r["batch"]] = r
    speedup = {b: best[b]["decode_tok_s"] / t_plain[b] for b in sorted(t_plain)}
    threshold = 0
    for b, x in speedup.items():
        if x <= 1:
            break
        threshold = b
    return {"threshold": threshold, "speedup": {str(b): x for b, x in speedup.items()},
            "best_k": {str(b): best[b]["k"] for b in speedup},
            "k0_over_plain_step": {str(r["batch"]): r["decode_step_ms"] / {p["batch"]: p["decode_step_ms"] for p in plain}[r["batch"]]
                                   for r in sd if r["k"] == 0}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "bench/results/sd_threshold.json"))
    ap.add_argument("--sizes", default="1,2,4,8,16,32,64")
    ap.add_argument("--max-k", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48, help="generated tokens per request")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--model", default=None, help="target folder (default: the task's SFT model via prepare); "
                    "only its architecture matters for the cost side")
    ap.add_argument("--acceptance", default="0.5,0.7,0.8", help="per-token acceptance rates to model")
    ap.add_argument("--drafter", default=None, help="an exported drafter folder, EAGLE-1 or EAGLE-3 (default: a random EAGLE-1)")
    ap.add_argument("--prompts", choices=["random", "task"], default="random",
                    help="random token prompts of --prompt-len, or task prompts with long solutions")
    ap.add_argument("--gpu", action="store_true", help="engines on CUDA: bf16 and CUDA graphs (default: the "
                    "CPU engine's fp32, eager)")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    rates = [float(a) for a in args.acceptance.split(",")]

    sys.path.insert(0, str(REPO))
    from tlt_verl.rollout.engine import sd_control
    from tlt_verl.rollout.engine.offline import offline_llm
    from tlt_verl.task.prepare import prepare

    model = Path(args.model) if args.model else Path(prepare(REPO / ".cache/tlt/assets")["model"])
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    work = Path(tempfile.mkdtemp(prefix="sd_threshold-"))
    drafter = Path(args.drafter) if args.drafter else _random_drafter(model, work / "drafter")
    make_prompts, prompt_len = None, args.prompt_len
    if args.prompts == "task":
        make_prompts, prompt_len = task_prompt_source(model)
    max_seqs = max(sizes)
    engine = dict(skip_tokenizer_init=True, max_model_len=prompt_len + args.tokens + args.max_k + 8,
                  max_num_seqs=max_seqs, max_num_batched_tokens=max(4096, max_seqs * (prompt_len + args.max_k + 2)))
    if args.gpu:
        engine.update(dtype="bfloat16", enforce_eager=False)
    t0 = time.time()
    llm = offline_llm(str(model), **engine)
    try:
        plain = _measure(llm, sizes, args.tokens, args.prompt_len, vocab, args.repeats, make_prompts=make_prompts)
    finally:
        llm.llm_engine.engine_core.shutdown()
    # Served as the rollout server serves it: the folder's own kind, and a parallel-drafting
    # EAGLE-3 drafter with all k drafts from one forward.
    from tlt_verl.drafter.export import folder_kind
    from tlt_verl.rollout.config import drafter_speculative_config

    spec = drafter_speculative_config(str(drafter), folder_kind(drafter), args.max_k,
                                      num_speculative_tokens_per_batch_size=[[1, max_seqs, args.max_k]])
    llm = offline_llm(str(model), speculative_config=spec, **engine)
    try:
        sd = _measure(llm, sizes, args.tokens, args.prompt_len, vocab, args.repeats,
                      set_k=lambda k: sd_control.set_sd_schedule(llm, [[1, max_seqs, k]]),
                      ks=range(0, args.max_k + 1), make_prompts=make_prompts)
    finally:
        llm.llm_engine.engine_core.shutdown()
    result = {
        "what": "decode step time, plain vs SD with k drafts (the drafter folder's kind), by running batch; tiny SFT target, "
                "random drafter (cost side); threshold modelled for per-token acceptance rates",
        "host": {"cpus": len(os.sched_getaffinity(0)), "machine": platform.machine(),
                 "loadavg_at_end": os.getloadavg()},
        "target": str(model.relative_to(REPO)) if model.is_relative_to(REPO) else str(model),
        "drafter": portable(args.drafter) if args.drafter else "random EAGLE-1 (tlt_verl.drafter, seed 0)",
        "args": portable_settings(vars(args)), "seconds": time.time() - t0, "plain": plain, "sd": sd,
        **analyse(plain, sd, rates),
        **({"measured": measured(plain, sd)} if args.drafter else {}),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for a, t in result["threshold"].items():
        print(f"acceptance {a}: threshold {t['threshold']}, best k {t['best_k']}")
    if args.drafter:
        m = result["measured"]
        print(f"measured: threshold {m['threshold']}, speed-up {json.dumps({b: round(x, 2) for b, x in m['speedup'].items()})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
