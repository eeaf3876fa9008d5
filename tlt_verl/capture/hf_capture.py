"""The target hidden states a drafter trains on, from one forward pass of an HF target.

What is captured (the layer-id convention of ``tlt_verl.drafter.config``):
- final: the last decoder layer's output after the final norm, i.e. HF's
  ``hidden_states[-1]`` and what vLLM hands an EAGLE-1/2 drafter;
- aux (EAGLE-3): the residual stream at the *input* of each aux layer ``k`` (``k = 0`` is the
  token embedding), i.e. HF's ``hidden_states[k]``, concatenated in layer order.

Both come back aligned token by token with ``input_ids``: row b, position t is the state the
target computed at token t. The actor update's forward produces the same tensors (it runs the same
forward), so a drafter trained on either sees one distribution.

Only the base model runs: the LM head's [tokens x vocab] logits are never materialised, and aux
states are taken by hooks instead of ``output_hidden_states`` (which keeps every layer).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class Captured:
    final: torch.Tensor               # [B, T, H]
    aux: torch.Tensor | None          # [B, T, k*H]; None without aux layer ids
    attention_mask: torch.Tensor      # [B, T], 1 on real tokens


def _base_model(target: torch.nn.Module) -> torch.nn.Module:
    base = getattr(target, "model", target)
    if not hasattr(base, "layers") or not hasattr(base, "norm"):
        raise ValueError(f"capture: {type(target).__name__} has no decoder layers / final norm "
                         f"where a Llama/Qwen2 causal LM keeps them")
    return base


@torch.no_grad()
def capture_hidden(target: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   position_ids: torch.Tensor | None = None, *, aux_layer_ids: Sequence[int] = ()) -> Captured:
    """``input_ids`` [B, T]; ``attention_mask`` [B, T] (any padding side); ``position_ids``
    default to 0 at each row's first real token (what the rollout engine used: HF would
    otherwise count left padding as positions)."""
    base = _base_model(target)
    L = len(base.layers)
    if any(not 0 <= k < L for k in aux_layer_ids):
        raise ValueError(f"capture: aux_layer_ids={list(aux_layer_ids)}: ids must be in [0, {L - 1}]")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if position_ids is None:
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)

    grabbed: dict[int, torch.Tensor] = {}

    def grab(k):
        def hook(_module, args, kwargs):
            grabbed[k] = args[0] if args else kwargs["hidden_states"]
        return hook

    handles = [base.layers[k].register_forward_pre_hook(grab(k), with_kwargs=True) for k in aux_layer_ids]
    try:
        out = base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=False)
    finally:
        for h in handles:
            h.remove()
    aux = torch.cat([grabbed[k] for k in aux_layer_ids], dim=-1) if aux_layer_ids else None
    return Captured(out.last_hidden_state, aux, attention_mask)


def capture_samples(target: torch.nn.Module, sequences: Sequence[Sequence[int] | torch.Tensor],
                    response_starts: Sequence[int], *, aux_layer_ids: Sequence[int] = (),
                    batch_tokens: int = 8192, pad_id: int = 0) -> list[dict[str, torch.Tensor]]:
    """Per-sample records for ``DataBuffer.add``: ``input_ids`` [T], ``loss_mask`` [T] (True
    from ``response_starts[i]`` on), ``final_hidden`` [T, H], ``aux_hidden`` [T, k*H] or None.

    Sequences are batched by length (right padding, so no real token ever sees a pad) under a
    budget of ``batch_tokens`` padded tokens."""
    if len(sequences) != len(response_starts):
        raise ValueError(f"capture_samples: {len(sequences)} sequences, {len(response_starts)} response starts")
    seqs = [torch.as_tensor(s, dtype=torch.long) for s in sequences]
    device = next(target.parameters()).device
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    out: list[dict | None] = [None] * len(seqs)
    at = 0
    while at < len(order):
        # Ascending lengths: the last member sets the padded width.
        end = at + 1
        while end < len(order) and (end - at + 1) * len(seqs[order[end]]) <= batch_tokens:
            end += 1
        idx = order[at:end]
        width = len(seqs[idx[-1]])
        ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
        mask = torch.zeros(len(idx), width, dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, : len(seqs[i])] = seqs[i]
            mask[r, : len(seqs[i])] = 1
        cap = capture_hidden(target, ids.to(device), mask.to(device), aux_layer_ids=aux_layer_ids)
        for r, i in enumerate(idx):
            T = len(seqs[i])
            out[i] = {
                "input_ids": seqs[i],
                "loss_mask": torch.arange(T) >= response_starts[i],
                "final_hidden": cap.final[r, :T].cpu(),
                "aux_hidden": None if cap.aux is None else cap.aux[r, :T].cpu(),
            }
        at = end
    return out
