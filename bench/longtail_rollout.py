"""The long-tail rollout of the tiny task: plain decoding, fixed SD per strategy, adaptive SD.

    python bench/longtail_rollout.py --drafter DIR --out bench/results/longtail_rollout.json

Every mode decodes the same rounds of task prompts (round r: held-out problems drawn with seed
VAL_SEED + r, like successive RL steps) at the same temperature and seed, on one process:

- plain: an engine without a drafter;
- fixed k: an engine with the drafter whose schedule is k for every batch size;
- adaptive: the same SD engine under `AdaptiveSDPolicy` (threshold + bandit), its state carried
  from round to round as it is from RL step to RL step; exploration is paid for in the timing.
  With `--adaptive paired:adjacent pull:uniform`, one adaptive mode per `sd.values:bandit.explore`
  pair, the first named `adaptive`, the others `adaptive_<values>_<explore>`, each with its own bandit.

The two engines are alive together and the modes take turns within each round, so drift in the
machine's load falls on all of them alike. Reported per mode: rollout wall clock (sum over
rounds), tokens/s over time and against the running batch size (from the engine's per-step
records, patches/vllm_sd/runtime.py), and at T=0 whether each output equals plain decoding.
Writes the JSON to --out and a PNG next to it. Without --drafter, one is trained first
(`tlt-verl drafter warmup`, --train-s seconds). Each mode's time is also split by phase
(`phases`): the crowded phase, steps whose running batch is above --tail-batch, and the tail.

A pretrained chat LM as --target gets tlt_verl.task.chat_longtail's prompts through its chat
template (`--prompts chat`, the default for a target whose vocabulary is not the task's).

`--never-lose`: the SD engine starts with a scratch drafter (--drafter's folder, its weights
redrawn at random: the same shapes, acceptance near 0), the adaptive policy must keep up with
plain decoding over --rounds rounds (goal 0.95x); then --drafter's own weights are pushed into the
running engine (the hot-swap the trainer uses) and --rounds-after-push more rounds show whether
the policy turns SD back on. Writes `never_lose` with both parts, and the arms per bucket per round.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench import default_prompts, kv_cache_bytes, portable_settings  # noqa: E402
DEFAULT_TARGET = REPO / ".cache/tlt/assets/sft_model"
GOALS = {"vs_plain": 1.5, "vs_best_fixed": 1.0}
NEVER_LOSE_GOAL = 0.95  # adaptive over plain with a drafter that accepts almost nothing


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def round_prompts(target: str, n: int, rnd: int, kind: str = "task") -> list[list[int]]:
    from transformers import AutoTokenizer

    from tlt_verl.drafter.warmup import task_prompts
    from tlt_verl.task.chat_longtail import chat_prompt_ids
    from tlt_verl.task.prepare import VAL_SEED

    make = chat_prompt_ids if kind == "chat" else task_prompts
    return make(AutoTokenizer.from_pretrained(target), n, VAL_SEED + rnd)


def scratch_drafter(folder: str, out: Path, seed: int = 0) -> Path:
    """A copy of the drafter folder whose floating-point weights are redrawn at random, each
    tensor at its own scale: it serves with the same config, vocabulary map and shapes (so the
    trained weights can be pushed into it later), and its drafts are almost never accepted."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(folder, out)
    gen = torch.Generator().manual_seed(seed)
    weights = load_file(str(Path(folder) / "model.safetensors"))
    for name, w in weights.items():
        if w.is_floating_point() and w.numel() > 1 and float(w.float().std()) > 0:
            weights[name] = (torch.randn(w.shape, generator=gen) * w.float().std() + w.float().mean()).to(w.dtype)
    save_file(weights, str(out / "model.safetensors"))
    return out


