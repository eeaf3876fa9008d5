"""Drafter configuration, derived from the target model's HF config.

Layer-id convention for EAGLE-3 auxiliary hidden states (the one vLLM uses):
layer id ``k`` is the residual stream *after* ``k`` target decoder layers, i.e. the input of
layer ``k``; id 0 is the token embedding. With transformers this is
``model(..., output_hidden_states=True).hidden_states[k]`` for ``0 <= k < L``. Id ``L`` is not
allowed: HF's ``hidden_states[L]`` is already passed through the final norm while vLLM's would
not be, so a drafter trained on it would see different inputs at serving time.

EAGLE-1/2 uses one hidden state per token instead: the target's *final* hidden state, after
its last norm (HF ``hidden_states[-1]``; what vLLM hands the drafter).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

KINDS = ("eagle", "eagle3")
# Qwen2 and Llama configs use the same attribute names for everything the drafter copies.
SUPPORTED_TARGETS = ("qwen2", "llama")


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """Low, middle and high layers, as SGLang / vLLM pick them: ``[2, L//2, L-3]``.

    For small targets (L < 7) those collide or leave ``[0, L-1]``; then the ids are spread
    evenly over ``[0, L-1]`` instead (L=2 -> (0, 1), L=4 -> (0, 2, 3)). The ids are always
    distinct and ascending, because vLLM collects aux states in layer order, once per layer.
    """
    if num_layers < 1:
        raise ValueError(f"target num_hidden_layers={num_layers}: must be >= 1")
    ids = (2, num_layers // 2, num_layers - 3)
    if len(set(ids)) == 3 and all(0 <= k < num_layers for k in ids):
        return ids
    return tuple(sorted({round(i * (num_layers - 1) / 2) for i in range(3)}))


@dataclass(frozen=True)
class DrafterConfig:
    kind: str
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int                      # the target's vocabulary; embeddings and ids live here
    target_num_layers: int
    target_hidden_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    # Llama semantics (what vLLM's drafter layer reads): bias on q, k, v *and* o. A Qwen2
    # target's q/k/v biases are not copied; the drafter is trained from scratch anyway.
    attention_bias: bool = False
    # EAGLE-3 only.
    aux_layer_ids: tuple[int, ...] = ()
    draft_vocab_size: int | None = None  # None: the full target vocabulary
    # EAGLE-3 with parallel drafting (vLLM's speculative_config.parallel_drafting): all k drafts
    # from one drafter forward. Positions after the last real token read `mask_token_id` and a
    # learned `mask_hidden` feature instead of the previous draft.
    parallel_drafting: bool = False
    mask_token_id: int | None = None

    def __post_init__(self):
        def need(cond: bool, msg: str):
            if not cond:
                raise ValueError(f"DrafterConfig.{msg}")

        need(self.kind in KINDS, f"kind={self.kind!r}: must be one of {', '.join(KINDS)}")
        for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "intermediate_size", "vocab_size", "target_num_layers", "target_hidden_size",
                     "max_position_embeddings"):
            value = getattr(self, name)
            need(isinstance(value, int) and value > 0, f"{name}={value!r}: must be a positive int")
        need(self.num_attention_heads % self.num_key_value_heads == 0,
             f"num_key_value_heads={self.num_key_value_heads}: must divide "
             f"num_attention_heads={self.num_attention_heads}")
        need(self.head_dim % 2 == 0, f"head_dim={self.head_dim}: must be even (rotary)")
        need(self.hidden_act == "silu", f"hidden_act={self.hidden_act!r}: only 'silu' is supported")
        need(self.rms_norm_eps > 0, f"rms_norm_eps={self.rms_norm_eps}: must be > 0")
        need(self.rope_theta > 0, f"rope_theta={self.rope_theta}: must be > 0")
        # The drafter consumes the target's embeddings next to its hidden state, and vLLM
        # asserts both have the same width.
        need(self.target_hidden_size == self.hidden_size,
             f"target_hidden_size={self.target_hidden_size}: must equal hidden_size="
             f"{self.hidden_size} (the drafter shares the target's embeddings)")
        if self.kind == "eagle":
            need(not self.aux_layer_ids, "aux_layer_ids: only for kind='eagle3'")
            need(self.draft_vocab_size is None, "draft_vocab_size: only for kind='eagle3'")
        else:
            ids = self.aux_layer_ids
            need(len(ids) >= 1, "aux_layer_ids: eagle3 needs at least one layer id")
            need(all(isinstance(k, int) and 0 <= k < self.target_num_layers for k in ids),
                 f"aux_layer_ids={list(ids)}: ids must be in [0, {self.target_num_layers - 1}]")
            need(list(ids) == sorted(set(ids)),
                 f"aux_layer_ids={list(ids)}: must be distinct and ascending")
            dv = self.draft_vocab_size
            need(dv is None or (isinstance(dv, int) and 0 < dv <= self.vocab_size),
                 f"draft_vocab_size={dv}: must be in [1, vocab_size={self.vocab_size}]")
        if self.parallel_drafting:
            need(self.kind == "eagle3", "parallel_drafting: only for kind='eagle3'")
            m = self.mask_token_id
            need(isinstance(m, int) and 0 <= m < self.vocab_size,
                 f"mask_token_id={m!r}: parallel drafting needs a token id in [0, {self.vocab_size - 1}]")
        else:
            need(self.mask_token_id is None, "mask_token_id: only with parallel_drafting")

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)

    @property
    def draft_vocab(self) -> int:
        return self.draft_vocab_size or self.vocab_size

    @property
    def fc_in_features(self) -> int:
        if self.kind == "eagle":
            return 2 * self.hidden_size                  # cat(embed(x_{t+1}), h_t)
        return self.num_aux * self.target_hidden_size    # cat(aux hidden states)

    def replace(self, **changes: Any) -> "DrafterConfig":
        return replace(self, **changes)

    @classmethod
    def from_target(cls, target: Any, kind: str = "eagle", *,
                    aux_layer_ids: tuple[int, ...] | list[int] | None = None,
                    draft_vocab_size: int | None = None,
                    attention_bias: bool = False,
                    parallel_drafting: bool = False) -> "DrafterConfig":
        """The drafter for ``target`` (an HF ``Qwen2Config`` / ``LlamaConfig``): its widths,
        heads, vocabulary and rope base, with one decoder layer."""
        model_type = getattr(target, "model_type", None)
        if model_type not in SUPPORTED_TARGETS:
            raise ValueError(f"target model_type={model_type!r}: supported targets are "
                             f"{', '.join(SUPPORTED_TARGETS)}")
        heads = target.num_attention_heads
        rope = getattr(target, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(target, "rope_theta", 10000.0))
        layers = target.num_hidden_layers
        if kind == "eagle3" and aux_layer_ids is None:
            aux_layer_ids = default_aux_layer_ids(layers)
        return cls(
            kind=kind,
            hidden_size=target.hidden_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(target, "num_key_value_heads", None) or heads,
            head_dim=getattr(target, "head_dim", None) or target.hidden_size // heads,
            intermediate_size=target.intermediate_size,
            vocab_size=target.vocab_size,
            target_num_layers=layers,
            target_hidden_size=target.hidden_size,
            rms_norm_eps=float(target.rms_norm_eps),
            # The drafter always uses plain rotary with the target's base: it is trained
            # from scratch, and the exported config says so explicitly.
            rope_theta=float(theta),
            max_position_embeddings=target.max_position_embeddings,
            hidden_act=target.hidden_act,
            attention_bias=attention_bias,
            aux_layer_ids=tuple(aux_layer_ids or ()),
            draft_vocab_size=draft_vocab_size,
            parallel_drafting=parallel_drafting,
            # The last id: a mask slot is told apart by its learned feature, not by the token.
            mask_token_id=target.vocab_size - 1 if parallel_drafting else None,
        )


ATTENTIONS = ("auto", "sdpa", "flash_varlen")


def resolve_attention(attention: str, device: torch.device, kind: str) -> str:
    """What "auto" means on `device` for a drafter of `kind`: flash-attn's varlen kernel on CUDA
    for EAGLE-1/2 (no dense S x S mask per packed row), the SDPA block-diagonal mask elsewhere."""
    if attention != "auto":
        return attention
    if device.type != "cuda" or kind != "eagle":
        return "sdpa"
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return "sdpa"
    return "flash_varlen"


@dataclass(frozen=True)
class LossConfig:
    """EAGLE loss weights: SmoothL1 on hidden states (EAGLE-1/2) and soft CE on the target's
    next-token distribution; EAGLE-3 drops the hidden-state term and decays later steps."""
    hidden_weight: float = 1.0
    prob_weight: float = 0.1
    eagle3_steps: int = 3
    step_decay: float = 0.8
    token_chunk: int = 1024
    vocab_chunk: int = 4096
    # "sdpa" (dense block-diagonal mask, any device), "flash_varlen" (cu_seqlens, CUDA with
    # flash-attn; EAGLE-1/2 only: EAGLE-3's unrolled steps need keys varlen cannot express), or
    # "auto": flash_varlen where it can run, else sdpa (`resolve_attention`).
    attention: str = "auto"

    def __post_init__(self):
        if self.attention not in ATTENTIONS:
            raise ValueError(f"LossConfig.attention={self.attention!r}: must be one of {', '.join(ATTENTIONS)}")
        for name in ("hidden_weight", "prob_weight", "step_decay"):
            if getattr(self, name) < 0:
                raise ValueError(f"LossConfig.{name}={getattr(self, name)}: must be >= 0")
        for name in ("eagle3_steps", "token_chunk", "vocab_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"LossConfig.{name}={getattr(self, name)}: must be >= 1")
