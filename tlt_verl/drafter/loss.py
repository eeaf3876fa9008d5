"""Drafter training losses over a ``PackedBatch`` in drafter alignment (see ``packing``).

EAGLE-1/2: ``hidden_weight * SmoothL1(o_t, h_{t+1}) + prob_weight * softCE(o_t, p_{t+1})`` where
p_{t+1} = softmax(target_lm_head(h_{t+1})) is the target's own next-token distribution (soft
labels carry more than the sampled token, and keep the loss meaningful at temperature > 0).

EAGLE-3: soft CE only, summed over the unrolled steps with weights ``step_decay ** j``; the
teacher is the target distribution renormalised over the draft vocabulary.

Both are averaged over the response tokens marked in ``loss_mask``; the soft CE always goes
through the chunked kernel, so no [tokens x vocab] tensor is ever built.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from tlt_verl.kernels.soft_ce import soft_cross_entropy

from .config import LossConfig, resolve_attention
from .packing import PackedBatch, shift_within_samples


def _masked_mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (values * weights).sum() / weights.sum().clamp_min(1.0)


ATTENTION_INPUTS = {
    "sdpa": lambda batch: {"attention_mask": batch.block_causal()},
    "flash_varlen": lambda batch: {"cu_seqlens": batch.cu_seqlens()},
}


def eagle_loss(drafter, batch: PackedBatch, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    out = drafter(batch["input_ids"], batch["hidden"], batch.position_ids,
                  **ATTENTION_INPUTS[cfg.attention](batch))
    sel = batch["loss_mask"] > 0
    w = batch["loss_mask"][sel]
    pred, target = out[sel], batch["target_hidden"][sel].to(out.dtype)
    l_hidden = _masked_mean(F.smooth_l1_loss(pred, target, reduction="none").mean(-1), w)
    head = drafter.lm_head_weight
    ce = soft_cross_entropy(pred, head, target_hidden=target, target_weight=head,
                            token_chunk=cfg.token_chunk, vocab_chunk=cfg.vocab_chunk)
    l_prob = _masked_mean(ce, w)
    loss = cfg.hidden_weight * l_hidden + cfg.prob_weight * l_prob
    return loss, {"loss": loss.item(), "hidden_loss": l_hidden.item(), "prob_loss": l_prob.item(),
                  "tokens": int(sel.sum())}


def eagle3_loss(drafter, batch: PackedBatch, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    if cfg.attention != "sdpa":
        raise ValueError(f"LossConfig.attention={cfg.attention!r}: EAGLE-3 unrolling needs 'sdpa'")
    seq_ids = batch.seq_ids
    outs = drafter.unroll(batch["input_ids"], batch["hidden"], batch.position_ids, seq_ids,
                          cfg.eagle3_steps)
    teacher = drafter.target_head_rows()
    loss, metrics = 0.0, {}
    for j, (out, valid) in enumerate(outs):
        # Slot t of step j predicts what slot t + j of step 0 would: shift the labels with it.
        target, _ = shift_within_samples(batch["target_hidden"], seq_ids, j)
        mask, _ = shift_within_samples(batch["loss_mask"], seq_ids, j)
        sel = valid & (mask > 0)
        ce = soft_cross_entropy(out[sel], drafter.lm_head.weight,
                                target_hidden=target[sel].to(out.dtype), target_weight=teacher,
                                token_chunk=cfg.token_chunk, vocab_chunk=cfg.vocab_chunk)
        step_loss = _masked_mean(ce, mask[sel])
        loss = loss + cfg.step_decay ** j * step_loss
        metrics[f"step{j}_loss"] = step_loss.item()
        if j == 0:
            metrics["tokens"] = int(sel.sum())
    metrics["loss"] = loss.item()
    return loss, metrics


LOSSES = {"eagle": eagle_loss, "eagle3": eagle3_loss}


def drafter_loss(drafter, batch: PackedBatch, cfg: LossConfig | None = None):
    """(loss, metrics) for any drafter kind."""
    cfg = cfg or LossConfig()
    if cfg.attention == "auto":
        cfg = replace(cfg, attention=resolve_attention("auto", batch.position_ids.device, drafter.cfg.kind))
    return LOSSES[drafter.cfg.kind](drafter, batch, cfg)