async def run_engines(args) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from tlt_verl.rollout.config import drafter_speculative_config
    from tlt_verl.rollout.engine.offline import use_engine_env
    from tlt_verl.rollout.engine.sd_loop import AdaptiveSDLoop, summarize
    from tlt_verl.rollout.engine.server import start_engine
    from tlt_verl.rollout.policy import AdaptiveSDPolicy, BanditConfig, SDPolicyConfig

    use_engine_env()
    arms = tuple(args.arms)
    max_k = max(arms)
    base = dict(model=args.target, skip_tokenizer_init=True, dtype="float32", enforce_eager=not args.compile,
                seed=args.seed,
                max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=32768,
                kv_cache_memory_bytes=kv_cache_bytes(args.target, args.max_num_seqs, args.max_model_len),
                disable_log_stats=False)
    served = args.drafter
    if args.never_lose:
        served = str(scratch_drafter(args.drafter, Path(args.phase_out).parent / "scratch_drafter", args.seed))
    # As the rollout server serves it: a parallel-drafting drafter gets all k drafts from one forward.
    spec = drafter_speculative_config(served, args.method, max_k,
                                      num_speculative_tokens_per_batch_size=[[1, args.max_num_seqs, max_k]])
    t = time.time()
    plain = start_engine(base)
    # The worker extension carries the drafter hot-swap (drafter_reload.py), as in the rollout server.
    sd = start_engine({**base, "speculative_config": spec,
                       "worker_extension_cls": "tlt_verl.rollout.engine.worker_extension.TLTWorkerExtension"})
    log(f"engines up in {time.time() - t:.1f}s")
    adaptive = {}
    for i, spec in enumerate(args.adaptive):
        values, explore, *start = spec.split(":")
        start = start[0] if start else BanditConfig.start
        name = "adaptive" if i == 0 else "_".join(["adaptive", values, explore, *([start] if start != BanditConfig.start else [])])
        adaptive[name] = AdaptiveSDPolicy(
            SDPolicyConfig(threshold=args.threshold, steps_per_pull=args.steps_per_pull, values=values,
                           bandit=BanditConfig(arms=arms, seed=args.seed, explore=explore, start=start,
                                               step_size=args.step_size)),
            max_k=max_k, max_batch=args.max_num_seqs)
    fixed = [k for k in arms if k > 0] if args.fixed is None else args.fixed
    modes = ["plain"] + [f"fixed_k{k}" for k in fixed] + list(adaptive)
    calls = 0

    async def rollout(engine, prompts, loop: AdaptiveSDLoop) -> dict:
        nonlocal calls
        calls += 1

        async def one(i, p):
            sp = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed + i,
                                detokenize=False)
            final = None
            async for out in engine.generate(TokensPrompt(prompt_token_ids=p), sp, f"c{calls}-{i}"):
                final = out
            return list(final.outputs[0].token_ids)

        await loop.poll()
        loop.take_records()
        await loop.start()
        t0 = time.perf_counter()
        tokens = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        wall = time.perf_counter() - t0
        await loop.stop()
        recs = loop.take_records()
        return {"wall_s": wall, "tokens": tokens, "records": [vars(m) for m in recs], "summary": summarize(recs)}

    loops = {"plain": AdaptiveSDLoop(plain, None)}
    for k in fixed:
        loops[f"fixed_k{k}"] = AdaptiveSDLoop(sd, _FixedK(k, args.max_num_seqs))
    for m, policy in adaptive.items():
        loops[m] = AdaptiveSDLoop(sd, policy)
    engines = {m: (plain if m == "plain" else sd) for m in modes}
    try:
        # A whole unrecorded round first: oneDNN and vLLM warm up per batch shape, and the first
        # pass over each shape would otherwise land on whichever mode met it first.
        warm = round_prompts(args.target, args.num_prompts, 1000, args.prompts)
        for m in modes:
            if m not in adaptive:  # the bandit learns only from recorded rounds
                await rollout(engines[m], warm, loops[m])
        log("warm-up round done")
        res = {m: [] for m in modes}
        arms_per_round, pushed = {m: [] for m in adaptive}, None
        total = args.rounds + (args.rounds_after_push if args.never_lose else 0)
        for rnd in range(total):
            if args.never_lose and rnd == args.rounds:
                from tlt_verl.rollout.engine.drafter_push import DrafterManifest, push_drafter_async

                sha = await push_drafter_async(sd, DrafterManifest.from_folder(served),
                                               Path(args.drafter) / "model.safetensors")
                for policy in adaptive.values():  # as the rollout server tells its policy; each
                    policy.drafter_pushed(sha)      # loop pushes its schedule when its rollout starts
                pushed = {"after_round": rnd - 1, "sha256": sha}
                log(f"pushed {args.drafter} into the SD engine (sha256 {sha[:12]})")
            prompts = round_prompts(args.target, args.num_prompts, rnd, args.prompts)
            order = modes if rnd % 2 == 0 else modes[::-1]
            for m in order:
                out = await rollout(engines[m], prompts, loops[m])
                res[m].append(out)
                log(f"round {rnd} {m:>10}: {out['wall_s']:6.2f}s  {sum(map(len, out['tokens']))} tokens  "
                    f"SD share {out['summary']['sd_step_share']:.2f}  acc_len {out['summary']['acceptance_length']:.2f}")
            for m in adaptive:
                arms_per_round[m].append(loops[m].arms())
                log(f"round {rnd} {m} arms per bucket {loops[m].arms()}")
        return {"modes": modes, "rounds": res, "bandit": adaptive["adaptive"].bandit.state_dict(),
                "arms_per_round": arms_per_round, "pushed": pushed,
                "final_arms": loops["adaptive"].arms(),
                "others": {m: {"bandit": p.bandit.state_dict(), "final_arms": loops[m].arms()}
                           for m, p in adaptive.items() if m != "adaptive"}}
    finally:
        plain.shutdown()
        sd.shutdown()


