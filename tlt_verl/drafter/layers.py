"""Llama-style building blocks shared by the EAGLE drafters.

Parameter names follow HF / vLLM Llama (``self_attn.q_proj``, ``mlp.gate_proj``, ...), so a
drafter's ``state_dict`` is its checkpoint without renaming. The numerics follow vLLM's Llama
layer: RMSNorm in fp32, neox-style rotary (rotate_half), scale head_dim**-0.5, SwiGLU.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from .config import DrafterConfig
from .packing import BlockCausal

try:  # Only on CUDA builds; the varlen path is an option, SDPA is always there.
    from flash_attn import flash_attn_varlen_func
except Exception:  # pragma: no cover - depends on the install
    flash_attn_varlen_func = None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotary(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos, sin [B, 1, S, head_dim] for plain (rope_type 'default') rotary embeddings."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=position_ids.device).float() / head_dim)
    freqs = position_ids[..., None].float() * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _apply_rotary(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


# Queries per attention call when a mask is given on the CPU (see masked_attention). Each chunk
# attends to its samples' keys from the start of the earliest one: smaller chunks waste fewer keys
# but make more calls. EAGLE-3's 3-step unroll over a 1,740-slot row of 20-300-token samples,
# forward and backward of the attention alone: 95 ms at 128 against 107 ms at 256.
MASK_CHUNK = 128
# On CUDA the drafter's attention leaves cuDNN out. cuDNN's SDPA builds an execution plan for
# every new shape, 8-11 ms of host time per call on an H200 (torch 2.11), and packed rows give
# nearly every call a new shape: a drafter training step took 1.05 s there, 23 ms of it on the GPU
# (bench/results/drafter_train_speed.json). The memory-efficient kernel takes any boolean mask.
CUDA_SDPA_BACKENDS: tuple[SDPBackend, ...] | None = (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION,
                                                     SDPBackend.MATH)
# On CUDA a masked row is one dense call: the CPU's chunking picks each chunk's keys with a
# nonzero(), a host sync per chunk, to save work a GPU does not notice at drafter sizes.
DENSE_MASK_ON_CUDA = True


def sdpa(q, k, v, **kwargs) -> torch.Tensor:
    if not q.is_cuda or CUDA_SDPA_BACKENDS is None:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    with sdpa_kernel(list(CUDA_SDPA_BACKENDS)):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


def _mask_chunks(mask: torch.Tensor, size: int):
    """``BlockCausal.chunks`` for a mask given whole: each chunk's keys are those some of its
    queries may see, found by scanning the mask."""
    for c0 in range(0, mask.shape[1], size):
        m = mask[:, c0:c0 + size]
        cols = m.any(dim=1).any(dim=0).nonzero().squeeze(-1)
        yield c0, cols, m.index_select(2, cols)


def masked_attention(q, k, v, mask: torch.Tensor | BlockCausal, dense: bool) -> torch.Tensor:
    """``attend`` with a mask (a tensor, or packed rows' ``BlockCausal``): one call over the whole
    row (``dense``), or per chunk of queries."""
    gqa = q.shape[1] != k.shape[1]
    if dense:
        if isinstance(mask, BlockCausal):
            mask = mask.dense()
        if gqa:
            # Expanded here: CUDA's memory-efficient kernel has no grouped-query mode.
            rep = q.shape[1] // k.shape[1]
            k, v, gqa = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), False
        return sdpa(q, k, v, attn_mask=mask[:, None], enable_gqa=gqa)
    # A packed row holds many short samples, and the mask lets a query see only its own sample:
    # per chunk of queries, attend to just the keys some of them may see. Exact (the keys left
    # out have zero weight) and far cheaper than the dense row (a 2048-slot row of ~90-token
    # samples: EAGLE-3's 3-step unroll forward and backward 1.28 s -> 0.35 s on this CPU).
    chunks = mask.chunks(MASK_CHUNK) if isinstance(mask, BlockCausal) else _mask_chunks(mask, MASK_CHUNK)
    out = []
    for c0, cols, m in chunks:
        out.append(sdpa(q[:, :, c0:c0 + m.shape[1]], k.index_select(2, cols), v.index_select(2, cols),
                        attn_mask=m[:, None], enable_gqa=gqa))
    return torch.cat(out, dim=2)


def attend(q, k, v, mask: torch.Tensor | BlockCausal | None = None, cu_seqlens=None) -> torch.Tensor:
    """q [B, h, S, d], k/v [B, kv_h, Skv, d] -> [B, h, S, d].

    ``mask`` [B, S, Skv] boolean (True = attend), the packed rows' ``BlockCausal``, or ``None``
    for plain causal. ``cu_seqlens`` (a pair ``(bounds, max_len)`` over the flattened rows)
    selects flash-attn varlen on CUDA; it expresses only block-diagonal causal attention over the
    keys of the same step."""
    if cu_seqlens is not None:
        if flash_attn_varlen_func is None or not q.is_cuda:
            raise RuntimeError("cu_seqlens given but flash-attn varlen is unavailable (needs CUDA "
                               "and flash_attn); pass attention_mask instead")
        bounds, max_len = cu_seqlens
        B, h, S, d = q.shape
        flat = lambda t: t.transpose(1, 2).reshape(B * S, t.shape[1], d)
        out = flash_attn_varlen_func(flat(q), flat(k), flat(v), bounds, bounds, max_len, max_len,
                                     causal=True)
        return out.view(B, S, h, d).transpose(1, 2)
    if mask is None:
        return sdpa(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    dense = q.shape[2] <= MASK_CHUNK or (q.is_cuda and DENSE_MASK_ON_CUDA)
    return masked_attention(q, k, v, mask, dense)


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig, in_features: int):
        super().__init__()
        self.cfg = cfg
        h, kv, d, bias = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.attention_bias
        self.q_proj = nn.Linear(in_features, h * d, bias=bias)
        self.k_proj = nn.Linear(in_features, kv * d, bias=bias)
        self.v_proj = nn.Linear(in_features, kv * d, bias=bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=bias)

    def forward(self, x, position_ids, mask=None, cu_seqlens=None, past_kv=()):
        """Returns the output and this step's rotated (k, v). ``past_kv`` holds earlier steps'
        keys/values (EAGLE-3 unrolling); they are prepended to this step's along the key axis,
        and ``mask`` must cover all of them."""
        if cu_seqlens is not None and past_kv:
            raise ValueError("Attention: cu_seqlens (flash varlen) cannot attend to earlier steps' keys")
        B, S, _ = x.shape
        d = self.cfg.head_dim
        split = lambda t: t.view(B, S, -1, d).transpose(1, 2)
        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        cos, sin = rotary(position_ids, d, self.cfg.rope_theta, q.dtype)
        q, k = _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)
        keys = torch.cat([pk for pk, _ in past_kv] + [k], dim=2)
        values = torch.cat([pv for _, pv in past_kv] + [v], dim=2)
        out = attend(q, keys, values, mask, cu_seqlens)
        return self.o_proj(out.transpose(1, 2).reshape(B, S, -1)), (k, v)


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TargetTensors(nn.Module):
    """The target's embedding and LM head, held by reference and frozen.

    Stored as non-persistent buffers of ``detach()``-ed views: they share storage with the
    target (an in-place weight update of the target is seen at once), are not parameters (never
    in ``trainable_parameters()`` or an optimizer) and are not in ``state_dict`` (never
    checkpointed or exported). If the target's tensors are *replaced* (e.g. resharded), call
    ``bind`` again."""

    def __init__(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor):
        super().__init__()
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        self.register_buffer("lm_head_weight", lm_head_weight.detach(), persistent=False)

    def bind(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        if embed_weight.shape != self.embed_weight.shape or lm_head_weight.shape != self.lm_head_weight.shape:
            raise ValueError(f"bind: target shapes {tuple(embed_weight.shape)}/{tuple(lm_head_weight.shape)} "
                             f"differ from {tuple(self.embed_weight.shape)}/{tuple(self.lm_head_weight.shape)}")
        self.embed_weight = embed_weight.detach()
        self.lm_head_weight = lm_head_weight.detach()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed_weight)


def check_target_tensors(cfg: DrafterConfig, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor):
    want = (cfg.vocab_size, cfg.hidden_size)
    for name, t in (("embed_weight", embed_weight), ("lm_head_weight", lm_head_weight)):
        if tuple(t.shape) != want:
            raise ValueError(f"target {name} {tuple(t.shape)}: drafter expects {want} (vocab, hidden)")


def init_weights(module: nn.Module, std: float = 0.02) -> None:
    """Llama's init: normal(0, 0.02) linears, zero biases, unit norms."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, RMSNorm):
            nn.init.ones_(m.weight)
