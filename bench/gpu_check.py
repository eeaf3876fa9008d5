"""GPU check: everything in tlt-verl that only a GPU can show, in one run of at most 8 minutes.

    bash bench/gpu_check.sh [--out bench/results/gpu_check.json]     # on one GPU (an H200)
    bash bench/gpu_check.sh --cpu-dry-run --out /tmp/gpu_check.json  # here: what a CPU can run

Parts, each in a process of its own under its own time budget (a part that fails, hangs or
leaves its GPU memory behind cannot take the others with it), in this order:

  stack        versions (torch, CUDA, vLLM, verl, GPU); without the GPU stack nothing else runs
  sft          part 1: the task and its SFT target, trained on the GPU (tlt_verl.task.prepare)
  kernels      part 4: Triton soft-CE and flash-attn varlen packing against torch references
  recipe       part 2: recipes/tiny_gpu_grpo.sh with TLT for 3 steps via `tlt run`
  sd_decode    part 3: plain vs SD decode tokens/s by batch size (bench/sd_threshold.py), with a
               briefly warmed drafter
  cuda_graphs  part 5: CUDA-graph memory of an SD engine with TLT's per-strategy capture sizes
               against vLLM's default list
  spot         the Spot Trainer's drafter service training on the device (NCCL on a GPU) on the
               target's own sampled responses, captured there; its export scored on the CPU

Without vLLM, verl or Ray (a bare GPU image with torch alone) the parts that need only torch
(sft, kernels, spot) still run; the others are skipped with the stack's one line.

One JSON comes out (written again after every part, so a run cut short still leaves one): per
part its status (ok / failed / skipped), wall time, budget and numbers, a failure's last log
lines. The GPU box has no network: nothing here downloads anything.

`--cpu-dry-run` runs what a CPU can with tiny sizes (the cached CPU assets instead of an SFT
run, soft-CE's torch path, a two-batch-size decode bench) and builds and validates what it
cannot run (the GPU recipe composed under verl's Hydra schema, both CUDA-graph engines'
arguments); tests/test_gpu_check.py runs it.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import resource
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench import portable  # noqa: E402

OK, FAILED, SKIPPED = "ok", "failed", "skipped"
GPU_RECIPE = "tiny_gpu_grpo"
RECIPE_STEPS = 3
# The engines of part 5: a GPU rollout's batch (the 7B recipe's max_num_seqs) and token budget.
GRAPH_MAX_SEQS, GRAPH_MAX_TOKENS = 256, 8192


def tail(text: str, n: int = 15) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()][-n:]


def log_tail(path: Path, n: int = 15) -> list[str]:
    return tail(path.read_text(errors="replace"), n) if path.exists() else []


def run_logged(cmd: list[str], log: Path, timeout_s: float, env: dict | None = None,
               cwd: Path = REPO) -> tuple[int | None, float]:
    """Run ``cmd`` with its output in ``log``; (exit code or None when it ran out of time, seconds).
    The command gets a process group of its own, and all of that group ends with it."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
                                env=env or os.environ.copy(), start_new_session=True)
        try:
            rc = proc.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            rc = None
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                continue
    return rc, round(time.time() - t0, 1)


def shown(arg: str) -> str:
    """A command-line argument as the JSON records it: paths repo-relative, or by name."""
    key, eq, value = arg.rpartition("=") if "=" in arg else ("", "", arg)
    if not os.path.isabs(value):
        return arg
    p = Path(value)
    return key + eq + (str(p.relative_to(REPO)) if p.is_relative_to(REPO) else p.name)


def remaining(ctx: dict, margin_s: float = 5.0) -> float:
    return ctx["part_deadline"] - time.time() - margin_s


def child_env(ctx: dict, **extra) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TLT_HOME=ctx["home"], **extra)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


# ---------------------------------------------------------------------------- stack

# What the recipe and the engine parts need beyond torch and transformers.
SERVING_STACK = ("vllm", "verl", "ray")
DISTRIBUTIONS = {"vllm": "vllm", "verl": "verl", "transformers": "transformers", "ray": "ray",
                 "triton": "triton", "flash_attn": "flash-attn", "tlt_verl": "tlt-verl"}


def _dist_version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def part_stack(ctx: dict) -> dict:
    """Versions, and whether the GPU stack is there. No torch, or no CUDA device on a GPU run, ends
    the check; without vLLM, verl or Ray (a bare GPU image) only the parts that need them skip.
    The entry points through which verl and vLLM load TLT exist only once tlt-verl is installed;
    that install needs no network (--no-deps, --no-index), so it is done here when missing."""
    versions: dict = {"python": platform.python_version()}
    out: dict = {"versions": versions}
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - any import failure means the stack is not usable
        return {**out, "status": FAILED, "error": [f"GPU stack missing: torch does not import ({e})"]}
    versions.update(torch=torch.__version__, cuda=torch.version.cuda)
    versions.update({name: _dist_version(dist) for name, dist in DISTRIBUTIONS.items()})
    versions["tlt_verl_commit"] = _git_commit()
    if versions["transformers"] is None:
        return {**out, "status": FAILED, "error": ["GPU stack missing: transformers; install it with "
                                                   "`pip install -r requirements/gpu.txt` (this script downloads nothing)"]}
    if ctx["mode"] == "gpu" and not torch.cuda.is_available():
        return {**out, "status": FAILED, "error": [
            f"no CUDA device visible to torch {torch.__version__} (CUDA build {torch.version.cuda}); "
            "on a CPU box use --cpu-dry-run"]}
    missing = [n for n in SERVING_STACK if versions[n] is None]
    if not missing and ctx["mode"] == "gpu":
        # Installed does not mean importable (a CPU wheel, a missing CUDA library). The dry run
        # spares itself this 10-second import: its later parts import vLLM anyway.
        try:
            import vllm  # noqa: F401
        except Exception as e:  # noqa: BLE001
            missing = [f"vllm does not import ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})"]
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        versions["cudnn"] = torch.backends.cudnn.version()
        versions["gpu"] = {"name": props.name, "count": torch.cuda.device_count(),
                           "memory_gib": round(props.total_memory / 2**30, 1),
                           "capability": f"{props.major}.{props.minor}", "driver": _driver_version()}
    if versions["tlt_verl"] is None and ctx["mode"] == "gpu":
        rc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                             "--no-build-isolation", "-e", str(REPO)], capture_output=True, text=True)
        out["installed_tlt_verl"] = rc.returncode == 0
        if rc.returncode != 0:
            return {**out, "status": FAILED,
                    "error": ["tlt-verl is not installed and `pip install --no-deps --no-index -e .` failed"]
                    + tail(rc.stderr, 5)}
    if versions["tlt_verl"] is None and not out.get("installed_tlt_verl"):
        return {**out, "status": FAILED, "error": ["tlt-verl is not installed: `pip install --no-deps -e .`"]}
    if missing:
        line = (f"GPU stack missing: {', '.join(missing)}; install it with `pip install -r requirements/gpu.txt "
                "&& pip install --no-deps -e .` (this script downloads nothing)")
        return {**out, "status": FAILED, "error": [line], "provides": {"serving_stack_missing": line}}
    return {**out, "status": OK}


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