class _FixedK:
    """A policy that never changes its one schedule: fixed SD with k speculative tokens."""

    def __init__(self, k: int, max_batch: int) -> None:
        self._schedule = [(1, max_batch, k)]

    def schedule(self):
        return self._schedule

    def observe(self, records) -> bool:
        return False


def analyse(raw: dict, args) -> dict:
    if not args.never_lose:
        return analyse_rounds(raw, args)
    # The scratch rounds and the rounds after the push, each its own comparison of the modes.
    parts = {name: analyse_rounds({**raw, "rounds": {m: r[sl] for m, r in raw["rounds"].items()}}, args)
             for name, sl in (("scratch", slice(0, args.rounds)), ("pushed", slice(args.rounds, None)))
             if raw["rounds"]["plain"][sl]}
    scratch = parts["scratch"]
    after = parts.get("pushed")
    on_after = None
    if after is not None:
        share = [s["sd_step_share"] for s in after["modes"]["adaptive"]["summary_per_round"]]
        at_push = raw["arms_per_round"]["adaptive"][args.rounds - 1]
        # "Back on" means something only where the scratch rounds had turned SD off.
        on_after = {"sd_step_share_per_round": share, "arms_at_push": at_push,
                    "sd_was_off": not any(k > 0 for k in at_push.values()),
                    "final_arms": raw["final_arms"],
                    "sd_back_on": any(k > 0 for k in raw["final_arms"].values()) and share[-1] > 0,
                    "adaptive_vs_plain": after["speedup"]["adaptive_vs_plain"]}
    out = {**scratch, "never_lose": {
        "goal_adaptive_vs_plain": NEVER_LOSE_GOAL,
        "adaptive_vs_plain": scratch["speedup"]["adaptive_vs_plain"],
        "met": scratch["speedup"]["adaptive_vs_plain"] >= NEVER_LOSE_GOAL,
        "sd_step_share_per_round": [s["sd_step_share"] for s in scratch["modes"]["adaptive"]["summary_per_round"]],
        "acceptance_length_per_round": [s["acceptance_length"]
                                        for s in scratch["modes"]["adaptive"]["summary_per_round"]],
        "push": raw["pushed"], "after_push": on_after}}
    if after is not None:
        out["after_push"] = {k: after[k] for k in ("modes", "speedup", "throughput_speedup", "phases",
                                                   "phases_vs_plain", "by_batch", "by_batch_vs_plain")}
    return out


