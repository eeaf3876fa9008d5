"""What a verl 0.9.1 actor micro-batch says about its samples: where each one is in the forward's
tensors, which of its tokens are response tokens, and which RL step it belongs to.

The micro-batch is the TensorDict verl's FSDP engine runs one forward on (``forward_step``). Its
``input_ids`` is a jagged nested tensor, one row per sample (prompt + response, no padding), and
it carries the rollout fields in one of two layouts:

- trainer v1 (``trainer.use_v1=True``, verl's default): ``prompts``, ``responses`` and
  ``response_mask`` per sample, nested (or dense when all rows happen to have one length);
- trainer v0 (``main_ppo_v0``): ``prompts`` left-padded, ``responses`` and ``response_mask``
  right-padded, and the padded ``attention_mask`` that says which of those are real.

Both are read the way verl's own ``no_padding_2_padding`` reads them.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from verl.utils import tensordict_utils as tu


@dataclass(frozen=True)
class SampleLayout:
    lengths: list[int]                 # tokens per sample: prompt + response
    prompt_lengths: list[int]
    response_masks: list[torch.Tensor]  # per sample, [length - prompt_length] bool
    steps: list[int | None]            # RL step per sample; None where the batch does not say

    def loss_mask(self, i: int) -> torch.Tensor:
        """[length] bool, True on the response tokens the policy generated."""
        prompt = torch.zeros(self.prompt_lengths[i], dtype=torch.bool, device=self.response_masks[i].device)
        return torch.cat([prompt, self.response_masks[i]])


def _field(mb, name: str) -> torch.Tensor:
    if name not in mb.keys():
        raise KeyError(f"capture: the actor micro-batch has no {name!r} (fields: {sorted(mb.keys())})")
    return mb[name]


def _row_lengths(t: torch.Tensor) -> list[int] | None:
    return t.offsets().diff().tolist() if t.is_nested else None


def layout(mb) -> SampleLayout:
    ids = _field(mb, "input_ids")
    if not ids.is_nested:
        raise ValueError("capture: the actor micro-batch's input_ids are not nested; verl 0.9.1's engine "
                         "only runs its no-padding layout")
    lengths = _row_lengths(ids)
    prompts = _field(mb, "prompts")
    prompt_lengths = _row_lengths(prompts)
    if prompt_lengths is None:
        if "attention_mask" in mb.keys() and not mb["attention_mask"].is_nested:
            # v0: left-padded prompts; the attention mask marks the real ones.
            prompt_lengths = mb["attention_mask"][:, : prompts.shape[1]].sum(-1).tolist()
        else:
            prompt_lengths = [prompts.shape[1]] * len(lengths)
    mask = _field(mb, "response_mask" if "response_mask" in mb.keys() else "loss_mask")
    response_masks = []
    for i, (n, p) in enumerate(zip(lengths, prompt_lengths, strict=True)):
        row = mask[i]
        r = n - p
        # v1 rows are exactly the response; v0 rows are right-padded to the longest response.
        if r < 0 or row.shape[0] < r or (mask.is_nested and row.shape[0] != r):
            raise ValueError(f"capture: sample {i} has {n} tokens and a {p}-token prompt, but a "
                             f"{row.shape[0]}-token response mask")
        response_masks.append(row[:r].bool())
    return SampleLayout(lengths, prompt_lengths, response_masks, step_tags(mb, len(lengths)))


def _per_sample(value, n: int) -> list:
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        value = [value] * n
    if len(value) != n:
        raise ValueError(f"capture: a per-sample step tag has {len(value)} entries for {n} samples")
    return list(value)


def step_tags(mb, n: int) -> list[int | None]:
    """The RL step of each sample.

    Trainer v1 stores the step whose dataloader batch a sample came from in its ``global_steps``
    field. Trainer v0 gives the actor's passes no step, only the version of the weights each
    response was sampled with (``max_global_steps``, stamped by the rollout server when the
    trainer pushes weights): in v0's synchronous loop step s samples with the weights pushed at
    the end of step s - 1, hence the + 1."""
    if "global_steps" in mb.keys():
        return [None if s is None else int(s) for s in _per_sample(tu.get(mb, "global_steps"), n)]
    if "max_global_steps" in mb.keys():
        return [None if v is None else int(v) + 1 for v in _per_sample(tu.get(mb, "max_global_steps"), n)]
    return [None] * n


def sample_count(data) -> int | None:
    """How many samples a worker call was handed: ``data`` is a TensorDict, or a transfer-queue
    batch handle (``KVBatchMeta``, one key per sample) that verl's bridge resolves inside the
    method. None when neither."""
    keys = getattr(data, "keys", None)
    if isinstance(keys, list):
        return len(keys)
    shape = getattr(data, "batch_size", None)
    return int(shape[0]) if shape is not None and len(shape) else None


def unpad(t: torch.Tensor, *, packed: bool,
          gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """A forward's activation ``t`` with the samples' positions only, ready for :func:`split`.

    ``packed``: ``t`` is [1, n, ...] holding the samples back to back, perhaps sharded across a
    sequence-parallel group and with padding at the tail; ``gather`` (the engine's own un-padding,
    the one it applies to its log-probs) turns the squeezed [n, ...] into the micro-batch's tokens.
    Otherwise ``t`` is [B, S, ...], one right-padded row per sample, and is returned as is."""
    if not packed:
        return t
    flat = t.squeeze(0)
    return gather(flat) if gather is not None else flat


def split(t: torch.Tensor, lengths: list[int], *, packed: bool) -> list[torch.Tensor]:
    """Per-sample rows of an :func:`unpad`-ed activation: [n, ...] back to back, or [B, S, ...]."""
    if packed:
        if t.shape[0] != sum(lengths):
            raise ValueError(f"capture: packed activation has {t.shape[0]} positions after un-padding, "
                             f"the micro-batch {sum(lengths)} tokens")
        return list(torch.split(t, lengths, dim=0))
    if t.shape[0] != len(lengths) or t.shape[1] < max(lengths):
        raise ValueError(f"capture: padded activation {tuple(t.shape)} does not hold {len(lengths)} samples "
                         f"of up to {max(lengths)} tokens")
    return [t[i, :n] for i, n in enumerate(lengths)]
