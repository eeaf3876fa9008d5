"""What the rollout server's `output_kind=FINAL_ONLY` saves against vLLM's cumulative default: the
front end's CPU seconds and the wall time of one rollout, for a plain engine and the TLT engine.

    .venv/bin/python bench/output_kind.py --out bench/results/output_kind.json

One `AsyncLLM` per arm, started as the rollout server starts it (`start_engine`: the engine core
in a child process, this process its front end), 32 task prompts at T=1 with log-probs as verl
asks for them. Each round runs both output kinds in alternating order; a round's ratios are
cumulative over final-only, and the result keeps every round's and their medians. The front
end's CPU is this process's (`getrusage`), the engine core's is not in it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench import portable_settings  # noqa: E402


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def run(args) -> dict:
    from transformers import AutoTokenizer
    from vllm import SamplingParams, TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    from tlt_verl.drafter.warmup import task_prompts
    from tlt_verl.rollout.config import drafter_speculative_config
    from tlt_verl.rollout.engine.offline import use_engine_env
    from tlt_verl.rollout.engine.server import DEFAULT_CPU_KV_CACHE_BYTES, start_engine
    from tlt_verl.task.prepare import VAL_SEED, prepare

    use_engine_env()
    model = str(prepare(REPO / ".cache/tlt/assets", log=lambda m: None)["model"])
    prompts = task_prompts(AutoTokenizer.from_pretrained(model), args.prompts, VAL_SEED)
    base = dict(model=model, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, seed=0,
                max_model_len=1536, max_num_seqs=64, max_num_batched_tokens=32768,
                kv_cache_memory_bytes=DEFAULT_CPU_KV_CACHE_BYTES, disable_log_stats=False)
    engines = {"plain": base,
               "tlt": {**base, "speculative_config": drafter_speculative_config(
                   args.drafter, "eagle3", 3, num_speculative_tokens_per_batch_size=[[1, 64, 3]])}}
    kinds = {"cumulative": RequestOutputKind.CUMULATIVE, "final_only": RequestOutputKind.FINAL_ONLY}
    calls = 0
    out = {}
    for arm, engine_args in engines.items():
        engine = start_engine(engine_args)

        async def rollout(kind) -> tuple[float, float]:
            nonlocal calls
            calls += 1

            async def one(i, p):
                sp = SamplingParams(temperature=1.0, max_tokens=args.tokens, min_tokens=args.tokens, ignore_eos=True,
                                    seed=i, logprobs=0, detokenize=False, output_kind=kinds[kind])
                async for _ in engine.generate(TokensPrompt(prompt_token_ids=p), sp, f"{arm}-{calls}-{i}"):
                    pass
            cpu, t = _cpu_s(), time.perf_counter()
            await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
            return time.perf_counter() - t, _cpu_s() - cpu

        try:
            for kind in kinds:   # warm-up, unrecorded
                await rollout(kind)
            rounds = []
            for r in range(args.rounds):
                order = list(kinds) if r % 2 == 0 else list(kinds)[::-1]
                rounds.append({kind: dict(zip(("wall_s", "frontend_cpu_s"), await rollout(kind))) for kind in order})
                print(f"{arm} round {r}: {rounds[-1]}", flush=True)
        finally:
            engine.shutdown()
        ratio = lambda key: [x["cumulative"][key] / x["final_only"][key] for x in rounds]
        out[arm] = {"rounds": rounds,
                    "wall_cumulative_over_final_only": statistics.median(ratio("wall_s")),
                    "wall_ratio_per_round": ratio("wall_s"),
                    "frontend_cpu_cumulative_over_final_only": statistics.median(ratio("frontend_cpu_s")),
                    "frontend_cpu_ratio_per_round": ratio("frontend_cpu_s")}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "bench/results/output_kind.json"))
    ap.add_argument("--drafter", default=str(REPO / ".cache/tlt/assets/warm_drafter"))
    ap.add_argument("--prompts", type=int, default=32, help="requests per rollout (a replica's share of a step)")
    ap.add_argument("--tokens", type=int, default=300, help="tokens per request")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args(argv)
    if not (Path(args.drafter) / "config.json").is_file():
        ap.error(f"--drafter {args.drafter}: no exported drafter there (./tlt run builds the warm one)")
    arms = asyncio.run(run(args))
    result = {"what": __doc__.split("\n\n")[0], "settings": portable_settings(vars(args)),
              "host": platform.processor() or platform.machine(), "arms": arms}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for arm, r in arms.items():
        print(f"{arm}: wall cumulative/final-only {r['wall_cumulative_over_final_only']:.3f} "
              f"(rounds {[round(x, 3) for x in r['wall_ratio_per_round']]}), front-end CPU "
              f"{r['frontend_cpu_cumulative_over_final_only']:.3f} "
              f"(rounds {[round(x, 3) for x in r['frontend_cpu_ratio_per_round']]})")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
