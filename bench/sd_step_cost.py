"""Where the time of a speculative decoding step goes: target verify, draft forwards, sampling and
bookkeeping, by running batch, for sequential drafting (EAGLE-1, EAGLE-3) and EAGLE-3 with vLLM
0.30's parallel drafting (all k drafts from one drafter forward).

    .venv/bin/python bench/sd_step_cost.py --out bench/results/sd_step_cost.json

All engines live side by side in this process (in-process engine cores on one core, the tiny SFT
target, randomly initialised drafters of each kind: this measures cost, not acceptance; pass
`--drafter ARM=DIR` for a trained one, whose acceptance is then reported too). The model runner's
own methods are timed from inside the worker: `_model_forward` plus `compute_logits` of the
target (verify), the drafter model's forward (draft forwards, counted), the sampler and the
rejection sampler (sampling), the rest of `propose` (draft-side bookkeeping: input preparation,
draft sampling) and of `execute_model` / `sample_tokens` (runner bookkeeping); what the engine
spends outside the runner (scheduling, output processing) is the generation's wall time per step
less the runner's. The first step of each generation (the prefill) is left out. Rounds run the
arms in rotating order; per arm and batch the round with the fastest step is kept.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench import portable_settings  # noqa: E402

# arm -> (drafter kind, parallel drafting); "plain" has no drafter.
ARMS = {"plain": None, "eagle": ("eagle", False), "eagle3": ("eagle3", False),
        "eagle3_parallel": ("eagle3", True)}
METHOD = {"eagle": "eagle", "eagle3": "eagle3"}


def random_drafter(model_dir: Path, kind: str, parallel: bool, out: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tlt_verl.drafter import DrafterConfig, build_drafter, target_tensors
    from tlt_verl.drafter.export import export_drafter

    cfg = DrafterConfig.from_target(AutoConfig.from_pretrained(model_dir), kind=kind, parallel_drafting=parallel)
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return export_drafter(build_drafter(cfg, *target_tensors(target)), out, engine="vllm")


def install_timers(worker) -> None:
    """Wrap the runner's parts in timers that record (start, exclusive seconds) per call, on the
    worker: a part's time excludes the timed parts it calls (the rejection sampler calls the
    sampler, `propose` the drafter's forward), so the parts add up to the runner's time."""
    mr = worker.model_runner
    calls, stack = collections.defaultdict(list), []
    mr._tlt_cost_calls = calls

    def timed(obj, name, key):
        fn = getattr(obj, name)

        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            stack.append(0.0)
            try:
                return fn(*args, **kwargs)
            finally:
                took, nested = time.perf_counter() - t, stack.pop()
                calls[key].append((t, took - nested))
                if stack:
                    stack[-1] += took
        setattr(obj, name, wrapper)

    timed(mr, "execute_model", "execute_model")
    timed(mr, "sample_tokens", "sample_tokens")
    timed(mr, "_model_forward", "target_forward")
    timed(mr.model, "compute_logits", "target_logits")
    timed(mr.sampler, "forward", "sampler")
    if getattr(mr, "drafter", None) is not None:
        timed(mr.drafter, "propose", "propose")
        timed(mr.drafter.model, "forward", "draft_forward")
        timed(mr.rejection_sampler, "forward", "rejection_sampler")


def take_calls(worker) -> dict:
    calls = worker.model_runner._tlt_cost_calls
    out = {k: list(v) for k, v in calls.items()}
    calls.clear()
    return out


def breakdown(calls: dict, wall_s: float, generated: int, batch: int) -> dict:
    """Per decode step (ms): the parts, from the calls after the first step's."""
    steps = sorted(calls["execute_model"])
    if len(steps) < 3:
        raise RuntimeError(f"only {len(steps)} steps: generate more tokens")
    first_end = steps[1][0]                       # the second step starts after the prefill step
    kept = {k: [d for t, d in v if t >= first_end] for k, v in calls.items()}
    n = len(kept["execute_model"])
    total = lambda k: sum(kept.get(k, ())) / n * 1e3
    parts = {"target_verify_ms": total("target_forward") + total("target_logits"),
             "draft_forwards_ms": total("draft_forward"),
             "sampling_ms": total("sampler") + total("rejection_sampler"),
             "draft_bookkeeping_ms": total("propose"),
             "runner_bookkeeping_ms": total("execute_model") + total("sample_tokens")}
    # Outside the runner (scheduling, output processing): the generation's wall time less every
    # step's runner time, per step; the decode step is the runner's part plus that.
    runner_all = sum(d for k in ("execute_model", "sample_tokens") for _, d in calls[k]) + \
        sum(d for k in ("target_forward", "target_logits", "draft_forward", "sampler", "rejection_sampler",
                        "propose") for _, d in calls.get(k, ()))
    outside = max(wall_s - runner_all, 0.0) / len(steps) * 1e3
    return {
        "steps": n, "step_ms": sum(parts.values()) + outside, **parts,
        "draft_forwards_per_step": len(kept.get("draft_forward", ())) / n,
        "engine_outside_runner_ms": outside,
        "tokens_per_request_step": generated / batch / len(steps),
        "tokens_per_s": generated / len(steps) / ((sum(parts.values()) + outside) / 1e3),
    }