def analyse_rounds(raw: dict, args) -> dict:
    modes = raw["modes"]
    plain_tokens = [r["tokens"] for r in raw["rounds"]["plain"]]
    out = {"config": portable_settings(vars(args)), "modes": {}}
    for m in modes:
        rounds = raw["rounds"][m]
        identical = sum(a == b for r, ref in zip(rounds, plain_tokens) for a, b in zip(r["tokens"], ref))
        out["modes"][m] = {
            "wall_s": sum(r["wall_s"] for r in rounds),
            "wall_s_per_round": [round(r["wall_s"], 3) for r in rounds],
            "tokens": sum(sum(map(len, r["tokens"])) for r in rounds),
            "identical_to_plain": identical,
            "requests": sum(len(r["tokens"]) for r in rounds),
            "summary_per_round": [r["summary"] for r in rounds],
        }
    wall = {m: out["modes"][m]["wall_s"] for m in modes}
    out["speedup"] = _ratios({m: 1.0 / wall[m] for m in modes})
    # At T > 0 the modes sample different (equally distributed) responses, so a round's wall clock
    # also follows how long its responses came out; decode throughput (tokens per second of the
    # whole rollout) compares the engines on what each actually decoded.
    out["throughput_speedup"] = _ratios({m: out["modes"][m]["tokens"] / wall[m] for m in modes})
    out["goals"] = GOALS
    out["final_arms"] = raw["final_arms"]
    out["arms_per_round"] = raw["arms_per_round"]
    out["bandit"] = raw["bandit"]
    out["other_adaptive"] = raw["others"]
    # Step series of the last round: what the plot shows.
    out["steps_last_round"] = {m: [{k: s[k] for k in ("t", "batch", "k", "emitted", "step_s")}
                                   for s in raw["rounds"][m][-1]["records"]] for m in modes}
    out["by_batch"] = {m: by_batch([s for r in raw["rounds"][m] for s in r["records"]]) for m in modes}
    out["by_batch_vs_plain"] = {m: {b: v / out["by_batch"]["plain"][b] for b, v in out["by_batch"][m].items()
                                    if out["by_batch"]["plain"].get(b)} for m in modes if m != "plain"}
    out["tail_batch"] = args.tail_batch
    out["phases"] = {m: phases([s for r in raw["rounds"][m] for s in r["records"]], args.tail_batch) for m in modes}
    out["phases_vs_plain"] = {m: {p: {"tokens_per_s": v["tokens_per_s"] / out["phases"]["plain"][p]["tokens_per_s"],
                                      "seconds": v["seconds"] / out["phases"]["plain"][p]["seconds"]}
                                  for p, v in out["phases"][m].items() if out["phases"]["plain"][p]["seconds"] > 0}
                              for m in modes if m != "plain"}
    return out


def phases(records: list[dict], tail_batch: int) -> dict:
    """Engine seconds, tokens and tokens per second of the crowded phase (running batch above
    `tail_batch`) and of the tail, prefill steps included: the rollout waits for them too."""
    out = {p: {"steps": 0, "seconds": 0.0, "tokens": 0} for p in ("crowded", "tail")}
    for s in records:
        p = out["tail" if s["batch"] <= tail_batch else "crowded"]
        p["steps"] += 1
        p["seconds"] += s["step_s"]
        p["tokens"] += s["emitted"]
    for p in out.values():
        p["tokens_per_s"] = p["tokens"] / p["seconds"] if p["seconds"] > 0 else 0.0
    return out


def _ratios(speed: dict[str, float]) -> dict:
    """Adaptive and each fixed k against plain, and adaptive against the fastest fixed k, by `speed`."""
    fixed = [m for m in speed if m.startswith("fixed")]
    others = [m for m in speed if m.startswith("adaptive_")]
    out = {"adaptive_vs_plain": speed["adaptive"] / speed["plain"],
           **{f"{m}_vs_plain": speed[m] / speed["plain"] for m in fixed + others}}
    if fixed:                                 # --fixed with no k: adaptive modes against plain alone
        best = max(fixed, key=speed.get)
        out.update({"adaptive_vs_best_fixed": speed["adaptive"] / speed[best], "best_fixed": best,
                    **{f"{m}_vs_best_fixed": speed[m] / speed[best] for m in others}})
    return out


def by_batch(records: list[dict]) -> dict[str, float]:
    """Decode tokens per second against the running batch size (power-of-two bins)."""
    bins: dict[int, list[float]] = {}
    for s in records:
        if s["prefill_reqs"] or s["step_s"] <= 0:
            continue
        b = 1 << (s["batch"].bit_length() - 1)
        acc = bins.setdefault(b, [0.0, 0.0])
        acc[0] += s["emitted"]
        acc[1] += s["step_s"]
    return {str(b): acc[0] / acc[1] for b, acc in sorted(bins.items())}