# ---------------------------------------------------------------------------- part 1: SFT target

def part_sft(ctx: dict) -> dict:
    """On a GPU: the task's assets with the default recipe's SFT (so `tlt run` later finds them
    up to date), its updates run on the GPU. Dry run: the cached CPU assets, never a 15-minute CPU
    SFT, and ten SFT updates through the same code on the CPU."""
    from tlt_verl.task.prepare import PrepareSettings, prepare, stale_stages

    root = Path(ctx["home"]) / "assets"
    out: dict = {"assets": portable(root)}
    if ctx["mode"] == "gpu":
        settings = PrepareSettings()
        settings = replace(settings, sft=replace(settings.sft, device="cuda"))
    else:
        settings = PrepareSettings()
        stale = stale_stages(root, settings)
        if stale:
            return {**out, "status": FAILED, "error": [
                f"no up-to-date CPU assets under {root} (stale: {', '.join(stale)}); build them with ./tlt prepare"]}
    lines: list[str] = []

    def log(msg: str) -> None:
        print(msg, flush=True)
        lines.append(msg)

    paths = prepare(root, settings=settings, log=log)
    info = paths["report"]["model"]["info"]
    out["stages"] = {k: {"status": v["status"], "elapsed_s": v["elapsed_s"]} for k, v in paths["report"].items()}
    out["model"] = {k: info.get(k) for k in ("steps", "tokens", "train_s", "parameters", "final_loss", "device")}
    if info.get("steps") and info.get("train_s"):
        out["model"]["updates_per_s"] = round(info["steps"] / info["train_s"], 1)
    accuracy = [ln for ln in lines if "held-out teacher-forced accuracy" in ln]
    if accuracy:
        out["model"]["last_teacher_forced"] = accuracy[-1].split("accuracy: ", 1)[-1]
    if ctx["mode"] != "gpu":
        out["smoke"] = _sft_smoke(paths["tokenizer"], Path(ctx["work"]) / "sft_smoke")
    loss = info.get("final_loss")
    healthy = bool(info.get("steps")) and loss is not None and loss == loss and loss < 1.0
    out["provides"] = {"model": str(paths["model"]), "tokenizer": str(paths["tokenizer"])}
    if not healthy:
        return {**out, "status": FAILED, "error": [f"SFT model looks untrained: {out['model']}"]}
    return {**out, "status": OK}


def _sft_smoke(tokenizer_dir: Path, out_dir: Path) -> dict:
    from transformers import AutoTokenizer

    from tlt_verl.task.sft import SFTConfig, train_sft

    cfg = SFTConfig(max_steps=10, num_examples=64, eval_every=0, threads=1, device="cpu")
    info = train_sft(AutoTokenizer.from_pretrained(tokenizer_dir), out_dir, cfg, log=lambda m: print(m, flush=True))
    return {k: info[k] for k in ("steps", "final_loss", "device")}


# ---------------------------------------------------------------------------- part 4: kernels

def _max_diffs(got, ref) -> tuple[dict, dict]:
    diff = {k: float((got[k].float() - ref[k].float()).abs().max()) for k in ref}
    scale = {k: float(ref[k].float().abs().max()) for k in ref}
    return diff, scale


