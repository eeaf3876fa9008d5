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

`--ks 0,1,2,3` measures one drafter at each k instead (arms plain, k0, k1, ...: one SD engine
whose k is set per generation, patches/vllm_sd/runtime.py), on any target; `--off-out` then also
writes k0 over plain in bench/sd_off_cost.py's format, and a PNG goes next to --out. On the real LM:

    .venv/bin/python bench/sd_step_cost.py --target .cache/tlt/models/smollm2-135m --drafter DIR \
        --method eagle3 --ks 0,1,2,3 --sizes 1,2,4,8,16,32,64 --out bench/results/sd_step_cost_real.json \
        --off-out bench/results/sd_off_cost_real.json
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
from bench import default_prompts, kv_cache_bytes, portable_settings  # noqa: E402

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


def prompt_source(args, model: Path, vocab: int):
    """``(n, seed) -> token-id prompts`` for --prompts; sets args.prompts when it was left to the target."""
    args.prompts = args.prompts or ("random" if default_prompts(model) == "task" else "chat")
    if args.prompts == "task":
        from bench.sd_threshold import task_prompt_source

        return task_prompt_source(model)[0]
    if args.prompts == "chat":
        from transformers import AutoTokenizer

        from tlt_verl.task.chat_longtail import chat_prompt_ids

        tok = AutoTokenizer.from_pretrained(model)
        if not tok.chat_template:
            raise SystemExit(f"--prompts chat: {model} has no chat template")
        return lambda n, seed: chat_prompt_ids(tok, n, seed)
    from bench.sd_threshold import _prompts

    return lambda n, seed: _prompts(n, args.prompt_len, vocab, seed)


