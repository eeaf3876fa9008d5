"""The reduced vocabulary an EAGLE-3 drafter drafts over, chosen from the warm-up's responses.

An EAGLE-3 drafter's LM head, and in training the teacher's logits it is fitted to, are
[tokens x draft vocabulary] per unrolled step. With the toy's 320 tokens that is nothing; with a
real LM's 49k-152k it is most of a training step and of a draft step, while the responses a target
writes use a few thousand distinct tokens. So for a large vocabulary the drafter drafts over the
``n`` tokens most frequent in the target's own responses (vLLM's ``d2t`` map puts its drafts back
in the target's ids), and the coverage of held-out responses by that set says what it costs:
a token outside it can never be drafted.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .eagle3 import vocab_maps

# "auto": vocabularies up to this size are drafted over whole (the toy's 320 among them), larger
# ones reduced to it. Measured on SmolLM2-135M (hidden 576, vocab 49,152), one core, training
# tokens/s: full vocabulary 73, 8,192 265, 4,096 380, 2,048 495 (the toy: 3,459); the head is still
# about two thirds of a step at 8,192 (93% at 49,152). Coverage pulls the other way (a token outside the
# set is one the drafter never proposes): on 256 chat_longtail prompts the held-out responses were
# covered 0.79 / 0.85 / 0.92 / 0.98 at 4,096 / 8,192 / 16,384 / 32,768 (bench/results/
# real_lm_drafter.json, draft_vocab.coverage_by_size_heldout), where all 6,343 distinct training
# tokens fit in 8,192.
AUTO_SIZE = 8192
AUTO = "auto"
# The sizes whose held-out coverage a warm-up reports: the evidence for choosing another n.
CURVE_SIZES = (1024, 2048, 4096, 8192, 16384, 32768)


def parse_draft_vocab(text: str | int) -> int | str:
    """``--draft-vocab``: "auto" or a token count >= 1; anything else refused in one line."""
    if text == AUTO or (isinstance(text, int) and not isinstance(text, bool) and text >= 1):
        return text
    if isinstance(text, str) and text.strip().isdigit() and int(text) >= 1:
        return int(text)
    raise ValueError(f"--draft-vocab {text}: must be 'auto' or a token count >= 1")


def resolve_draft_vocab(requested: int | str, vocab_size: int, kind: str) -> int | None:
    """The draft vocabulary size for a target of ``vocab_size`` tokens; None: the whole of it
    (the drafter config's "not reduced", for which no ``d2t`` map is written)."""
    if kind != "eagle3":
        if requested != AUTO:
            raise ValueError(f"--draft-vocab {requested}: only with --kind eagle3 (an eagle drafter drafts "
                             f"through the target's own head, over its whole vocabulary)")
        return None
    n = min(AUTO_SIZE, vocab_size) if requested == AUTO else requested
    if n > vocab_size:
        raise ValueError(f"--draft-vocab {n}: more than the target's vocabulary ({vocab_size} tokens)")
    return None if n == vocab_size else n


def token_counts(responses: Sequence[Sequence[int]], vocab_size: int) -> torch.Tensor:
    """Occurrences of each target id in ``responses`` (float64 [vocab_size]). Ids past the
    model's vocabulary (a tokenizer's added tokens no head row produces) are not counted."""
    flat = torch.tensor([t for r in responses for t in r], dtype=torch.long)
    flat = flat[(flat >= 0) & (flat < vocab_size)]
    return torch.bincount(flat, minlength=vocab_size).double()


def coverage(t2d: torch.Tensor, counts: torch.Tensor) -> float | None:
    """Fraction of the counted tokens that are in the draft vocabulary (None: nothing counted)."""
    total = float(counts.sum())
    return float(counts[t2d.to(counts.device)].sum()) / total if total else None


def coverage_curve(train: torch.Tensor, heldout: torch.Tensor, sizes: Sequence[int] = CURVE_SIZES) -> dict:
    """{size: coverage of ``heldout`` counts by the ``size`` tokens most frequent in ``train``}."""
    V = train.shape[0]
    return {n: coverage(vocab_maps(train, n)[1], heldout) for n in sizes if n < V}
