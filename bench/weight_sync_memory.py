"""Host memory a target weight sync adds to a trainer rank: one bucket, not a copy of the model.

    .venv/bin/python bench/weight_sync_memory.py --out bench/results/weight_sync_memory.json

The rank is this process: it holds a random Qwen2 target's weights (as an actor rank holds its
shard) and sends them to a vLLM engine whose workers run in another process, through the
production path: verl's `BucketedWeightSender` in shared-memory mode (what verl's ServerAdapter
uses off CUDA), received by `TLTWorkerExtension.update_weights_from_ipc`. The model is several
buckets large, so "one bucket" and "one model" are far apart. For contrast the same rank also
does what the adapter did before (a host copy of every tensor, written to a safetensors file the
engine would read), measured first, before anything freed is left for the allocator to reuse. Peak
RSS is the kernel's high-water mark (VmHWM, reset before each sync through /proc/self/clear_refs);
the process's first sync, which also pays once for imports and the sender thread's allocator
arena, is reported apart from the per-step syncs that follow; the sync is checked to have changed
the served weights and to bring the original back.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench import portable_settings  # noqa: E402

MIB = 1 << 20


def _hwm_bytes() -> int:
    return int(re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) << 10


def _rss_bytes() -> int:
    return int(re.search(r"VmRSS:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) << 10


def _reset_hwm() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def _write_target(out: Path, hidden: int, layers: int, vocab: int) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, max_position_embeddings=256,
                      tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).float().save_pretrained(out, safe_serialization=True)
    return out


async def _run(args) -> dict:
    from safetensors.torch import load_file, save_file
    from tlt_verl.rollout.engine.server import DEFAULT_CPU_KV_CACHE_BYTES, start_engine
    from tlt_verl.rollout.engine.weight_sync import send_weights

    work = Path(args.work or tempfile.mkdtemp(prefix="tlt-wsm-"))
    target = _write_target(work / "target", args.hidden, args.layers, args.vocab)
    state = load_file(str(target / "model.safetensors"))
    model_bytes = sum(t.numel() * t.element_size() for t in state.values())
    engine = start_engine(dict(
        model=str(target), skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=128,
        max_num_seqs=4, kv_cache_memory_bytes=DEFAULT_CPU_KV_CACHE_BYTES,
        worker_extension_cls="tlt_verl.rollout.engine.worker_extension.TLTWorkerExtension"))
    res = {"model_bytes": model_bytes, "bucket_bytes": args.bucket_mb * MIB, "syncs": []}

    def measured(fn):
        base = _rss_bytes()
        _reset_hwm()
        t = time.time()
        out = fn()
        return out, {"peak_rss_added": _hwm_bytes() - base, "s": time.time() - t}

    try:
        async def served() -> str:
            return (await engine.collective_rpc("tlt_weights_checksum", args=("target",)))[0]

        # The old path first, while nothing freed is left for the allocator to reuse: a host copy
        # of every tensor, written to the file the engine would have read.
        def file_path():
            copy = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}
            save_file(copy, str(work / "sync.safetensors"))
            os.unlink(work / "sync.safetensors")

        _, res["file_path"] = measured(file_path)
        original = await served()
        scaled = {k: (v * 1.5 if ".layers." in k else v) for k, v in state.items()}
        # The process's first sync also pays once for what stays afterwards (verl's transfer
        # module and ZMQ imported, the sender thread's allocator arena): recorded apart.
        t = time.time()
        base = _rss_bytes()
        _reset_hwm()
        await send_weights(engine.collective_rpc, scaled.items(), bucket_mb=args.bucket_mb)
        res["first_sync"] = {"peak_rss_added": _hwm_bytes() - base, "s": time.time() - t}
        res["scaled_served_differs"] = await served() != original
        for i in range(args.repeats):
            for tensors in (state, scaled):
                base = _rss_bytes()
                _reset_hwm()
                t = time.time()
                await send_weights(engine.collective_rpc, tensors.items(), bucket_mb=args.bucket_mb)
                res["syncs"].append({"peak_rss_added": _hwm_bytes() - base, "s": time.time() - t})
        await send_weights(engine.collective_rpc, state.items(), bucket_mb=args.bucket_mb)
        res["original_served_again"] = await served() == original
    finally:
        engine.shutdown()
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=12288)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", default=None)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "weight_sync_memory.json"))
    args = ap.parse_args(argv)
    # The engine's workers in a process of their own, as in a rollout replica.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    from tlt_verl.rollout.engine.offline import use_engine_env

    use_engine_env()
    t0 = time.time()
    res = asyncio.run(_run(args))
    bucket = res["bucket_bytes"]
    added = [s["peak_rss_added"] for s in res["syncs"]]
    out = {
        # Per sync, once the process has synced before (every step after the first).
        "peak_rss_added_over_bucket": max(added) / bucket,
        "peak_rss_added_over_bucket_spread": [min(added) / bucket, max(added) / bucket],
        "peak_rss_added_over_model": max(added) / res["model_bytes"],
        "first_sync_peak_rss_added_over_bucket": res["first_sync"]["peak_rss_added"] / bucket,
        "file_path_peak_rss_added_over_bucket": res["file_path"]["peak_rss_added"] / bucket,
        "file_path_peak_rss_added_over_model": res["file_path"]["peak_rss_added"] / res["model_bytes"],
        "model_mib": res["model_bytes"] / MIB,
        "bucket_mib": bucket / MIB,
        "sync_s_median": statistics.median(s["s"] for s in res["syncs"]),
        "scaled_served_differs": res["scaled_served_differs"],
        "original_served_again": res["original_served_again"],
        "first_sync": res["first_sync"],
        "syncs": res["syncs"],
        "file_path": res["file_path"],
        "settings": portable_settings(vars(args)),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "wall_s": time.time() - t0,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"bench: model {out['model_mib']:.0f} MiB, bucket {out['bucket_mib']:.0f} MiB: a sync adds "
          f"{out['peak_rss_added_over_bucket']:.2f}x the bucket ({out['peak_rss_added_over_model']:.2f}x the model) to the "
          f"rank's peak RSS (the process's first: {out['first_sync_peak_rss_added_over_bucket']:.2f}x); the file path "
          f"added {out['file_path_peak_rss_added_over_model']:.2f}x the model; "
          f"served weights changed and came back: {out['scaled_served_differs'] and out['original_served_again']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
