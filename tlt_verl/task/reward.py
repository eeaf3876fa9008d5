"""Rule-based reward for the long-tail task, in verl's custom reward function format.

Use with ``custom_reward_function.path=<this file>`` and ``custom_reward_function.name=compute_score``.
"""
from __future__ import annotations

import re
from typing import Any

CORRECT_SCORE = 1.0
WRONG_SCORE = 0.0
# A wrong answer earns up to this much for the worked lines that are right (numbered in order,
# operand repeated consistently, arithmetic correct, chained from the previous line). GRPO
# then gets a signal from every group, not only from groups that mix right and wrong answers;
# it stays below CORRECT_SCORE so that only the right answer gets full marks.
PARTIAL_CREDIT = 0.5
# Below a wrong answer: a response that never commits to an answer (e.g. rambles until the
# length limit) must not look as good as an honest attempt.
MALFORMED_SCORE = -1.0

# Text a response may end with that is not part of the answer; verl usually decodes with
# skip_special_tokens, but not every path does.
TRAILING_TOKENS = ("<|im_end|>", "<|endoftext|>")
ANSWER_LINE = re.compile(r"Answer:[ \t]*(-?\d+)[ \t]*")
STEP_LINE = re.compile(r"(\d+): ([+-]\d+) (\d+)([+-]\d+)=(-?\d+)")
# The final answer is near the end; only the tail is inspected so huge rambling responses are cheap.
TAIL_CHARS = 256


def extract_answer(solution_str: str) -> int | None:
    """The integer on the response's final ``Answer: <int>`` line, or None if there is none."""
    tail = _strip_trailing(solution_str[-TAIL_CHARS:])
    last_line = tail.rsplit("\n", 1)[-1].strip()
    match = ANSWER_LINE.fullmatch(last_line)
    return int(match.group(1)) if match else None


def _strip_trailing(text: str) -> str:
    previous = None
    while text != previous:
        previous = text
        text = text.rstrip()
        for token in TRAILING_TOKENS:
            text = text.removesuffix(token)
    return text


def step_accuracy(solution_str: str, num_steps: int | None = None) -> float:
    """Fraction of the expected worked lines that are right (see PARTIAL_CREDIT)."""
    lines = [ln.strip() for ln in _strip_trailing(solution_str).split("\n")]
    steps = [STEP_LINE.fullmatch(ln) for ln in lines if not ln.startswith("Answer:")]
    good, previous = 0, None
    for i, m in enumerate(steps, 1):
        if m is None:
            previous = None
            continue
        k, op, a, op2, b = int(m[1]), int(m[2]), int(m[3]), int(m[4]), int(m[5])
        if k == i and op == op2 and a + op == b and (previous is None or a == previous):
            good += 1
        previous = b
    return good / max(1, num_steps or 0, len(steps))


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    **kwargs: Any,
) -> dict[str, float]:
    """Score one response: 1.0 correct; well-formed but wrong: 0.0 plus partial credit for right
    worked lines (< 1.0); -1.0 no parsable answer."""
    try:
        expected = int(str(ground_truth).strip())
    except ValueError:
        raise ValueError(f"ground_truth must be an integer string, got {ground_truth!r} ({data_source})") from None

    answer = extract_answer(solution_str)
    if answer is None:
        return {"score": MALFORMED_SCORE, "acc": 0.0, "format_ok": 0.0}
    correct = answer == expected
    steps_ok = step_accuracy(solution_str, (extra_info or {}).get("num_steps"))
    return {
        "score": CORRECT_SCORE if correct else WRONG_SCORE + PARTIAL_CREDIT * steps_ok,
        "acc": 1.0 if correct else 0.0,
        "format_ok": 1.0,
        "step_acc": steps_ok,
    }
