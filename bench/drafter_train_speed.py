"""Drafter training speed per device: DrafterTrainer steps/s and tokens/s on one workload.

    python bench/drafter_train_speed.py --devices cpu,cuda --out bench/results/drafter_train_speed.json

The workload is the task target's shape (tlt_verl.task.tiny_model defaults: hidden 128, 4 layers,
vocabulary 320) with random weights and random sequences of response-like lengths, captured through
the same capture code as a run. Training speed does not depend on what the weights or tokens are,
so no SFT is needed and the same workload runs on any machine. Per device: the warm-up (first
steps, kernel compilation) apart from a timed window of steps, and a torch.profiler table of the
operators that take the window's time, so that a slow device says where its time goes.

On CUDA, arm ``sdpa_default`` runs the drafter's attention as it was before TLT chose its CUDA
path (tlt_verl/drafter/layers.py): SDPA's own backend choice (cuDNN on an H200) and the CPU's
per-chunk key selection; ``tlt`` is the path a run takes. Same workload, same seed, one process.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def workload(n_samples: int, seed: int = 0):
    """(target, captured records) for the task target's shape, on the CPU."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=320, max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(seed)
    target = Qwen2ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    # Prompts of about 40 tokens and responses with the task's long tail (most short, a few long).
    lengths = (40 + torch.distributions.Exponential(torch.tensor(1 / 90.0)).sample((n_samples,)).clamp(max=900)).long()
    seqs = [torch.randint(0, cfg.vocab_size, (int(n),), generator=g).tolist() for n in lengths]
    return target, seqs


ARMS = {"tlt": {}, "sdpa_default": {"CUDA_SDPA_BACKENDS": None, "DENSE_MASK_ON_CUDA": False}}


def measure(device: str, target, seqs, steps: int, warm: int, kind: str, arm: str = "tlt") -> dict:
    from tlt_verl.drafter import layers

    saved = {name: getattr(layers, name) for name in ARMS[arm]}
    for name, value in ARMS[arm].items():
        setattr(layers, name, value)
    try:
        return {"arm": arm, **_measure(device, target, seqs, steps, warm, kind)}
    finally:
        for name, value in saved.items():
            setattr(layers, name, value)


def _measure(device: str, target, seqs, steps: int, warm: int, kind: str) -> dict:
    from tlt_verl.capture import BufferConfig, DataBuffer, capture_samples
    from tlt_verl.drafter import DrafterConfig, build_drafter, target_tensors
    from tlt_verl.drafter.trainer import DrafterTrainer, TrainerConfig

    dcfg = DrafterConfig.from_target(target.config, kind=kind)
    recs = capture_samples(target, seqs, [40] * len(seqs), aux_layer_ids=dcfg.aux_layer_ids)
    buffer = DataBuffer(BufferConfig(kind=kind, budget_bytes=1 << 32))
    for r in recs:
        buffer.add(0, r["input_ids"], r["loss_mask"], r["final_hidden"], r["aux_hidden"])
    torch.manual_seed(0)
    drafter = build_drafter(dcfg, *target_tensors(target)).to(device)
    trainer = DrafterTrainer(drafter, buffer, TrainerConfig(lr=2e-3, tokens_per_micro=2048))
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    t0 = time.perf_counter()
    trainer.train(max_steps=warm)
    sync()
    warm_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    res = trainer.train(max_steps=steps)
    sync()
    seconds = time.perf_counter() - t0
    tokens = sum(h["tokens"] for h in res.history)
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=acts) as prof:
        trainer.train(max_steps=5)
        sync()
    averages = prof.key_averages()
    table = averages.table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60)
    if device.startswith("cuda"):
        table += "\n" + averages.table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60)
    return {"device": device, "threads": torch.get_num_threads(), "warm_steps": warm, "warm_s": round(warm_s, 2),
            "steps": res.steps, "seconds": round(seconds, 3), "steps_per_s": round(res.steps / seconds, 2),
            "tokens_per_s": round(tokens / seconds), "ms_per_step": round(1000 * seconds / res.steps, 1),
            "last_loss": res.history[-1]["loss"], "profile_top_cpu_time": table.splitlines()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", default="cpu")
    ap.add_argument("--kind", default="eagle3")
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warm", type=int, default=5)
    ap.add_argument("--threads", type=int, default=min(8, os.cpu_count() or 1))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, seqs = workload(args.samples)
    rows = []
    runs = [(d, arm) for d in args.devices.split(",") for arm in (("sdpa_default", "tlt") if d.startswith("cuda")
                                                                  else ("tlt",))]
    for device, arm in runs:
        row = measure(device, target, seqs, args.steps, args.warm, args.kind, arm)
        print(f"{device} ({arm}): {row['steps_per_s']} steps/s, {row['tokens_per_s']} tokens/s, {row['ms_per_step']} ms/step "
              f"(warm-up {row['warm_s']} s)", flush=True)
        print("\n".join(row["profile_top_cpu_time"]), flush=True)
        rows.append(row)
    out = {"what": "DrafterTrainer steps/s per device on the task target's shape (bench/drafter_train_speed.py)",
           "kind": args.kind, "samples": args.samples, "torch": torch.__version__, "rows": rows}
    by = {(r["device"], r["arm"]): r for r in rows}
    for (device, arm), r in by.items():
        if arm == "tlt" and (device, "sdpa_default") in by:
            out[f"{device}_tlt_over_sdpa_default_steps_per_s"] = round(
                r["steps_per_s"] / by[(device, "sdpa_default")]["steps_per_s"], 2)
    if ("cuda", "tlt") in by and ("cpu", "tlt") in by:
        out["cuda_over_cpu_steps_per_s"] = round(by[("cuda", "tlt")]["steps_per_s"] / by[("cpu", "tlt")]["steps_per_s"], 2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
