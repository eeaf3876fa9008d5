"""vLLM's own speculative-decoding counters, read one way by the tests, benchmarks and policy.

vLLM 0.30 exposes them as `vllm:spec_decode_num_{drafts,draft_tokens,accepted_tokens,
accepted_tokens_per_pos}` in `LLM.get_metrics()` (or `vllm.v1.metrics.reader.get_metrics_snapshot()`
for an AsyncLLM); they are cumulative, so a measurement is the difference of two reads.
"""
from __future__ import annotations

from typing import Iterable

PREFIX = "vllm:spec_decode_num_"


def spec_decode_counters(metrics: Iterable) -> dict:
    """{drafts, draft_tokens, accepted_tokens, accepted_tokens_per_pos} from a metrics snapshot."""
    out = {}
    for m in metrics:
        if m.name.startswith(PREFIX):
            out[m.name.removeprefix(PREFIX)] = list(m.values) if hasattr(m, "values") else m.value
    return out


def counter_delta(after: dict, before: dict) -> dict:
    """What was counted between two reads (lists element-wise)."""
    out = {}
    for key, value in after.items():
        if isinstance(value, list):
            prev = before.get(key, [0] * len(value))
            out[key] = [a - b for a, b in zip(value, prev)]
        else:
            out[key] = value - before.get(key, 0)
    return out


def mean_acceptance_length(counters: dict) -> float:
    """Tokens emitted per draft round: 1 (the verified token) + accepted drafts per round."""
    return 1.0 + counters.get("accepted_tokens", 0) / max(counters.get("drafts", 0), 1)
