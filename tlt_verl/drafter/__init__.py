"""The TLT drafter: EAGLE-1/2 and EAGLE-3 models trained on the target's hidden states.

    cfg = DrafterConfig.from_target(target.config, kind="eagle")
    drafter = build_drafter(cfg, *target_tensors(target))
"""
from __future__ import annotations

import torch

from .config import DrafterConfig, LossConfig, default_aux_layer_ids
from .eagle import EagleDrafter
from .eagle3 import Eagle3Drafter, vocab_maps

DRAFTERS = {"eagle": EagleDrafter, "eagle3": Eagle3Drafter}


def build_drafter(cfg: DrafterConfig, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor):
    return DRAFTERS[cfg.kind](cfg, embed_weight, lm_head_weight)


def target_tensors(target: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding weight, LM head weight) of an HF causal LM; the same tensor twice when tied."""
    return target.get_input_embeddings().weight, target.get_output_embeddings().weight


__all__ = ["DRAFTERS", "DrafterConfig", "Eagle3Drafter", "EagleDrafter", "LossConfig",
           "build_drafter", "default_aux_layer_ids", "target_tensors", "vocab_maps"]