def check_soft_ce(device: str, backend: str, n: int, h: int, v: int, chunks: tuple[int, int],
                  dtype: str = "float32") -> dict:
    """Loss and both gradients of the chunked kernel against the naive full-logits loss in fp32 on
    the same values (in ``dtype``, as the kernel gets them), with an uneven upstream gradient; on
    CUDA also both versions' peak memory."""
    import torch

    from tlt_verl.kernels.soft_ce import naive_soft_cross_entropy, soft_cross_entropy

    low = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    # Rounded to ``dtype`` once: the reference then differs only in how it computes, not in its inputs.
    values = [(torch.randn(*s, generator=g) * 0.5).to(device, low).float() for s in ((n, h), (v, h), (n, h), (v, h))]
    upstream = torch.linspace(-1, 2, n, device=device)
    cuda = device.startswith("cuda")

    def run(fn, dt) -> tuple[dict, dict]:
        hidden, weight = (values[i].to(dt, copy=True).requires_grad_() for i in (0, 1))
        t_hidden, t_weight = values[2].to(dt), values[3].to(dt)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        loss = fn(hidden, weight, target_hidden=t_hidden, target_weight=t_weight)
        (loss * upstream).sum().backward()
        if cuda:
            torch.cuda.synchronize()
        out = {"loss": loss.detach(), "d_hidden": hidden.grad, "d_weight": weight.grad}
        stats = {"seconds": time.perf_counter() - t0}
        if cuda:
            stats["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        return out, stats

    token_chunk, vocab_chunk = chunks
    chunked = lambda *a, **k: soft_cross_entropy(*a, token_chunk=token_chunk, vocab_chunk=vocab_chunk,  # noqa: E731
                                                 backend=backend, **k)
    run(chunked, low)  # compiles the Triton kernels outside the timing
    got, got_stats = run(chunked, low)
    ref, ref_stats = run(naive_soft_cross_entropy, torch.float32)
    diff, scale = _max_diffs(got, ref)
    # In fp32 only summation order differs: 1e-4 of a tensor's largest value is far above rounding.
    # In bf16 the tile matmuls round each logit (2^-9 of up to ~25 here), so 5% of the largest value;
    # an indexing or masking error is of the order of the values themselves either way.
    rtol = 1e-4 if dtype == "float32" else 0.05
    ok = all(diff[k] <= rtol * max(scale[k], 1.0) for k in diff)
    out = {"status": OK if ok else FAILED, "backend": backend, "dtype": dtype,
           "shape": {"tokens": n, "hidden": h, "vocab": v}, "chunks": list(chunks), "max_abs_diff": diff,
           "max_abs_ref": scale, "seconds": {"chunked": round(got_stats["seconds"], 4),
                                             "naive": round(ref_stats["seconds"], 4)}}
    if cuda:
        out["peak_mib"] = {"chunked": round(got_stats["peak_mib"], 1), "naive": round(ref_stats["peak_mib"], 1)}
    return out


def check_flash_varlen(device: str) -> dict:
    """The EAGLE loss over packed rows with flash-attn varlen (cu_seqlens) against the SDPA
    block-diagonal mask, both in bf16, and each against SDPA in fp32. Passes when flash is no
    further from fp32 than bf16 SDPA is, give or take a factor of two."""
    from tlt_verl.drafter.layers import flash_attn_varlen_func

    if not device.startswith("cuda"):
        return {"status": SKIPPED, "reason": "needs a CUDA device"}
    if flash_attn_varlen_func is None:
        return {"status": SKIPPED, "reason": "flash_attn is not installed"}
    import copy

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tlt_verl.drafter import DrafterConfig, LossConfig, build_drafter, target_tensors
    from tlt_verl.drafter.loss import drafter_loss
    from tlt_verl.drafter.packing import PackedBatch, align_sample, pack
    cfg = Qwen2Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=1024, max_position_embeddings=1024,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    target = Qwen2ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(0)
    samples = []
    with torch.no_grad():
        for length in (200, 37, 150, 90, 311, 64, 128, 17, 250):
            ids = torch.randint(0, cfg.vocab_size, (length,), generator=g)
            hidden = target(ids[None], output_hidden_states=True).hidden_states[-1][0]
            samples.append(align_sample(ids, hidden, (torch.arange(length) >= 8).float()))
    packed = pack(samples, 512)
    batch = PackedBatch({k: t.to(device) for k, t in packed.tensors.items()},
                        packed.position_ids.to(device), packed.seq_ids.to(device))
    torch.manual_seed(1)
    base = build_drafter(DrafterConfig.from_target(cfg, kind="eagle"), *target_tensors(target))

    def run(dtype, attention) -> dict:
        drafter = copy.deepcopy(base).to(device=device, dtype=dtype)
        loss, _ = drafter_loss(drafter, batch, LossConfig(attention=attention))
        loss.backward()
        out = {"loss": loss.detach()}
        out.update({f"grad:{n}": p.grad.detach() for n, p in drafter.named_parameters() if p.grad is not None})
        return out

    ref = run(torch.float32, "sdpa")
    sdpa, flash = run(torch.bfloat16, "sdpa"), run(torch.bfloat16, "flash_varlen")
    worst = lambda d, s: max(d[k] / max(s[k], 1e-6) for k in d)  # noqa: E731 - largest relative error
    flash_ref, scale = _max_diffs(flash, ref)
    sdpa_ref, _ = _max_diffs(sdpa, ref)
    flash_sdpa, _ = _max_diffs(flash, sdpa)
    ok = worst(flash_ref, scale) <= 2 * worst(sdpa_ref, scale) + 1e-3
    return {"status": OK if ok else FAILED, "rows": int(packed.seq_ids.shape[0]), "samples": len(samples),
            "max_abs_diff": {"flash_bf16_vs_sdpa_fp32": flash_ref, "sdpa_bf16_vs_sdpa_fp32": sdpa_ref,
                             "flash_bf16_vs_sdpa_bf16": flash_sdpa},
            "worst_relative": {"flash_bf16": worst(flash_ref, scale), "sdpa_bf16": worst(sdpa_ref, scale)}}


def part_kernels(ctx: dict) -> dict:
    import torch

    gpu = ctx["mode"] == "gpu"
    device = "cuda" if gpu else "cpu"
    torch.set_num_threads(1 if not gpu else min(8, os.cpu_count() or 1))
    # The references are fp32: no TF32 in their matmuls (the default, made explicit).
    torch.backends.cuda.matmul.allow_tf32 = False
    checks = {}
    if gpu:
        # A drafter-sized problem: 4k tokens, a 32k vocabulary, both tile axes uneven.
        shape = (4100, 256, 32003, (1024, 4096))
        for backend in ("triton", "torch"):
            checks[f"soft_ce_{backend}"] = check_soft_ce(device, backend, *shape)
        # What the drafter trains with under bf16 autocast.
        checks["soft_ce_triton_bf16"] = check_soft_ce(device, "triton", *shape, dtype="bfloat16")
    else:
        # Uneven tiles on both axes: the last token and vocabulary tiles are partial.
        checks["soft_ce_torch"] = check_soft_ce(device, "torch", 257, 32, 1001, (64, 256))
    checks["flash_varlen"] = check_flash_varlen(device)
    failed = [k for k, c in checks.items() if c["status"] == FAILED]
    out = {"status": FAILED if failed else OK, "device": device, "checks": checks}
    if failed:
        out["error"] = [f"{k}: max abs diff {checks[k]['max_abs_diff']}" for k in failed]
    return out


# ---------------------------------------------------------------------------- part 2: the recipe

def _recipe_command(ctx: dict, run_dir: Path) -> tuple[list[str], dict]:
    """What `tlt run --recipe tiny_gpu_grpo --steps 3` runs (launch/runner.py), and its env."""
    from tlt_verl.launch.runner import RunConfig

    cfg = RunConfig(recipe=GPU_RECIPE, steps=RECIPE_STEPS, tlt=True, drafter_init="scratch")
    cmd = ["bash", str(cfg.recipe_path()), f"hydra.run.dir={run_dir / 'hydra'}", *cfg.all_overrides()]
    return cmd, {"ATTN": "flash_attention_2" if _has_flash_attn() else "sdpa", "STEPS": str(RECIPE_STEPS)}


def _has_flash_attn() -> bool:
    try:
        import flash_attn  # noqa: F401
        return True
    except Exception:  # noqa: BLE001
        return False


def validate_recipe(ctx: dict, run_dir: Path) -> dict:
    """The recipe's config as verl composes it (`--cfg job`), checked for what the GPU run needs."""
    import yaml

    from tlt_verl.integration.config import TLTConfig

    cmd, extra = _recipe_command(ctx, run_dir)
    assets = Path(ctx["home"]) / "assets"
    env = child_env(ctx, MODEL=ctx["model"], TRAIN=str(assets / "data" / "train.parquet"),
                    VAL=str(assets / "data" / "val.parquet"), **extra)
    run_dir.mkdir(parents=True, exist_ok=True)
    res = subprocess.run([*cmd, "--cfg", "job"], cwd=run_dir, env=env, capture_output=True, text=True,
                         timeout=max(30.0, remaining(ctx)))
    if res.returncode != 0:
        raise RuntimeError("recipe does not compose:\n" + "\n".join(tail(res.stderr)))
    cfg = yaml.safe_load(res.stdout)
    rollout, trainer = cfg["actor_rollout_ref"]["rollout"], cfg["trainer"]
    tlt = TLTConfig.from_dict(cfg["tlt"])
    checks = {"n_gpus_per_node": trainer["n_gpus_per_node"] == 1,
              "steps": trainer["total_training_steps"] == RECIPE_STEPS,
              "rollout": rollout["name"] == "tlt_vllm" and rollout["tensor_model_parallel_size"] == 1,
              "gpu_memory_utilization": rollout["gpu_memory_utilization"] == 0.4,
              "actor_fsdp2": cfg["actor_rollout_ref"]["actor"]["strategy"] == "fsdp2",
              "tlt": tlt.enable and tlt.drafter.init == "scratch"}
    return {"command": [shown(c) for c in cmd], "env": extra, "checks": checks,
            "attn_implementation": cfg["actor_rollout_ref"]["model"]["override_config"]["attn_implementation"]}


def _read_jsonl_metrics(path: Path) -> dict[int, dict]:
    out = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                d = json.loads(line)
                out[int(d["step"])] = d["data"]
            except (ValueError, KeyError):
                continue
    return out


def summarize_recipe_run(run_dir: Path) -> dict:
    """Per step: verl's timings, the weight-sync and rollout-vs-actor log-prob figures, every
    tlt/ metric; from verl's own metrics file, so a run cut short still reports its steps."""
    metrics = _read_jsonl_metrics(run_dir / "metrics.jsonl")
    steps = []
    for s in sorted(metrics):
        m = metrics[s]
        steps.append({"step": s,
                      "timing_s": {k.split("/", 1)[1]: round(v, 3) for k, v in m.items() if k.startswith("timing_s/")},
                      "reward_mean": m.get("critic/score/mean"),
                      "response_length_max": m.get("response_length/max"),
                      "rollout_probs_diff": {k: v for k, v in m.items() if k.startswith("training/rollout_probs_diff")},
                      "tlt": {k: v for k, v in m.items() if k.startswith("tlt/")}})
    out = {"steps_done": len(steps), "steps": steps}
    if (run_dir / "steps.json").exists():
        out["runner_summary"] = json.loads((run_dir / "steps.json").read_text())["summary"]
    return out


def part_recipe(ctx: dict) -> dict:
    run_dir = Path(ctx["work"]) / "recipe"
    validated = validate_recipe(ctx, run_dir)
    if not all(validated["checks"].values()):
        return {"status": FAILED, "validated": validated,
                "error": [f"recipe config check failed: {[k for k, v in validated['checks'].items() if not v]}"]}
    if ctx["mode"] != "gpu":
        return {"status": SKIPPED, "reason": "needs a GPU", "validated": validated}
    from tlt_verl.utils.own_ray import OwnRay

    ray = OwnRay()
    # A drafter from scratch: `tlt run`'s default warm drafter would spend two minutes training.
    cli = [sys.executable, "-m", "tlt_verl.cli", "run", "--recipe", GPU_RECIPE, "--steps", str(RECIPE_STEPS),
           "--drafter", "scratch", "--run-dir", str(run_dir)]
    env = child_env(ctx, **validated["env"], **ray.env)
    env.pop("RAY_ADDRESS", None)
    log = Path(ctx["work"]) / "logs" / "recipe_cli.log"
    try:
        rc, seconds = run_logged(cli, log, remaining(ctx, 20.0), env=env)
    finally:
        ended = len(ray.stop())
    out = {"validated": validated, "rc": rc, "seconds": seconds, "ray_processes_ended": ended,
           "command": ["tlt", "run", *cli[4:-2]],
           **summarize_recipe_run(run_dir)}
    if rc == 0 and out["steps_done"] == RECIPE_STEPS:
        return {**out, "status": OK}
    why = "timed out" if rc is None else f"exit code {rc}"
    return {**out, "status": FAILED, "error": [f"tlt run {why} after {out['steps_done']} of {RECIPE_STEPS} steps"]
            + log_tail(log) + log_tail(run_dir / "verl.log", 10)}


# ---------------------------------------------------------------------------- part 3: SD decode speed

def _warm_drafter(ctx: dict, out: Path, gpu: bool) -> tuple[dict, Path | None]:
    """A drafter warmed on the target's own responses (`tlt drafter warmup`), within a small
    budget; on the GPU the responses come from vLLM, on the CPU from a handful of HF samples."""
    sizes = (["--generator", "vllm", "--prompts", "128", "--max-new-tokens", "384", "--budget-s", "15"] if gpu
             else ["--generator", "hf", "--prompts", "2", "--max-new-tokens", "16", "--budget-s", "1"])
    cmd = [sys.executable, "-m", "tlt_verl.cli", "drafter", "warmup", "--target", ctx["model"],
           "--out", str(out), "--kind", "eagle", *sizes]
    log = Path(ctx["work"]) / "logs" / "drafter_warmup.log"
    rc, seconds = run_logged(cmd, log, remaining(ctx) / 2, env=child_env(ctx))
    if rc != 0:
        return {"status": FAILED, "seconds": seconds, "error": log_tail(log, 8)}, None
    report = json.loads((out / "warmup_report.json").read_text())
    return {"status": OK, "seconds": seconds, "generation": report["generation"],
            "training": report["training"]}, out


def summarize_sd(result: dict) -> dict:
    """Per batch size: plain tokens/s, each k's tokens/s and acceptance, the best k's speed-up."""
    rows = {}
    for p in result["plain"]:
        rows[p["batch"]] = {"plain_wall_tok_s": round(p["wall_tok_s"], 1),
                            "plain_decode_step_ms": round(p["decode_step_ms"], 3), "sd": {}}
    for r in result["sd"]:
        drafts = r["draft_tokens"]
        rows[r["batch"]]["sd"][str(r["k"])] = {
            "wall_tok_s": round(r["wall_tok_s"], 1), "decode_step_ms": round(r["decode_step_ms"], 3),
            "acceptance_rate": round(r["accepted"] / drafts, 3) if drafts else None}
    for row in rows.values():
        drafting = {k: v for k, v in row["sd"].items() if k != "0"}
        if drafting:
            best = max(drafting, key=lambda k: drafting[k]["wall_tok_s"])
            row["best_k"] = int(best)
            row["best_sd_speedup"] = round(drafting[best]["wall_tok_s"] / row["plain_wall_tok_s"], 3)
    return {str(b): rows[b] for b in sorted(rows)}


def part_sd_decode(ctx: dict) -> dict:
    gpu = ctx["mode"] == "gpu"
    work = Path(ctx["work"])
    warm, drafter = _warm_drafter(ctx, work / "drafter_warm", gpu)
    # A failed warm-up is reported, not fatal: the cost side (step times) is the same with a random drafter.
    out = {"drafter_warmup": warm, "drafter": "warmed" if drafter else "random (the warm-up failed)"}
    result_path = work / "sd_threshold.json"
    # Best of three per row on the GPU: a row's first run pays lazy set-up (the rejection
    # sampler's Triton kernels compile at the first drafted step).
    sizes = (["--sizes", "1,8,32,64", "--max-k", "4", "--tokens", "64", "--repeats", "3", "--gpu"] if gpu
             else ["--sizes", "1,2", "--max-k", "2", "--tokens", "8", "--repeats", "1"])
    cmd = [sys.executable, str(REPO / "bench" / "sd_threshold.py"), "--model", ctx["model"], "--prompts", "task",
           "--out", str(result_path), *sizes, *(["--drafter", str(drafter)] if drafter else [])]
    out["command"] = [shown(c) for c in cmd[1:]]
    log = work / "logs" / "sd_threshold.log"
    rc, seconds = run_logged(cmd, log, remaining(ctx), env=child_env(ctx))
    out["seconds"] = seconds
    if rc != 0 or not result_path.exists():
        return {**out, "status": FAILED, "error": [f"sd_threshold {'timed out' if rc is None else f'exit code {rc}'}"]
                + log_tail(log)}
    result = json.loads(result_path.read_text())
    out["by_batch"] = summarize_sd(result)
    if drafter:
        out["provides"] = {"drafter": str(drafter)}   # part 5's engines serve the same drafter
    sane = all(r["plain_wall_tok_s"] > 0 and all(v["wall_tok_s"] > 0 for v in r["sd"].values())
               for r in out["by_batch"].values())
    if not sane:
        return {**out, "status": FAILED, "error": ["a tokens/s figure is 0"]}
    return {**out, "status": OK}


# ---------------------------------------------------------------------------- part 5: CUDA graphs

def graph_engine_kwargs(drafter: str, arm: str) -> dict:
    """The SD engine as the rollout server builds it on a GPU (engine/server.py): the drafter
    under the adaptive policy's speculative config; `pool` adds TLT's per-strategy capture sizes
    (rollout/config.py), `default` leaves vLLM its own list."""
    from tlt_verl.rollout.config import AdaptiveRolloutConfig, cuda_graph_engine_args

    cfg = AdaptiveRolloutConfig(drafter=drafter)
    kwargs = dict(dtype="bfloat16", enforce_eager=False, skip_tokenizer_init=True, max_model_len=2048,
                  max_num_seqs=GRAPH_MAX_SEQS, max_num_batched_tokens=GRAPH_MAX_TOKENS,
                  speculative_config=cfg.speculative_config(GRAPH_MAX_SEQS))
    if arm == "pool":
        kwargs.update(cuda_graph_engine_args(cfg, GRAPH_MAX_SEQS, GRAPH_MAX_TOKENS, on_gpu=True))
    return kwargs


def _record_graph_capture() -> list[dict]:
    """Each model runner's capture_model returns the device memory its graphs took (free memory
    before minus after); record that and its time, not counting vLLM's profiling captures."""
    import importlib

    calls: list[dict] = []
    for module in ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner"):
        try:
            runner = importlib.import_module(module).GPUModelRunner
        except Exception:  # noqa: BLE001 - a vLLM without that runner
            continue
        original = runner.capture_model

        def capture_model(self, *args, _original=original, **kwargs):
            t0 = time.perf_counter()
            taken = _original(self, *args, **kwargs)
            if not kwargs.get("profile_only"):
                calls.append({"bytes": int(taken or 0), "seconds": round(time.perf_counter() - t0, 2)})
            return taken

        runner.capture_model = capture_model
    return calls


def graph_arm(ctx: dict, arm: str) -> dict:
    """One engine (one process): start it, read the graph memory and sizes, decode a few prompts."""
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from bench.sd_threshold import task_prompt_source
    from tlt_verl.rollout.engine.offline import offline_llm

    calls = _record_graph_capture()
    kwargs = graph_engine_kwargs(ctx["drafter"], arm)
    t0 = time.perf_counter()
    llm = offline_llm(ctx["model"], **kwargs)
    start_s = time.perf_counter() - t0
    sizes = list(llm.llm_engine.vllm_config.compilation_config.cudagraph_capture_sizes or [])
    make_prompts, _ = task_prompt_source(Path(ctx["model"]))
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in make_prompts(16, 0)],
                        SamplingParams(temperature=0, max_tokens=48, detokenize=False), use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return {"arm": arm, "engine_start_s": round(start_s, 1), "capture_sizes": sizes, "n_sizes": len(sizes),
            "graph_bytes": sum(c["bytes"] for c in calls), "capture_s": sum(c["seconds"] for c in calls),
            "torch_reserved_mib": round(torch.cuda.memory_reserved() / 2**20, 1),
            "output_sha256": hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]}