def plot(result: dict, png: Path) -> None:
    """ms per step and tokens per request and step against the batch, one line per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4.2))
    for arm, per_batch in result["best"].items():
        sizes = sorted(per_batch, key=int)
        style = dict(marker="o", lw=2.2 if arm in ("plain", "k0") else 1.3, ls="--" if arm == "k0" else "-")
        ax0.plot([int(b) for b in sizes], [per_batch[b]["step_ms"] for b in sizes], label=arm, **style)
        ax1.plot([int(b) for b in sizes], [per_batch[b]["tokens_per_request_step"] for b in sizes], label=arm, **style)
    for ax, label in ((ax0, "ms per engine step"), (ax1, "tokens per request and step")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    ax0.set_yscale("log")
    ax0.legend(fontsize=8)
    fig.suptitle(f"{result['target']}: SD step cost by batch (k arms on one drafter, {result['prompts']} prompts)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def off_cost_rounds(rounds: list[dict], sizes: list[int]) -> list[dict]:
    """Each round's k0 and plain steps in bench/sd_off_cost.py's round format."""
    return [{"order": [a for a in x["order"] if a in ("plain", "k0")],
             "plain_step_ms": {b: x["arms"]["plain"][str(b)]["step_ms"] for b in sizes},
             "sd_k0_step_ms": {b: x["arms"]["k0"][str(b)]["step_ms"] for b in sizes}} for x in rounds]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "bench/results/sd_step_cost.json"))
    ap.add_argument("--target", default=None, help="an HF target folder (default: the task's SFT model)")
    ap.add_argument("--arms", default=None, help=f"drafter kinds to compare (default and choices: {','.join(ARMS)})")
    ap.add_argument("--ks", default=None, metavar="K,K,...",
                    help="instead of --arms: one drafter (--drafter DIR or a random one of --method) at each k")
    ap.add_argument("--method", default="eagle3", choices=tuple(METHOD), help="the drafter's kind with --ks")
    ap.add_argument("--off-out", default=None, help="with --ks 0,...: also write k0 over plain (sd_off_cost format)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--sizes", default="1,8,64")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens of the SD arms")
    ap.add_argument("--tokens", type=int, default=64, help="generated tokens per request")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--drafter", action="append", default=[], metavar="ARM=DIR",
                    help="serve a trained drafter folder in ARM instead of a random one (with --ks: DIR)")
    ap.add_argument("--prompts", choices=["random", "task", "chat"], default=None,
                    help="task: the task's prompts with long solutions, what a trained drafter was trained on; "
                         "chat: tlt_verl.task.chat_longtail through the target's chat template "
                         "(default: random for the task's targets, chat for a pretrained LM)")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.ks is not None:
        if args.arms is not None:
            ap.error("--arms: not with --ks (the arms are then plain and one per k)")
        ks = [int(k) for k in args.ks.split(",")]
        if any(k < 0 for k in ks) or len(set(ks)) != len(ks):
            ap.error(f"--ks {args.ks}: distinct numbers of speculative tokens >= 0")
        if len(args.drafter) > 1 or any("=" in d for d in args.drafter):
            ap.error(f"--drafter {' '.join(args.drafter)}: with --ks give one folder, no ARM=")
        arms = ["plain"] + [f"k{k}" for k in ks]
    else:
        if args.off_out:
            ap.error("--off-out: needs --ks with 0 among the ks")
        arms = (args.arms or ",".join(ARMS)).split(",")
        unknown = [a for a in arms if a not in ARMS]
        if unknown:
            ap.error(f"--arms: unknown {unknown}; known: {', '.join(ARMS)}")
        bare = [d for d in args.drafter if "=" not in d]
        if bare:
            ap.error(f"--drafter {bare[0]}: give ARM=DIR (a bare folder needs --ks)")
    if args.off_out and "k0" not in arms:
        ap.error(f"--off-out: needs k=0 among --ks {args.ks}")
    given = dict(x.split("=", 1) for x in args.drafter if "=" in x)

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from tlt_verl.rollout.config import drafter_speculative_config
    from tlt_verl.rollout.engine import sd_control
    from tlt_verl.rollout.engine.offline import offline_llm
    from tlt_verl.task.prepare import prepare

    if args.target is None:
        model = Path(prepare(REPO / ".cache/tlt/assets")["model"])
    elif not (Path(args.target) / "config.json").is_file():
        ap.error(f"--target {args.target}: not an HF model folder (no config.json)")
    else:
        model = Path(args.target)
    for d in args.drafter:
        if not (Path(d.split("=", 1)[-1]) / "config.json").is_file():
            ap.error(f"--drafter {d}: not an exported drafter folder (no config.json)")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    tmp = Path(tempfile.mkdtemp(prefix="sd_step_cost-"))
    max_seqs = max(sizes)
    make_prompts = prompt_source(args, model, vocab)
    # Every round's prompts up front: the engines' context must hold the longest.
    prompt_sets = {(r, b): make_prompts(b, r) for r in range(args.rounds) for b in sizes}
    args.prompt_len = max(len(p) for ps in prompt_sets.values() for p in ps)
    max_k = max(ks) if args.ks is not None else args.k
    model_len = args.prompt_len + args.tokens + 2 * max_k + 8
    engine = dict(skip_tokenizer_init=True, max_model_len=model_len, max_num_seqs=max_seqs,
                  max_num_batched_tokens=max(4096, max_seqs * (args.prompt_len + 2 * max_k + 2)),
                  kv_cache_memory_bytes=kv_cache_bytes(model, max_seqs, model_len))
    llms, drafters, set_k = {}, {}, {}
    if args.ks is not None:
        if args.drafter:
            folder, trained = Path(args.drafter[0]), True
        else:
            folder, trained = random_drafter(model, args.method, False, tmp / "drafter"), False
        drafters["sd"] = {"folder": folder.name, "trained": trained, "method": args.method}
        # A per-batch schedule at start-up is what lets the k be set at run time.
        spec = drafter_speculative_config(str(folder), args.method, max_k,
                                          num_speculative_tokens_per_batch_size=[[1, max_seqs, max_k]])
        for name, kwargs in (("plain", {}), ("sd", {"speculative_config": spec})):
            t = time.perf_counter()
            llms[name] = offline_llm(str(model), **engine, **kwargs)
            llms[name].collective_rpc(install_timers)
            print(f"{name}: engine up in {time.perf_counter() - t:.0f}s", flush=True)
        for k in ks:
            set_k[f"k{k}"] = k
    for arm in arms if args.ks is None else ():
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

    engine_of = {arm: llms["sd" if arm in set_k else arm] for arm in arms}
    sp = SamplingParams(temperature=args.temperature, max_tokens=args.tokens, ignore_eos=True, detokenize=False,
                        seed=0)
    rounds = []

    def run_arm(arm, prompts, params):
        llm = engine_of[arm]
        if arm in set_k:
            sd_control.set_sd_schedule(llm, [[1, max_seqs, set_k[arm]]])
        return llm.generate(prompts, params, use_tqdm=False)

    try:
        if args.ks is not None:
            # Unrecorded: oneDNN builds its kernels per input shape on first use, and each k is a
            # shape of its own; seconds of that would otherwise land in round 1's ratios.
            warm = SamplingParams(temperature=args.temperature, max_tokens=4, ignore_eos=True, detokenize=False)
            for b in sizes:
                for arm in arms:
                    run_arm(arm, [TokensPrompt(prompt_token_ids=p) for p in prompt_sets[0, b]], warm)
                    engine_of[arm].collective_rpc(take_calls)
            print("warm-up done", flush=True)
        for r in range(args.rounds):
            order = arms[r % len(arms):] + arms[:r % len(arms)]
            row = {}
            for b in sizes:
                prompts = [TokensPrompt(prompt_token_ids=p) for p in prompt_sets[r, b]]
                for arm in order:
                    llm = engine_of[arm]
                    llm.collective_rpc(take_calls)
                    t = time.perf_counter()
                    outs = run_arm(arm, prompts, sp)
                    wall = time.perf_counter() - t
                    generated = sum(len(o.outputs[0].token_ids) for o in outs)
                    calls = llm.collective_rpc(take_calls)[0]
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
        "target": model.name, "k": max_k, "ks": args.ks, "temperature": args.temperature, "tokens": args.tokens, "prompts": args.prompts, "prompt_len": args.prompt_len,
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
        **{f"step_over_{base}_by_round": by_round(rounds, arms, sizes, base) for base in ("plain", "eagle", "k0")
           if base in arms},
        "host": {"cpus": len(os.sched_getaffinity(0)), "machine": platform.machine(), "loadavg_at_end": os.getloadavg()},
        "args": portable_settings(vars(args)),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    if args.ks is not None:
        plot(result, Path(args.out).with_suffix(".png"))
    if args.off_out:
        from bench.sd_off_cost import off_cost_result

        off = off_cost_result(
            off_cost_rounds(rounds, sizes), sizes,
            what=f"decode step at k=0 in an engine with a {args.method} drafter over the same step in a plain "
                 f"engine ({model.name}; per round the mean step of a generation of --tokens tokens, engine time "
                 "outside the runner included; bench/sd_step_cost.py --ks)",
            args=portable_settings(vars(args)), step_cost=str(Path(args.out).name))
        Path(args.off_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.off_out).write_text(json.dumps(off, indent=1) + "\n")
        print("k0_over_plain", json.dumps({b: round(v, 3) for b, v in off["k0_over_plain"].items()}),
              f"-> {args.off_out}")
    for a in arms:
        print(a, json.dumps({b: {k: round(v, 2) for k, v in m.items()} for b, m in best[a].items()}))
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
