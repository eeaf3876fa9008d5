"""What "SD off" costs: a decode step where no request drafts (k=0) in an engine that has a
drafter, over the same step in a plain engine, by running batch.

    .venv/bin/python bench/sd_off_cost.py --out bench/results/sd_off_cost.json

Same target, prompts and settings as bench/sd_threshold.py (whose k=0 row, 1.6x at batch 1, was
measured before patches/vllm_sd/catch_up.py stopped the drafter's forward at k=0). Each of
`--rounds` rounds measures both engines, in alternating order; a round's ratio is the median
decode step of the SD engine at k=0 over the plain engine's, and the result gives every round's
ratio and their median (`k0_over_plain`). For another target and a trained drafter,
`bench/sd_step_cost.py --ks 0,... --off-out FILE` writes the same result from its own rounds.
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
from bench import portable_settings  # noqa: E402
from bench.sd_threshold import _measure, _random_drafter  # noqa: E402


def off_cost_result(rounds: list[dict], sizes: list[int], what: str, **extra) -> dict:
    """The result file from rounds of {"order", "plain_step_ms": {b: ms}, "sd_k0_step_ms": {b: ms}}:
    each round's ratio per batch and their median (`k0_over_plain`)."""
    rounds = [{**x, "k0_over_plain": {b: x["sd_k0_step_ms"][b] / x["plain_step_ms"][b] for b in sizes}}
              for x in rounds]
    return {
        "what": what,
        "k0_over_plain": {str(b): statistics.median(x["k0_over_plain"][b] for x in rounds) for b in sizes},
        "spread": {str(b): [min(x["k0_over_plain"][b] for x in rounds), max(x["k0_over_plain"][b] for x in rounds)]
                   for b in sizes},
        "rounds": [{**x, **{key: {str(b): v for b, v in x[key].items()}
                            for key in ("plain_step_ms", "sd_k0_step_ms", "k0_over_plain")}} for x in rounds],
        **extra,
        "host": {"cpus": len(os.sched_getaffinity(0)), "machine": platform.machine(), "loadavg_at_end": os.getloadavg()},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "bench/results/sd_off_cost.json"))
    ap.add_argument("--sizes", default="1,8,64")
    ap.add_argument("--k", type=int, default=3, help="the SD engine's num_speculative_tokens")
    ap.add_argument("--tokens", type=int, default=48, help="generated tokens per request")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="generations per size and engine (fastest kept)")
    ap.add_argument("--rounds", type=int, default=6, help="measurements of both engines, in alternating order")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]

    from tlt_verl.rollout.engine import sd_control
    from tlt_verl.rollout.engine.offline import offline_llm
    from tlt_verl.task.prepare import prepare

    model = Path(prepare(REPO / ".cache/tlt/assets")["model"])
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    drafter = _random_drafter(model, Path(tempfile.mkdtemp(prefix="sd_off_cost-")) / "drafter")
    max_seqs = max(sizes)
    engine = dict(skip_tokenizer_init=True, max_model_len=args.prompt_len + args.tokens + args.k + 8,
                  max_num_seqs=max_seqs, max_num_batched_tokens=max(4096, max_seqs * (args.prompt_len + args.k + 2)))
    spec = {"method": "eagle", "model": str(drafter), "num_speculative_tokens": args.k,
            "num_speculative_tokens_per_batch_size": [[1, max_seqs, 0]]}

    # Both engines live side by side in this process (in-process engine cores), and every
    # generation of one is followed by the same generation of the other, in alternating order:
    # on a noisy box, load changes hit both arms alike.
    llms = {"plain": offline_llm(str(model), **engine), "sd_k0": offline_llm(str(model), speculative_config=spec, **engine)}
    t0 = time.time()
    rounds = []
    try:
        assert set(sd_control.sd_lookup(llms["sd_k0"])[1:]) == {0}, "the SD engine must be off at every batch size"
        for r in range(args.rounds):
            order = ("plain", "sd_k0") if r % 2 == 0 else ("sd_k0", "plain")
            ms = {arm: {} for arm in order}
            for b in sizes:   # size by size, so that both arms of a ratio run within seconds of each other
                for arm in order:
                    ms[arm][b] = _measure(llms[arm], [b], args.tokens, args.prompt_len, vocab, args.repeats)[0][
                        "decode_step_ms"]
            rounds.append({"order": list(order), "plain_step_ms": ms["plain"], "sd_k0_step_ms": ms["sd_k0"]})
            print(f"round {r + 1}: " + ", ".join(f"batch {b}: {ms['sd_k0'][b] / ms['plain'][b]:.3f}" for b in sizes),
                  flush=True)
    finally:
        for llm in llms.values():
            llm.llm_engine.engine_core.shutdown()
    result = off_cost_result(
        rounds, sizes,
        what="decode step at k=0 in an engine with an EAGLE-1 drafter over the same step in a plain engine "
             "(median of the engine's per-step records, fastest of --repeats generations; tiny SFT target)",
        before="bench/results/sd_threshold.json, k=0 rows (vLLM's own k=0: drafter forward every step): "
               "1.63x at batch 1, 1.55x at 8, 0.89x at 64",
        args=portable_settings(vars(args)), seconds=time.time() - t0)
    ratios = result["k0_over_plain"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print("k0_over_plain", json.dumps({b: round(v, 3) for b, v in ratios.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
