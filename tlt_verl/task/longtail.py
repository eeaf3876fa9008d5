"""Synthetic long-tail arithmetic task.

A problem is a start value and a list of single-digit additions/subtractions:

    prompt:   Start at 37. Apply the steps in order. 1: +5 2: -3 Give the final value.
    response: 1: +5 37+5=42
              2: -3 42-3=39
              Answer: 39

Each scratchpad line first repeats the step exactly as the prompt writes it ("2: -3"), then does
the arithmetic. The repeat turns fetching the operand into a plain copy of what follows "2:" in
the prompt, which a tiny model learns quickly: under the same SFT budget, lines without it
("2: 42-3=39") gave 16% accuracy at temperature 1 against 47% with it.

The step count is heavy-tailed (a power-law body plus a rare long tail): most problems take 2-4 steps, a few take
30-64, reproducing the long-tail rollout-length profile of real reasoning workloads at a size a
tiny model can learn on a CPU.
"""
from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Iterator, Sequence

DATA_SOURCE = "tlt_longtail"
ABILITY = "arithmetic"

MIN_STEPS = 1
MAX_STEPS = 64
# The step count is a mixture: a body P(k) ~ (k + STEP_SHIFT) ** -STEP_ALPHA on 1..BODY_MAX_STEPS
# (median 3 steps), and with probability TAIL_PROB a long problem, uniform on
# TAIL_MIN_STEPS..MAX_STEPS. A gap between the two is what makes the tail a tail: in a batch
# of prompts most finish quickly and a few run 10-30x longer, so replicas drain at very
# different times, as in real reasoning rollouts.
STEP_SHIFT = 3.0
STEP_ALPHA = 2.4
BODY_MAX_STEPS = 12
TAIL_MIN_STEPS = 40
# One prompt in 16 (the recipe's batch) is a long one.
TAIL_PROB = 1 / 16

MIN_VALUE = 0
MAX_VALUE = 99
MAX_OPERAND = 9

PROMPT_HEADER = "Start at {start}. Apply the steps in order."
PROMPT_FOOTER = "Give the final value."
ANSWER_PREFIX = "Answer: "


def _step_cdf() -> list[float]:
    body = [(k + STEP_SHIFT) ** -STEP_ALPHA if k <= BODY_MAX_STEPS else 0.0 for k in range(MIN_STEPS, MAX_STEPS + 1)]
    body_total = math.fsum(body)
    tail_n = MAX_STEPS - TAIL_MIN_STEPS + 1
    weights = [
        (1 - TAIL_PROB) * b / body_total + (TAIL_PROB / tail_n if k >= TAIL_MIN_STEPS else 0.0)
        for k, b in zip(range(MIN_STEPS, MAX_STEPS + 1), body)
    ]
    total = math.fsum(weights)
    cdf, acc = [], 0.0
    for w in weights:
        acc += w
        cdf.append(acc / total)
    cdf[-1] = 1.0  # guard against rounding leaving a gap above the last bucket
    return cdf


_STEP_CDF = _step_cdf()


def step_probabilities() -> list[float]:
    """P(num_steps = k) for k = MIN_STEPS..MAX_STEPS, for reports and tests."""
    return [b - a for a, b in zip([0.0] + _STEP_CDF[:-1], _STEP_CDF)]


def sample_num_steps(rng: random.Random) -> int:
    """Draw a step count from the truncated power law (inverse-CDF sampling)."""
    return MIN_STEPS + bisect.bisect_left(_STEP_CDF, rng.random())


@dataclass(frozen=True)
class Problem:
    start: int
    operands: tuple[int, ...]  # signed, e.g. (5, -3, 8)
    prompt: str
    solution: str
    answer: int

    @property
    def num_steps(self) -> int:
        return len(self.operands)


def make_problem(rng: random.Random, num_steps: int | None = None) -> Problem:
    """Generate one problem; ``num_steps`` defaults to a draw from the long-tail law."""
    if num_steps is None:
        num_steps = sample_num_steps(rng)
    if not MIN_STEPS <= num_steps <= MAX_STEPS:
        raise ValueError(f"num_steps must be in {MIN_STEPS}..{MAX_STEPS}, got {num_steps}")

    value = rng.randint(MIN_VALUE, MAX_VALUE)
    start = value
    operands = []
    for _ in range(num_steps):
        digit = rng.randint(1, MAX_OPERAND)
        # Only signs that keep the running value inside 0..99 are allowed, so every
        # intermediate stays a 1-2 digit number; at least one sign always fits.
        signs = [s for s in (1, -1) if MIN_VALUE <= value + s * digit <= MAX_VALUE]
        operand = rng.choice(signs) * digit
        operands.append(operand)
        value += operand

    steps = " ".join(f"{i}: {op:+d}" for i, op in enumerate(operands, 1))
    prompt = f"{PROMPT_HEADER.format(start=start)} {steps} {PROMPT_FOOTER}"
    solution, answer = worked_solution(start, operands)
    return Problem(start=start, operands=tuple(operands), prompt=prompt, solution=solution, answer=answer)


