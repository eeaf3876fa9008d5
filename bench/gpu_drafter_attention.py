"""The drafter's masked attention on CUDA against the CPU's fp32 reference: a packed row (five
samples of uneven lengths, grouped-query heads), one dense call (CUDA's path, cuDNN left out) and
per-chunk key selection (the CPU's path), in fp32 and bf16; output and the three gradients; and
the time of one bf16 forward and backward per path.

    OUT=bench/results python bench/gpu_drafter_attention.py      # needs a CUDA device
"""
import json
import os
import time

import torch

from tlt_verl.drafter.layers import masked_attention

PATHS = {"dense": True, "chunked": False}


def packed_row():
    """A row of five samples of uneven lengths: S, the slots' sample ids [1, S] and the mask
    [1, S, S] by which each position sees its own sample's past."""
    S = 3 * 256 + 37    # the row bench/results/gpu_drafter_attention.json was measured on (MASK_CHUNK was 256)
    lengths = (90, 400, 5, 200, S - 695)
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.arange(S)
    return S, seq[None], ((seq[:, None] == seq[None, :]) & (pos[:, None] >= pos[None, :]))[None]


def run(inputs, mask, weights, device, dtype, dense):
    """Output and the gradients of q, k, v (under an uneven upstream gradient), in fp32 on the CPU."""
    q, k, v = (t.to(device, dtype).requires_grad_() for t in inputs)
    out = masked_attention(q, k, v, mask.to(device), dense)
    grads = torch.autograd.grad((out.float() * weights.to(device)).sum(), (q, k, v))
    return [t.detach().float().cpu() for t in (out, *grads)]


def main() -> None:
    torch.manual_seed(0)
    S, _, mask = packed_row()
    inputs = [torch.randn(1, heads, S, 64) for heads in (8, 2, 2)]   # grouped-query: 8 query heads, 2 kv
    weights = torch.linspace(-1, 1, S)[:, None]
    ref = run(inputs, mask, weights, "cpu", torch.float32, dense=False)
    res = {}
    for dtype in (torch.float32, torch.bfloat16):
        for name, dense in PATHS.items():
            got = run(inputs, mask, weights, "cuda", dtype, dense)
            res[f"cuda_{str(dtype)[6:]}_{name}_vs_cpu_fp32"] = [float((a - b).abs().max()) for a, b in zip(got, ref)]
    for name, dense in PATHS.items():
        for _ in range(3):
            run(inputs, mask, weights, "cuda", torch.bfloat16, dense)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            run(inputs, mask, weights, "cuda", torch.bfloat16, dense)
        torch.cuda.synchronize()
        res[f"ms_per_fwd_bwd_bf16_{name}"] = round(1000 * (time.perf_counter() - t0) / 20, 2)
    res["order"] = "max abs diff of [out, dq, dk, dv]"
    res["torch"] = torch.__version__
    print(json.dumps(res, indent=1))
    out = os.path.join(os.environ.get("OUT", "bench/results"), "gpu_drafter_attention.json")
    with open(out, "w") as f:
        f.write(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