def by_round(rounds: list[dict], arms: list[str], sizes: list[int], base: str) -> dict:
    return {a: {str(b): sorted(x["arms"][a][str(b)]["step_ms"] / x["arms"][base][str(b)]["step_ms"] for x in rounds)
                for b in sizes} for a in arms}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "bench/results/sd_step_cost.json"))
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--sizes", default="1,8,64")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens of the SD arms")
    ap.add_argument("--tokens", type=int, default=64, help="generated tokens per request")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--drafter", action="append", default=[], metavar="ARM=DIR",
                    help="serve a trained drafter folder in ARM instead of a random one")
    ap.add_argument("--prompts", choices=["random", "task"], default="random",
                    help="task: the task's prompts with long solutions, what a trained drafter was trained on")
    args = ap.parse_args(argv)
    arms = args.arms.split(",")
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        ap.error(f"--arms: unknown {unknown}; known: {', '.join(ARMS)}")
    given = dict(x.split("=", 1) for x in args.drafter)
    sizes = [int(s) for s in args.sizes.split(",")]

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from bench.sd_threshold import _prompts, task_prompt_source
    from tlt_verl.rollout.engine.offline import offline_llm
    from tlt_verl.task.prepare import prepare

    model = Path(prepare(REPO / ".cache/tlt/assets")["model"])
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    tmp = Path(tempfile.mkdtemp(prefix="sd_step_cost-"))
    max_seqs = max(sizes)
    if args.prompts == "task":
        make_prompts, args.prompt_len = task_prompt_source(model)
    else:
        make_prompts = lambda n, seed: _prompts(n, args.prompt_len, vocab, seed)
    engine = dict(skip_tokenizer_init=True, max_model_len=args.prompt_len + args.tokens + 2 * args.k + 8,
                  max_num_seqs=max_seqs, max_num_batched_tokens=max(4096, max_seqs * (args.prompt_len + 2 * args.k + 2)))
    llms, drafters = {}, {}
    for arm in arms:
        spec = None
        if ARMS[arm] is not None:
            kind, parallel = ARMS[arm]
            folder = Path(given[arm]) if arm in given else random_drafter(model, kind, parallel, tmp / arm)
            drafters[arm] = {"folder": folder.name, "trained": arm in given}
            spec = {"method": METHOD[kind], "model": str(folder), "num_speculative_tokens": args.k,
                    "parallel_drafting": parallel}
        t = time.perf_counter()
        llms[arm] = offline_llm(str(model), **engine, **({"speculative_config": spec} if spec else {}))
        llms[arm].collective_rpc(install_timers)
        print(f"{arm}: engine up in {time.perf_counter() - t:.0f}s", flush=True)

    sp = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True, detokenize=False)
    rounds = []
    try:
        for r in range(args.rounds):
            order = arms[r % len(arms):] + arms[:r % len(arms)]
            row = {}
            for b in sizes:
                prompts = [TokensPrompt(prompt_token_ids=p) for p in make_prompts(b, r)]
                for arm in order:
                    llms[arm].collective_rpc(take_calls)
                    t = time.perf_counter()
                    outs = llms[arm].generate(prompts, sp, use_tqdm=False)
                    wall = time.perf_counter() - t
                    generated = sum(len(o.outputs[0].token_ids) for o in outs)
                    calls = llms[arm].collective_rpc(take_calls)[0]
                    row.setdefault(arm, {})[str(b)] = breakdown(calls, wall, generated, b)
                print(f"round {r + 1} batch {b}: " + ", ".join(
                    f"{a} {row[a][str(b)]['step_ms']:.2f} ms" for a in arms), flush=True)
            rounds.append({"order": order, "arms": row})
    finally:
        for llm in llms.values():
            llm.llm_engine.engine_core.shutdown()

    best = {a: {str(b): min((x["arms"][a][str(b)] for x in rounds), key=lambda m: m["step_ms"]) for b in sizes}
            for a in arms}
    result = {
        "what": "per decode step (ms) of each arm: target verify, draft forwards, sampling, draft-side and "
                "runner bookkeeping, engine time outside the runner; the round with the fastest step per arm and "
                "batch; random drafters measure cost only",
        "k": args.k, "tokens": args.tokens, "prompts": args.prompts, "prompt_len": args.prompt_len,
        "rounds": args.rounds,
        "drafters": drafters, "best": best,
        "step_over_plain": {a: {b: best[a][b]["step_ms"] / best["plain"][b]["step_ms"] for b in best[a]}
                            for a in arms} if "plain" in arms else None,
        # Tokens per second over plain decoding's: > 1 where the drafts pay for their cost.
        "speed_over_plain": {a: {b: best[a][b]["tokens_per_s"] / best["plain"][b]["tokens_per_s"] for b in best[a]}
                             for a in arms} if "plain" in arms else None,
        "per_round": rounds,
        # Each round's step over the plain and the EAGLE-1 arm's (same round, same prompts), sorted:
        # the spread behind the ratios above.
        **{f"step_over_{base}_by_round": by_round(rounds, arms, sizes, base) for base in ("plain", "eagle") if base in arms},
        "host": {"cpus": len(os.sched_getaffinity(0)), "machine": platform.machine(), "loadavg_at_end": os.getloadavg()},
        "args": portable_settings(vars(args)),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    for a in arms:
        print(a, json.dumps({b: {k: round(v, 2) for k, v in m.items()} for b, m in best[a].items()}))
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