def _random_drafter(ctx: dict) -> str:
    from bench.sd_threshold import _random_drafter as make

    return str(make(Path(ctx["model"]), Path(ctx["work"]) / "drafter_random"))


def part_cuda_graphs(ctx: dict) -> dict:
    drafter = ctx.get("drafter") or _random_drafter(ctx)
    arms = {arm: graph_engine_kwargs(drafter, arm) for arm in ("pool", "default")}
    pool_sizes = arms["pool"]["compilation_config"]["cudagraph_capture_sizes"]
    config = {"max_num_seqs": GRAPH_MAX_SEQS, "max_num_batched_tokens": GRAPH_MAX_TOKENS,
              "speculative_config": {k: portable(v) for k, v in arms["pool"]["speculative_config"].items()},
              "pool_capture_sizes": pool_sizes, "pool_n_sizes": len(pool_sizes)}
    if ctx["mode"] != "gpu":
        from vllm.engine.arg_utils import EngineArgs

        for kwargs in arms.values():
            EngineArgs(model=ctx["model"], **kwargs)   # refuses unknown or mistyped fields
        return {"status": SKIPPED, "reason": "needs a GPU", "config": config, "validated": True}
    out: dict = {"config": config, "drafter": portable(drafter)}
    ctx = {**ctx, "drafter": drafter}
    (Path(ctx["work"]) / "graph_ctx.json").write_text(json.dumps(ctx))
    for arm in ("pool", "default"):
        log = Path(ctx["work"]) / "logs" / f"cuda_graphs_{arm}.log"
        result = Path(ctx["work"]) / f"cuda_graphs_{arm}.json"
        cmd = [sys.executable, "-m", "bench.gpu_check", "--graph-arm", arm, "--ctx",
               str(Path(ctx["work"]) / "graph_ctx.json"), "--result", str(result)]
        # The first engine leaves half of what is left to the second.
        rc, seconds = run_logged(cmd, log, remaining(ctx) / (2 if arm == "pool" else 1), env=child_env(ctx))
        if rc != 0 or not result.exists():
            out[arm] = {"status": FAILED, "seconds": seconds, "error": log_tail(log)}
            continue
        out[arm] = {"status": OK, **json.loads(result.read_text()), "seconds": seconds}
        # vLLM's own log line, to the 0.01 GiB it prints: a cross-check of the recorded bytes.
        said = re.findall(r"Graph capturing finished in \d+ secs, took ([\d.]+) GiB", log.read_text(errors="replace"))
        out[arm]["vllm_log_gib"] = float(said[-1]) if said else None
    if any(out[a]["status"] != OK for a in ("pool", "default")):
        return {**out, "status": FAILED, "error": [f"{a}: {(out[a].get('error') or [''])[0]}"
                                                   for a in ("pool", "default") if out[a]["status"] != OK]}
    pool, default = out["pool"]["graph_bytes"], out["default"]["graph_bytes"]
    out["graph_mib"] = {"pool": round(pool / 2**20, 1), "default": round(default / 2**20, 1)}
    out["pool_over_default"] = round(pool / default, 3) if default else None
    # Reported, not judged: both lists pad a batch to the same grid sizes, so the tokens should
    # match, but a different padded shape may legitimately flip a bf16 near-tie.
    out["same_greedy_output"] = out["pool"]["output_sha256"] == out["default"]["output_sha256"]
    if not (pool > 0 and default > 0):
        return {**out, "status": FAILED, "error": ["graph memory not measured (0 bytes)"]}
    return {**out, "status": OK}


