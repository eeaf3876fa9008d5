"""EAGLE-3 drafter: fused low/mid/high target features, own (reduced-vocabulary) LM head, and
a training-time-test forward that unrolls several draft steps.

One step, as vLLM's ``Eagle3LlamaForCausalLM`` (``llama_eagle3.py``) runs it:

    g     = fc(cat(a_1, .., a_k))                 a_i: target residual stream at aux layer i
    x     = cat(input_layernorm(embed(tok)), hidden_norm(g))     2H wide into q/k/v
    r     = g + attn(x);   pre = r + mlp(post_attention_layernorm(r))
    out   = norm(pre)  -> lm_head -> draft-vocab logits;   pre -> next step's g

Later draft steps skip ``fc``: their hidden input is the previous step's ``pre``. With parallel
drafting (``cfg.parallel_drafting``, vLLM's ``parallel_drafting``) they do not chain: every later
step reads the mask token and ``fc(mask_hidden)``, a learned feature, so vLLM computes all k drafts
in one forward over the last real position followed by k - 1 mask positions.

Unrolling (training-time test). Slot t of step j stands for the draft at position t + j of a
chain that started from the target's features at position t: it reads token x_{t+j+1} and the
step j-1 output of the same slot, and attends to the step-0 keys of positions <= t (the ones
computed from target features) plus its own keys of steps 1..j. That is the key set vLLM's
KV cache holds when it drafts position t + j, so the training forward matches inference.
"""
from __future__ import annotations

import torch
from torch import nn

from .config import DrafterConfig
from .layers import MLP, Attention, RMSNorm, TargetTensors, check_target_tensors, init_weights
from .packing import BlockCausal, shift_within_samples


def vocab_maps(token_counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``d2t`` (int64 [Vd], ``target_id = i + d2t[i]``) and ``t2d`` (bool [V]) for the
    ``draft_vocab_size`` most frequent tokens, kept in ascending id order (ties: lower id)."""
    V = token_counts.shape[0]
    if not 0 < draft_vocab_size <= V:
        raise ValueError(f"draft_vocab_size={draft_vocab_size}: must be in [1, {V}]")
    order = torch.argsort(-token_counts.double(), stable=True)[:draft_vocab_size]
    ids = torch.sort(order).values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(draft_vocab_size), t2d


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        H = cfg.hidden_size
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, 2 * H)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, embeds, g, position_ids, mask=None, cu_seqlens=None, past_kv=()):
        # The residual is g itself (vLLM's norm_before_residual=False).
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(g)], dim=-1)
        attn, kv = self.self_attn(x, position_ids, mask, cu_seqlens, past_kv)
        r = g + attn
        return r + self.mlp(self.post_attention_layernorm(r)), kv


class Eagle3Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor):
        super().__init__()
        if cfg.kind != "eagle3":
            raise ValueError(f"Eagle3Drafter: config kind={cfg.kind!r}, expected 'eagle3'")
        check_target_tensors(cfg, embed_weight, lm_head_weight)
        self.cfg = cfg
        self.fc = nn.Linear(cfg.fc_in_features, cfg.hidden_size, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(cfg)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab, bias=False)
        init_weights(self)
        if cfg.parallel_drafting:
            # vLLM's buffer has the width of fc's input; it goes through fc like target features.
            self.mask_hidden = nn.Parameter(torch.randn(cfg.fc_in_features) * 0.02)
        self.target = TargetTensors(embed_weight, lm_head_weight)
        # The first draft_vocab ids until set_draft_vocab picks the frequent ones; vLLM reads
        # d2t only for a reduced vocabulary (export leaves both maps out otherwise).
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab, dtype=torch.long))
        self.register_buffer("t2d", torch.arange(cfg.vocab_size) < cfg.draft_vocab)
        self._init_lm_head()

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    @property
    def draft_to_target(self) -> torch.Tensor:
        return torch.arange(self.cfg.draft_vocab, device=self.d2t.device) + self.d2t

    def target_head_rows(self) -> torch.Tensor:
        """The target LM head restricted to the draft vocabulary (the teacher's logits)."""
        return self.target.lm_head_weight[self.draft_to_target]

    def set_draft_vocab(self, token_counts: torch.Tensor) -> None:
        """Choose the draft vocabulary from token frequencies and start the LM head from the
        target's rows for it (a far better start than random for a frozen-feature drafter)."""
        d2t, t2d = vocab_maps(token_counts, self.cfg.draft_vocab)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)
        self._init_lm_head()

    @torch.no_grad()
    def _init_lm_head(self) -> None:
        self.lm_head.weight.copy_(self.target_head_rows())

    def step(self, input_ids, g, position_ids, mask=None, cu_seqlens=None, past_kv=()):
        """One draft step: (normed output for the LM head, pre-norm output for the next step, kv)."""
        pre, kv = self.layers[0](self.target.embed(input_ids), g, position_ids, mask, cu_seqlens, past_kv)
        return self.norm(pre), pre, kv

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None, cu_seqlens=None) -> torch.Tensor:
        """Step 0 only. hidden [B, S, k*H] = cat of aux target states; returns the normed
        output [B, S, H] (logits via ``lm_head``)."""
        g = self.fc(hidden.to(self.fc.weight.dtype))
        return self.step(input_ids, g, position_ids, attention_mask, cu_seqlens)[0]

    def unroll(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
               seq_ids: torch.Tensor, num_steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Training-time test over packed rows: per step j, (normed output [B, S, H], valid [B, S])
        where ``valid`` marks slots whose position t + j is still inside their sample.

        Step j's token at slot t is x_{t+j+1} (ids shifted within the sample), or with parallel
        drafting the mask token; its keys are the block-causal step-0 keys plus the diagonal (same
        slot) keys of steps 1..j, which is what vLLM's attention sees in either mode."""
        g = self.fc(hidden.to(self.fc.weight.dtype))
        parallel = self.cfg.parallel_drafting
        past, outs = [], []
        for j in range(num_steps):
            ids_j, valid = shift_within_samples(input_ids, seq_ids, j)
            if parallel and j > 0:
                ids_j = torch.full_like(ids_j, self.cfg.mask_token_id)
                g = self.fc(self.mask_hidden.to(self.fc.weight.dtype)).expand_as(g)
            out, g, kv = self.step(ids_j, g, position_ids + j, BlockCausal(seq_ids, diagonal=j), None, past)
            past.append(kv)
            outs.append((out, valid))
        return outs
