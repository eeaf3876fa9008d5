"""EAGLE-1/2 drafter: one Llama decoder layer on top of the target's features.

    g_t   = fc(cat(embed(x_{t+1}), h_t))          h_t: target's final hidden state (post-norm)
    o_t   = DecoderLayer(g_t)                      no input layernorm, no final norm
    logits = o_t @ target_lm_head.T                predicts x_{t+2}; o_t regresses h_{t+1}

This is exactly what vLLM's ``EagleLlamaForCausalLM`` computes (``llama_eagle.py``: layer 0's
``input_layernorm`` is ``nn.Identity``, the model returns ``hidden + residual`` without a norm,
and the shared target ``lm_head`` is applied to it), so an exported drafter drafts the same
tokens in vLLM as it did in training. No final norm is needed because the regression target
h_{t+1} is itself post-norm, i.e. already in the LM head's input space.

State-dict names match the vLLM / HF layout: ``fc.weight``, ``layers.0.self_attn.*``,
``layers.0.mlp.*``, ``layers.0.post_attention_layernorm.weight``.
"""
from __future__ import annotations

import torch
from torch import nn

from .config import DrafterConfig
from .layers import MLP, Attention, RMSNorm, TargetTensors, check_target_tensors, init_weights


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        # No input_layernorm: g_t mixes an embedding with a post-norm hidden state, and EAGLE
        # feeds it to attention as is (vLLM replaces the norm by Identity on layer 0).
        self.self_attn = Attention(cfg, cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, position_ids, mask=None, cu_seqlens=None, past_kv=()):
        attn, kv = self.self_attn(x, position_ids, mask, cu_seqlens, past_kv)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), kv


class EagleDrafter(nn.Module):
    def __init__(self, cfg: DrafterConfig, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor):
        super().__init__()
        if cfg.kind != "eagle":
            raise ValueError(f"EagleDrafter: config kind={cfg.kind!r}, expected 'eagle'")
        check_target_tensors(cfg, embed_weight, lm_head_weight)
        self.cfg = cfg
        self.fc = nn.Linear(cfg.fc_in_features, cfg.hidden_size, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(cfg)])
        init_weights(self)
        self.target = TargetTensors(embed_weight, lm_head_weight)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.target.lm_head_weight

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None, cu_seqlens=None) -> torch.Tensor:
        """input_ids [B, S] (= x_{t+1}), hidden [B, S, H] (= h_t), position_ids [B, S] (= t)
        -> predicted h_{t+1} [B, S, H]. ``attention_mask`` [B, S, S] boolean, a ``BlockCausal`` or
        ``None`` (causal); ``cu_seqlens`` for flash-attn varlen (see ``packing``)."""
        x = self.fc(torch.cat([self.target.embed(input_ids), hidden.to(self.fc.weight.dtype)], dim=-1))
        for layer in self.layers:
            x, _ = layer(x, position_ids, attention_mask, cu_seqlens)
        return x

    def compute_logits(self, out: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits; for inspection and small vocabularies (training goes
        through the chunked soft cross-entropy instead)."""
        # The head may be held in the rollout's dtype (bf16) while the drafter computes in fp32.
        return out @ self.lm_head_weight.to(out.dtype).T