# ---------------------------------------------------------------------------- the Spot Trainer

def part_spot(ctx: dict) -> dict:
    """The drafter service (what a verl rank hosts and trains while idle) on the device: the SFT
    target samples responses to task prompts there and its hidden states are captured there; a
    one-member session (NCCL on a GPU, gloo on a CPU, as in a run) trains for a fixed time. Its
    export is loaded on the CPU and scored by held-out top-1 agreement against the same
    drafter untrained, so the numbers say both how fast the device trains and that it learned."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from tlt_verl.capture import BufferConfig, DataBuffer, capture_samples
    from tlt_verl.drafter import build_drafter, target_tensors
    from tlt_verl.drafter.export import load_drafter
    from tlt_verl.drafter.reducer import free_port
    from tlt_verl.drafter.warmup import WarmupConfig, default_trainer, generate_hf, task_prompts, top1_agreement
    from tlt_verl.spot.drafter_service import DrafterService, DrafterServiceConfig

    gpu = ctx["mode"] == "gpu"
    device = "cuda" if gpu else "cpu"
    torch.set_num_threads(1 if not gpu else min(8, os.cpu_count() or 1))
    # (prompts, new tokens per response, training seconds): a GPU run's tail-sized responses; a
    # handful on the CPU, where only the path is checked.
    prompts_n, new_tokens, train_s = (256, 512, 45.0) if gpu else (8, 24, 4.0)
    work, model = Path(ctx["work"]) / "spot", Path(ctx["model"])
    tokenizer = AutoTokenizer.from_pretrained(model)
    target = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(device).eval()
    for prm in target.parameters():
        prm.requires_grad_(False)
    gen_cfg = WarmupConfig(target=str(model), out=str(work), num_prompts=prompts_n, max_new_tokens=new_tokens,
                           gen_batch=prompts_n)
    prompts = task_prompts(tokenizer, prompts_n, gen_cfg.prompt_seed)
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    t0 = time.perf_counter()
    responses = generate_hf(target, tokenizer, prompts, gen_cfg)
    sync()
    gen_s = time.perf_counter() - t0
    keep = [i for i, r in enumerate(responses) if r]
    cfg = DrafterServiceConfig(kind="eagle3", device=device,
                               trainer=replace(default_trainer(), lr=2e-3, tokens_per_micro=2048))
    service = DrafterService(str(model), cfg, capture=False)
    t0 = time.perf_counter()
    recs = capture_samples(target, [prompts[i] + responses[i] for i in keep], [len(prompts[i]) for i in keep],
                           aux_layer_ids=service.aux_layer_ids, pad_id=tokenizer.pad_token_id or 0)
    sync()
    capture_s = time.perf_counter() - t0
    held = max(1, len(recs) // 10)
    service.add_samples([(0, r["input_ids"], r["loss_mask"], r["final_hidden"], r["aux_hidden"]) for r in recs[held:]])
    del target
    if gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

    service.start_session("gpu-check", 0, 1, "127.0.0.1", free_port(), 0)
    t0, first = time.perf_counter(), None
    while time.perf_counter() - t0 < train_s + (first or 0.0):
        m = service.metrics(reset=False)
        if first is None and m["tlt/drafter/steps"] >= 1:
            # Session start, NCCL set-up and kernel compilation: not counted in the training time.
            first, first_loss = time.perf_counter() - t0, m["tlt/drafter/loss"]
            base = m
        if not service.is_training:
            break
        time.sleep(0.05)
    stats = service.stop()
    m = service.metrics(reset=False)
    peak_mib = round(torch.cuda.max_memory_allocated() / 2**20, 1) if gpu else None
    if stats.get("error") or first is None:
        return {"status": FAILED, "session": {k: v for k, v in stats.items() if not callable(v)},
                "error": [f"drafter session: {stats.get('error') or 'no step finished'}"]}
    steps, tokens = m["tlt/drafter/steps"] - base["tlt/drafter/steps"], m["tlt/drafter/tokens"] - base["tlt/drafter/tokens"]
    seconds = m["tlt/drafter/train_seconds"] - base["tlt/drafter/train_seconds"]
    exported = service.export(work / "drafter")
    service.close()

    # Scored on the CPU: the export as an engine would load it, and the untrained drafter with the
    # service's own seed, on the same held-out samples.
    tconfig = AutoConfig.from_pretrained(model)
    cpu_target = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    tensors = target_tensors(cpu_target)
    held_buf = DataBuffer(BufferConfig(kind="eagle3", budget_bytes=1 << 32))
    for r in recs[:held]:
        held_buf.add(0, r["input_ids"], r["loss_mask"], r["final_hidden"], r["aux_hidden"])
    samples = [held_buf.get(i) for i in held_buf.ids()]
    torch.manual_seed(cfg.init_seed)
    fresh = build_drafter(service.drafter.cfg, *tensors)
    trained = load_drafter(exported, tconfig, *tensors)
    before, after = top1_agreement(fresh, samples), top1_agreement(trained, samples)
    out = {"device": device, "backend": "nccl" if gpu else "gloo",
           "generation": {"responses": len(keep), "tokens": sum(len(responses[i]) for i in keep),
                          "seconds": round(gen_s, 1)},
           "capture": {"samples": len(recs), "held_out": held, "seconds": round(capture_s, 2)},
           "training": {"first_step_s": round(first, 2), "steps": int(steps), "tokens": int(tokens),
                        "seconds": round(seconds, 2), "steps_per_s": round(steps / seconds, 2) if seconds else None,
                        "tokens_per_s": round(tokens / seconds) if seconds else None,
                        "first_loss": round(first_loss, 4), "last_loss": round(m["tlt/drafter/loss"], 4),
                        "peak_mib": peak_mib, "stop_latency_s": round(stats["stop_latency_s"], 3)},
           "top1_agreement": {"untrained": round(before, 4), "trained": round(after, 4)},
           "export": portable(exported)}
    learned = after > before and m["tlt/drafter/loss"] < first_loss
    if gpu and not learned:
        return {**out, "status": FAILED, "error": [f"the drafter did not learn: top-1 {before:.3f} -> {after:.3f}, "
                                                   f"loss {first_loss:.3f} -> {m['tlt/drafter/loss']:.3f}"]}
    return {**out, "status": OK}


# ---------------------------------------------------------------------------- the driver

@dataclass(frozen=True)
class Part:
    name: str
    number: int | None           # the point of the issue it answers
    fn: Callable[[dict], dict]
    budget_s: tuple[int, int]    # (GPU, CPU dry run)
    min_s: tuple[int, int]       # held back for it while the parts before it run
    needs: tuple[str, ...] = ()  # context keys an earlier part provides
    serving: bool = False        # needs vLLM, verl and Ray (SERVING_STACK), not only torch


PARTS = [
    Part("stack", None, part_stack, (60, 60), (20, 20)),
    Part("sft", 1, part_sft, (150, 60), (60, 20), needs=()),
    Part("kernels", 4, part_kernels, (60, 40), (20, 15), needs=()),
    Part("recipe", 2, part_recipe, (220, 60), (120, 20), needs=("model",), serving=True),
    Part("sd_decode", 3, part_sd_decode, (170, 120), (60, 40), needs=("model",), serving=True),
    Part("cuda_graphs", 5, part_cuda_graphs, (130, 40), (60, 15), needs=("model",), serving=True),
    Part("spot", None, part_spot, (130, 60), (60, 20), needs=("model",)),
]
BY_NAME = {p.name: p for p in PARTS}


def run_part(part: Part, ctx: dict, budget_s: float, work: Path) -> dict:
    """The part in a child process under its budget; its result, or why there is none."""
    ctx_path, result = work / f"ctx_{part.name}.json", work / f"result_{part.name}.json"
    log = work / "logs" / f"{part.name}.log"
    result.unlink(missing_ok=True)
    ctx_path.write_text(json.dumps({**ctx, "part_deadline": time.time() + budget_s}))
    cmd = [sys.executable, "-m", "bench.gpu_check", "--part", part.name, "--ctx", str(ctx_path),
           "--result", str(result)]
    # Grace past the budget: a part stops its own subprocesses at the budget and still reports.
    rc, seconds = run_logged(cmd, log, budget_s + PART_GRACE_S, env=child_env(ctx))
    if result.exists():
        out = json.loads(result.read_text())
    elif rc is None:
        out = {"status": FAILED, "error": [f"timed out after {seconds:.0f}s (budget {budget_s:.0f}s)"] + log_tail(log)}
    else:
        out = {"status": FAILED, "error": [f"exit code {rc}"] + log_tail(log)}
    return {**out, "wall_s": seconds, "budget_s": round(budget_s)}


def child_main(args) -> int:
    ctx = json.loads(Path(args.ctx).read_text())
    try:
        out = graph_arm(ctx, args.graph_arm) if args.graph_arm else BY_NAME[args.part].fn(ctx)
    except Exception as e:  # noqa: BLE001 - reported in the JSON, with the traceback's end
        traceback.print_exc()
        out = {"status": FAILED, "error": [f"{type(e).__name__}: {e}"[:2000]] + tail(traceback.format_exc(), 8)}
    Path(args.result).write_text(json.dumps(out, indent=1, default=str))
    return 0


# A lent device gives a session 15 minutes in all, starts included, and at most 10 a command: the
# check keeps to 8 with the last part's grace (465 + 15 s), which leaves room for the machine's
# start and a rerun of one part.
GPU_TOTAL_S, DRY_TOTAL_S = 465.0, 170.0
# run_part's grace past a part's budget.
PART_GRACE_S = 15


def installed(names=SERVING_STACK) -> list[str]:
    """The packages of `names` this interpreter could import, found without importing them."""
    from importlib.util import find_spec

    return [n for n in names if find_spec(n) is not None]


def plan(col: int, total_s: float, scale: float, only: set | None, serving: bool) -> dict:
    """The parts that will run and the most time each may take (budget plus grace), before any runs:
    what a session asks of a lent device. Without the serving stack its parts are planned as skipped."""
    parts, skipped = {}, {}
    for part in PARTS:
        if only is not None and part.name not in only:
            skipped[part.name] = "not selected (--only)"
        elif part.serving and not serving:
            skipped[part.name] = f"needs {', '.join(SERVING_STACK)}"
        else:
            parts[part.name] = round(scale * part.budget_s[col]) + PART_GRACE_S
    return {"parts": parts, "skipped": skipped, "planned_s": min(round(total_s) + PART_GRACE_S, sum(parts.values())),
            "total_s": round(total_s)}


def plan_line(what: str, p: dict) -> str:
    ran = ", ".join(f"{k} {v}s" for k, v in p["parts"].items())
    skipped = f"; skipped: {', '.join(p['skipped'])}" if p["skipped"] else ""
    return f"gpu_check: {what}: at most {p['planned_s']}s ({p['planned_s'] / 60:.1f} min) of device time: {ran}{skipped}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "gpu_check.json"))
    ap.add_argument("--cpu-dry-run", action="store_true", help="tiny sizes on a CPU; GPU-only parts validated, not run")
    ap.add_argument("--home", default=None, help="TLT_HOME for the run's assets (default: .cache/tlt-gpu on a GPU, "
                    "the project's cache in a dry run)")
    ap.add_argument("--work", default=None, help="scratch and logs (default: runs/gpu_check-<time>)")
    ap.add_argument("--total-s", type=float, default=None,
                    help=f"time for all parts (default {GPU_TOTAL_S:.0f} on a GPU, {DRY_TOTAL_S:.0f} dry); every part's "
                         "budget scales with it")
    ap.add_argument("--only", default=None, help="comma-separated parts to run (stack and sft always run)")
    ap.add_argument("--part", help=argparse.SUPPRESS)
    ap.add_argument("--graph-arm", help=argparse.SUPPRESS)
    ap.add_argument("--ctx", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.part or args.graph_arm:
        return child_main(args)

    t0 = time.time()
    mode = "cpu-dry-run" if args.cpu_dry_run else "gpu"
    col = 0 if mode == "gpu" else 1
    # The dry run reuses the project's CPU assets (launch/runner.py's DEFAULT_HOME); a GPU run
    # keeps its GPU-trained ones apart from them.
    cpu_home = Path(os.environ.get("TLT_HOME", REPO / ".cache" / "tlt"))
    home = Path(args.home or (cpu_home if args.cpu_dry_run else REPO / ".cache" / "tlt-gpu")).resolve()
    work = Path(args.work or REPO / "runs" / f"gpu_check-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    work.mkdir(parents=True, exist_ok=True)
    out_path = Path(args.out)
    only = set(args.only.split(",")) | {"stack", "sft"} if args.only else None
    if only and only - set(BY_NAME):
        ap.error(f"--only: unknown part(s) {sorted(only - set(BY_NAME))}; parts: {', '.join(BY_NAME)}")
    default_total = GPU_TOTAL_S if mode == "gpu" else DRY_TOTAL_S
    deadline = t0 + (args.total_s or default_total)
    # A slower machine (a contended CI box) gets more time for every part alike.
    scale = (args.total_s or default_total) / default_total
    serving = len(installed()) == len(SERVING_STACK)
    this_plan = plan(col, args.total_s or default_total, scale, only, serving)
    print(plan_line(f"plan ({mode})", this_plan), flush=True)
    gpu_plans = {"gpu_bare_image": plan(0, GPU_TOTAL_S, 1.0, only, serving=False),
                 "gpu_full_stack": plan(0, GPU_TOTAL_S, 1.0, only, serving=True)}
    if mode != "gpu":
        # What this check will ask of a lent GPU: the device machines lent so far had torch alone.
        for name, p in gpu_plans.items():
            print(plan_line(f"plan on a GPU ({name.split('_', 1)[1].replace('_', ' ')})", p), flush=True)
    ctx = {"mode": mode, "home": str(home), "work": str(work)}
    report = {"what": "tlt-verl GPU check (bench/gpu_check.py): SFT target, TLT recipe, SD decode speed, "
                      "kernels against references, CUDA-graph memory",
              "mode": mode, "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "host": {"cpus": len(os.sched_getaffinity(0)), "machine": platform.machine()},
              "work": portable(work), "plan": {mode: this_plan, **gpu_plans}, "versions": {}, "parts": {}}

    def write() -> None:
        report["wall_s"] = round(time.time() - t0, 1)
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        report["children_cpu_s"] = round(usage.ru_utime + usage.ru_stime, 1)
        ran = [p for p in report["parts"].values() if p["status"] != SKIPPED]
        report["status"] = FAILED if any(p["status"] == FAILED for p in ran) else OK
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(report, indent=1, default=str) + "\n")

    stack_error = None
    for i, part in enumerate(PARTS):
        later = scale * sum(p.min_s[col] for p in PARTS[i + 1:] if only is None or p.name in only)
        budget = min(scale * part.budget_s[col], deadline - time.time() - later)
        missing = [k for k in part.needs if k not in ctx]
        if only is not None and part.name not in only:
            res = {"status": SKIPPED, "reason": "not selected (--only)"}
        elif stack_error:
            res = {"status": SKIPPED, "reason": stack_error}
        elif part.serving and "serving_stack_missing" in ctx:
            res = {"status": SKIPPED, "reason": ctx["serving_stack_missing"]}
        elif missing:
            res = {"status": SKIPPED, "reason": f"needs {', '.join(missing)} from part sft, which failed"}
        elif budget < scale * part.min_s[col]:
            res = {"status": SKIPPED,
                   "reason": f"out of time ({budget:.0f}s left for a part that needs {scale * part.min_s[col]:.0f}s)"}
        else:
            print(f"gpu_check: {part.name} (budget {budget:.0f}s) ...", flush=True)
            res = run_part(part, ctx, budget, work)
        ctx.update(res.pop("provides", {}))
        if part.name == "stack":
            report["versions"] = res.pop("versions", {})
            if res["status"] != OK:
                report["error"] = res["error"][0]
                stack_error = None if "serving_stack_missing" in ctx else report["error"]
        report["parts"][part.name] = {"part": part.number, **res}
        line = res.get("reason") or (res.get("error") or [""])[0]
        print(f"gpu_check: {part.name}: {res['status']} ({res.get('wall_s', 0):.0f}s) {line}".rstrip(), flush=True)
        write()
    print(f"gpu_check: {report['status']} in {report['wall_s']:.0f}s -> {out_path}", flush=True)
    return 0 if report["status"] == OK else 1


if __name__ == "__main__":
    sys.exit(main())
