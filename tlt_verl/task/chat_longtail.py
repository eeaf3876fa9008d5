"""A long-tail chat workload for a real instruction-tuned LM (e.g. `./tlt prepare --model smollm2-135m`).

The toy task gets its long tail from problem length; a pretrained chat model gets it from what it
is asked. Most prompts here ask for a word or a number (a handful of tokens), some for a sentence,
and a few for a long text (a story, a numbered list of many items), so that at temperature 1 most
responses end quickly and a few run 10-30x longer: the shape of an RL rollout on reasoning data,
where the batch waits for its longest responses.

    python -m tlt_verl.task.chat_longtail --write prompts.parquet --n 256
    python -m tlt_verl.task.chat_longtail --measure .cache/tlt/models/smollm2-135m --n 128 --out lengths.json

The parquet file is in verl's dataset format (a `prompt` column of chat messages), so it serves
`./tlt drafter warmup --prompts FILE` and a verl recipe's data files alike.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

DATA_SOURCE = "tlt_chat_longtail"


@dataclass(frozen=True)
class PromptKind:
    """A family of prompts with the response length it asks for."""
    name: str
    weight: float                  # share of the prompts
    templates: tuple[str, ...]     # each formatted with one {topic}
    topics: tuple[str, ...]


KINDS: tuple[PromptKind, ...] = (
    PromptKind("word", 0.60, (
        "Answer with one word only. What is the opposite of {topic}?",
        "Reply with a single word: what color is usually associated with {topic}?",
        "One word only: is {topic} hot or cold?",
        "What is {topic} plus 3? Reply with just the number.",
    ), ("hot", "day", "up", "snow", "fire", "grass", "the sky", "night", "ice", "7", "12", "40", "summer",
        "a lemon", "coffee", "the sea")),
    PromptKind("sentence", 0.28, (
        "In one short sentence, what is {topic}?",
        "Describe {topic} in a single sentence.",
        "Give one short reason why people like {topic}.",
    ), ("a library", "rain", "a bicycle", "music", "a garden", "the moon", "bread", "a river", "chess",
        "a volcano", "winter", "a map")),
    PromptKind("long", 0.12, (
        "Write a long, detailed story of at least 800 words about {topic}. Use many paragraphs.",
        "Write a numbered list of 100 different facts about {topic}, one per line.",
        "Write a complete, step-by-step guide with at least 30 steps on how to {topic}. Explain every step "
        "in detail.",
    ), ("a lost dog", "a trip to the mountains", "building a boat", "a city under the sea", "bake bread",
        "plant a vegetable garden", "learn to play the guitar", "the history of trains")),
)


def generate_conversations(n: int, seed: int) -> list[tuple[str, list[dict]]]:
    """``n`` (kind, chat messages) pairs, the kinds drawn by weight; the same for the same seed."""
    rng = random.Random(seed)
    weights = [k.weight for k in KINDS]
    out = []
    for _ in range(n):
        kind = rng.choices(KINDS, weights)[0]
        text = rng.choice(kind.templates).format(topic=rng.choice(kind.topics))
        out.append((kind.name, [{"role": "user", "content": text}]))
    return out


def chat_prompt_ids(tokenizer, n: int, seed: int) -> list[list[int]]:
    """Token ids of ``n`` conversations (``generate_conversations``) through the tokenizer's chat
    template, as a rollout feeds them to the engine."""
    from tlt_verl.drafter.warmup import chat_prompts

    return chat_prompts(tokenizer, [m for _, m in generate_conversations(n, seed)])


def write_parquet(path: str | Path, n: int, seed: int) -> Path:
    """The prompts as a verl RL parquet file (no reward: the workload is for rollout and warm-up)."""
    import pandas as pd

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"data_source": DATA_SOURCE, "prompt": messages, "ability": "chat",
             "extra_info": {"index": i, "kind": kind}}
            for i, (kind, messages) in enumerate(generate_conversations(n, seed))]
    pd.DataFrame(rows).to_parquet(path, index=False)
    return path


def _percentiles(values: list[int]) -> dict:
    ordered = sorted(values)

    def pct(q: float) -> int:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"n": len(ordered), "mean": round(sum(ordered) / len(ordered), 1), "p10": pct(0.1), "p50": pct(0.5),
            "p90": pct(0.9), "p99": pct(0.99), "max": ordered[-1]}


def measure_lengths(model_dir: str | Path, n: int, seed: int, max_tokens: int, temperature: float = 1.0,
                    budget_s: float | None = None) -> dict:
    """Response lengths of the target at ``temperature`` with vLLM (the rollout engine). With
    ``budget_s``, the requests still running when it is spent are stopped and counted at the length
    they had reached (``censored``: their true length is at least that), so a slow or crowded
    machine still gives the distribution's body and a lower bound on its tail."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from tlt_verl.rollout.engine.offline import offline_llm

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pairs = generate_conversations(n, seed)
    prompts = chat_prompt_ids(tokenizer, n, seed)
    engine = offline_llm(str(model_dir)).llm_engine
    params = SamplingParams(temperature=temperature, top_k=0, top_p=1.0, max_tokens=max_tokens)
    # Stepped by hand rather than LLM.generate, which returns nothing until every request is done.
    ids = {str(i): i for i in range(n)}
    for rid, i in ids.items():
        engine.add_request(rid, {"prompt_token_ids": prompts[i]}, params)
    lengths, finish = [0] * n, [None] * n
    # On a shared box the throughput depends on what else runs: the load is part of the record.
    load_before = os.getloadavg()
    start = time.perf_counter()
    deadline = None if budget_s is None else start + budget_s
    while engine.has_unfinished_requests() and (deadline is None or time.perf_counter() < deadline):
        for out in engine.step():
            i = ids[out.request_id]
            lengths[i] = len(out.outputs[0].token_ids)
            if out.finished:
                finish[i] = out.outputs[0].finish_reason
    seconds = time.perf_counter() - start
    censored = [i for i in range(n) if finish[i] is None]
    if censored:
        engine.abort_request([rid for rid, i in ids.items() if finish[i] is None])
    by_kind: dict[str, list[int]] = {}
    for (kind, _), length in zip(pairs, lengths):
        by_kind.setdefault(kind, []).append(length)
    overall = _percentiles(lengths)
    return {
        "model": str(model_dir), "n": n, "seed": seed, "temperature": temperature, "max_tokens": max_tokens,
        "budget_s": budget_s, "generate_s": round(seconds, 1), "tokens": sum(lengths),
        "load_avg_1m": [round(load_before[0], 1), round(os.getloadavg()[0], 1)], "cpus": os.cpu_count(),
        "capped_at_max_tokens": sum(f == "length" for f in finish), "censored_at_budget": len(censored),
        "prompt_len": _percentiles([len(p) for p in prompts]),
        "response_len": overall,
        "max_over_median": round(overall["max"] / max(overall["p50"], 1), 1),
        "p90_over_median": round(overall["p90"] / max(overall["p50"], 1), 1),
        "by_kind": {k: _percentiles(v) for k, v in sorted(by_kind.items())},
        "kinds": {k.name: {"weight": k.weight, "templates": list(k.templates)} for k in KINDS},
        "lengths": lengths, "finish": finish,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write", type=Path, default=None, help="write the prompts as a verl parquet file")
    ap.add_argument("--measure", default=None, metavar="MODEL_DIR",
                    help="sample the model's responses (vLLM, T=1) and report their lengths")
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--budget-s", type=float, default=None,
                    help="stop sampling after this many seconds; unfinished responses count as censored")
    ap.add_argument("--out", type=Path, default=None, help="where --measure writes its JSON")
    args = ap.parse_args(argv)
    if args.write is None and args.measure is None:
        ap.error("give --write FILE and/or --measure MODEL_DIR")
    if args.write is not None:
        print(f"chat_longtail: wrote {write_parquet(args.write, args.n, args.seed)}")
    if args.measure is not None:
        report = measure_lengths(args.measure, args.n, args.seed, args.max_tokens, budget_s=args.budget_s)
        text = json.dumps(report, indent=2)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text + "\n")
        print(json.dumps({k: v for k, v in report.items() if k not in ("lengths", "finish", "kinds")}, indent=2))


if __name__ == "__main__":
    main()