def worked_solution(start: int, operands: Sequence[int], slips: Collection[int] = ()) -> tuple[str, int]:
    """The scratchpad for ``start`` and ``operands`` and the value it ends on.

    A step numbered in ``slips`` (1-based) writes a result one too high, or one too low where
    that would leave 0..99, and the following lines carry on from it: the careless slip of a
    noisy teacher, whose final answer is then wrong (SFT demonstrations use it, see sft.py).
    """
    value, lines = start, []
    for i, operand in enumerate(operands, 1):
        new_value = value + operand
        if i in slips:
            new_value += 1 if new_value < MAX_VALUE else -1
        lines.append(f"{i}: {operand:+d} {value}{operand:+d}={new_value}")
        value = new_value
    return "\n".join(lines + [f"{ANSWER_PREFIX}{value}"]), value


def generate_problems(n: int, seed: int) -> Iterator[Problem]:
    """Deterministic stream of problems; the same (n, seed) always yields the same list."""
    rng = random.Random(seed)
    for _ in range(n):
        yield make_problem(rng)


def to_row(problem: Problem, split: str, index: int) -> dict[str, Any]:
    """One row in verl's RL dataset format."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": problem.prompt}],
        "ability": ABILITY,
        "reward_model": {"style": "rule", "ground_truth": str(problem.answer)},
        "extra_info": {"split": split, "index": index, "num_steps": problem.num_steps},
    }


def stratified_order(problems: list[Problem], batch_size: int, seed: int) -> list[int]:
    """An order in which every consecutive ``batch_size`` problems span the whole length range.

    Problems are sorted by step count and dealt like cards into ``len // batch_size`` batches,
    so each batch gets one problem from each length stratum (one tail problem, a few mid, many
    short). Read in this order (the recipe sets ``data.shuffle=False``), every RL step sees the
    same mix: the reward curve then shows the policy changing rather than which prompts a step
    happened to draw, and every step has its long tail. Leftover problems go last.
    """
    rng = random.Random(seed)
    by_length = sorted(range(len(problems)), key=lambda i: (problems[i].num_steps, rng.random()))
    n_batches = len(problems) // batch_size
    dealt = by_length[: n_batches * batch_size][::-1]
    batches = [dealt[b::n_batches] for b in range(n_batches)]
    rng.shuffle(batches)
    # When the split holds fewer tail problems than batches, the batches without one go last,
    # so that a short run has its long tail at every step.
    batches.sort(key=lambda batch: max(problems[i].num_steps for i in batch) < TAIL_MIN_STEPS)
    for batch in batches:
        rng.shuffle(batch)
    return [i for batch in batches for i in batch] + by_length[n_batches * batch_size :]


def write_parquet(path: str | Path, n: int, seed: int, split: str, batch_size: int | None = None) -> Path:
    """Write ``n`` problems as a verl RL parquet file and return its path.

    With ``batch_size``, rows are in :func:`stratified_order`; ``extra_info.index`` keeps each
    problem's place in the generated stream either way.
    """
    import pandas as pd

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    problems = list(generate_problems(n, seed))
    order = stratified_order(problems, batch_size, seed) if batch_size else range(n)
    rows = [to_row(problems[i], split, i) for i in order]
    pd.DataFrame(rows).to_parquet(path, index=False)
    return path


# ---------------------------------------------------------------------------------------------
# Validation: a malformed user dataset must fail here with one readable line, not deep inside
# verl's dataloader workers.

REQUIRED_COLUMNS = ("data_source", "prompt", "ability", "reward_model", "extra_info")


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Read and validate a verl RL parquet file; raise ValueError naming file, row and column."""
    import pyarrow.parquet as pq

    path = Path(path)
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several unrelated types for unreadable files
        raise ValueError(f"{path}: cannot read as parquet: {_one_line(exc)}") from None

    for column in REQUIRED_COLUMNS:
        if column not in table.column_names:
            raise ValueError(f"{path}: row 0: missing column '{column}'")

    rows = table.to_pylist()
    if not rows:
        raise ValueError(f"{path}: file has no rows")
    for index, row in enumerate(rows):
        for column in REQUIRED_COLUMNS:
            problem = _check_field(column, row[column])
            if problem:
                raise ValueError(f"{path}: row {index}: bad column '{column}': {problem}")
    return rows


def _check_field(column: str, value: Any) -> str | None:
    """Return a short description of what is wrong with ``value``, or None if it is valid."""
    if column in ("data_source", "ability"):
        if not isinstance(value, str) or not value:
            return f"expected a non-empty string, got {_short(value)}"
    elif column == "prompt":
        if not isinstance(value, list) or not value:
            return f"expected a non-empty list of chat messages, got {_short(value)}"
        for i, message in enumerate(value):
            if (
                not isinstance(message, dict)
                or not isinstance(message.get("role"), str)
                or not isinstance(message.get("content"), str)
            ):
                return f"message {i} must be a dict with string 'role' and 'content', got {_short(message)}"
    elif column == "reward_model":
        if not isinstance(value, dict):
            return f"expected a dict with 'ground_truth', got {_short(value)}"
        truth = value.get("ground_truth")
        if not isinstance(truth, str) or not _is_int(truth):
            return f"'ground_truth' must be an integer string, got {_short(truth)}"
    elif column == "extra_info":
        if not isinstance(value, dict):
            return f"expected a dict, got {_short(value)}"
    return None


def _is_int(text: str) -> bool:
    try:
        int(text.strip())
    except ValueError:
        return False
    return True


def _short(value: Any, limit: int = 60) -> str:
    text = _one_line(repr(value))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _one_line(obj: Any) -> str:
    return " ".join(str(obj).split())