def plot(result: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(result["modes"])
    fig, (ax0, ax1, ax2) = plt.subplots(1, 3, figsize=(16, 4.5))
    walls = [result["modes"][m]["wall_s"] for m in modes]
    colours = {"plain": "grey", "adaptive": "tab:red"}
    ax0.bar(modes, walls, color=[colours.get(m, "salmon" if m.startswith("adaptive") else "tab:blue") for m in modes])
    ax0.set_ylabel("rollout wall clock, all rounds (s)")
    sp = result["speedup"]
    ax0.set_title(f"adaptive {sp['adaptive_vs_plain']:.2f}x plain"
                  + (f", {sp['adaptive_vs_best_fixed']:.2f}x {sp['best_fixed']}" if "best_fixed" in sp else ""))
    ax0.tick_params(axis="x", rotation=30)
    for m in modes:
        steps = result["steps_last_round"][m]
        if not steps:
            continue
        t0 = steps[0]["t"] - steps[0]["step_s"]
        # Tokens per second over windows of 20 steps.
        xs, ys = [], []
        for i in range(0, len(steps), 20):
            w = steps[i:i + 20]
            sec = sum(s["step_s"] for s in w)
            if sec > 0:
                xs.append(w[-1]["t"] - t0)
                ys.append(sum(s["emitted"] for s in w) / sec)
        ax1.plot(xs, ys, label=m, lw=2 if m in ("plain", "adaptive") else 1)
        bb = result["by_batch"][m]
        ax2.plot([int(b) for b in bb], list(bb.values()), marker="o", label=m)
    ax1.set_xlabel("time in the last round (s)")
    ax1.set_ylabel("tokens / s")
    ax1.set_yscale("log")
    ax1.legend(fontsize=8)
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.set_xlabel("running batch size (bin)")
    ax2.set_ylabel("decode tokens / s")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def deep_target(layers: int) -> str:
    """The task's SFT target at ``layers`` decoder layers, built once and cached like the recipe's."""
    from tlt_verl.launch.runner import DEFAULT_HOME
    from tlt_verl.task.prepare import assets_dirname, prepare, settings_for_layers

    return str(prepare(DEFAULT_HOME / assets_dirname(layers), settings=settings_for_layers(layers),
                       log=log)["model"])


def train_drafter(args, work: Path) -> str:
    # One folder per target and budget: a drafter only fits the target it was trained on.
    out = work / f"drafter_{args.method}_{Path(args.target).parent.name}_{args.train_prompts}p_{args.train_s}s"
    if not (out / "model.safetensors").exists():
        log(f"training an {args.method} drafter for {args.train_s}s")
        subprocess.run([sys.executable, "-m", "tlt_verl.cli", "drafter", "warmup", "--target", args.target,
                        "--out", str(out), "--kind", args.method, "--budget-s", str(args.train_s),
                        "--prompts", str(args.train_prompts), "--generator", "vllm"],
                       check=True, cwd=str(REPO))
    return str(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None, help="an HF target folder (default: the recipe's SFT model)")
    ap.add_argument("--target-layers", type=int, default=None,
                    help="use the task's SFT target at this depth instead (built and cached on first use)")
    ap.add_argument("--drafter", default=None, help="an exported drafter folder (vLLM layout)")
    ap.add_argument("--method", default="eagle", choices=("eagle", "eagle3"))
    ap.add_argument("--train-s", type=int, default=120)
    ap.add_argument("--train-prompts", type=int, default=256, help="task prompts whose responses train the drafter")
    ap.add_argument("--work", default="/tmp/tlt-bench-longtail")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--max-model-len", type=int, default=1536)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arms", type=int, nargs="+", default=None, help="the bandit's arms (default: the policy's)")
    ap.add_argument("--threshold", type=int, default=None)
    ap.add_argument("--steps-per-pull", type=int, default=8)
    ap.add_argument("--adaptive", nargs="+", default=None, metavar="VALUES:EXPLORE[:START]",
                    help="sd.values:bandit.explore[:bandit.start] of each adaptive mode, the first is `adaptive` "
                         "(default: the policy's)")
    ap.add_argument("--fixed", type=int, nargs="*", default=None, metavar="K",
                    help="the fixed-k modes run beside plain and adaptive (default: every arm above 0; none: --fixed)")
    ap.add_argument("--prompts", default="auto", choices=("auto", "task", "chat"),
                    help="task: the task's problems; chat: tlt_verl.task.chat_longtail through the target's chat "
                         "template (auto: task for the task's targets, chat for a pretrained LM)")
    ap.add_argument("--tail-batch", type=int, default=8,
                    help="steps at this running batch or below count as the tail phase, above as the crowded one")
    ap.add_argument("--step-size", type=float, default=None,
                    help="the bandit's step_size (default: its running mean)")
    ap.add_argument("--never-lose", action="store_true",
                    help="start SD with a scratch copy of --drafter, then push --drafter's weights (see above)")
    ap.add_argument("--rounds-after-push", type=int, default=2, help="with --never-lose: rounds after the push")
    ap.add_argument("--compile", action="store_true", help="torch.compile the models (vLLM's default; eager otherwise)")
    ap.add_argument("--out", default=str(REPO / "bench/results/longtail_rollout.json"))
    ap.add_argument("--phase-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    from tlt_verl.rollout.policy import SDPolicyConfig

    defaults = SDPolicyConfig()  # the policy as the rollout server runs it unless told otherwise
    args.threshold = defaults.threshold if args.threshold is None else args.threshold
    args.arms = list(defaults.bandit.arms) if args.arms is None else args.arms
    args.adaptive = args.adaptive or [f"{defaults.values}:{defaults.bandit.explore}"]
    for spec in args.adaptive:
        values, _, rest = spec.partition(":")
        explore, _, start = rest.partition(":")
        try:
            SDPolicyConfig(values=values, bandit={"explore": explore, **({"start": start} if start else {})})
        except (TypeError, ValueError) as e:
            ap.error(f"--adaptive {spec}: {e}")
    if args.phase_out:  # the child: the parent passes the target it resolved as --target
        Path(args.phase_out).write_text(json.dumps(asyncio.run(run_engines(args))))
        return
    if args.target is not None and args.target_layers is not None:
        ap.error("give --target or --target-layers, not both")
    if args.target is None:
        args.target = deep_target(args.target_layers) if args.target_layers else str(DEFAULT_TARGET)
    if not (Path(args.target) / "config.json").is_file():
        ap.error(f"--target {args.target}: not an HF model folder (no config.json)")
    if args.drafter is not None and not (Path(args.drafter) / "model.safetensors").is_file():
        ap.error(f"--drafter {args.drafter}: not an exported drafter folder (no model.safetensors)")
    if args.never_lose and args.drafter is None:
        ap.error("--never-lose: needs --drafter (the trained drafter pushed after the scratch rounds)")
    if args.rounds_after_push < 0:
        ap.error(f"--rounds-after-push {args.rounds_after_push}: must be >= 0")
    if args.prompts == "auto":
        args.prompts = default_prompts(args.target)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.drafter is None:
        args.drafter = train_drafter(args, work)
    # The engines run in a child with private vLLM sockets and caches (see bench/drafter_acceptance.py).
    scratch = work / "scratch"
    (scratch / "tmp").mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, TLT_SCRATCH=str(scratch), TMPDIR=str(scratch / "tmp"), PYTHONUNBUFFERED="1")
    raw_path = work / "raw.json"
    subprocess.run([sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]),
                    "--target", args.target, "--drafter", args.drafter, "--prompts", args.prompts,
                    "--phase-out", str(raw_path)], env=env, check=True, cwd=str(REPO))
    result = analyse(json.loads(raw_path.read_text()), args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    s = result["speedup"]
    same = all(v["identical_to_plain"] == v["requests"] for v in result["modes"].values())
    t = result["throughput_speedup"]
    def against(r: dict, m: str) -> str:
        best = f", {r[f'{m}_vs_best_fixed']:.2f}x the best fixed ({r['best_fixed']})" if "best_fixed" in r else ""
        return f"{r[f'{m}_vs_plain']:.2f}x plain{best}"

    log(f"bench: adaptive {against(s, 'adaptive')}; decode throughput {against(t, 'adaptive')}; "
        f"T={args.temperature} outputs identical to plain: {same}; -> {out}")
    for m in result["modes"]:
        if m.startswith("adaptive_"):
            log(f"bench: {m} {against(s, m)}; decode throughput {against(t, m)}")
    ph = result["phases_vs_plain"]["adaptive"]
    log("bench: adaptive over plain by phase (tokens/s): " + ", ".join(
        f"{p} {v['tokens_per_s']:.2f}x" for p, v in ph.items()) + f" (tail: running batch <= {args.tail_batch})")
    if args.never_lose:
        nl = result["never_lose"]
        after = nl["after_push"]
        log(f"bench: never lose: scratch drafter, adaptive {nl['adaptive_vs_plain']:.2f}x plain "
            f"(goal {NEVER_LOSE_GOAL}: {'met' if nl['met'] else 'NOT met'}), SD step share per round "
            f"{[round(x, 2) for x in nl['sd_step_share_per_round']]}"
            + ("" if after is None else f"; arms at the push {after['arms_at_push']} (SD off: {after['sd_was_off']}); "
               f"after it: SD step share {[round(x, 2) for x in after['sd_step_share_per_round']]}, arms "
               f"{after['final_arms']}, SD back on: {after['sd_back_on']}, adaptive {after['adaptive_vs_plain']:.2f}x plain"))


if __name__ == "__main__":
    main()
