"""The drafter's masked attention on CUDA against the CPU's fp32 reference: a packed row (five
samples of uneven lengths, grouped-query heads), one dense call (CUDA's path, cuDNN left out) and
per-chunk key selection (the CPU's path), in fp32 and bf16; output and the three gradients; and
the time of one bf16 forward and backward per path.

    OUT=bench/results python bench/gpu_drafter_attention.py      # needs a CUDA device
"""
import json, os, time, torch
from tlt_verl.drafter.layers import MASK_CHUNK, masked_attention
torch.manual_seed(0)
S, lengths = 3 * MASK_CHUNK + 37, (90, 400, 5, 200, 3 * MASK_CHUNK + 37 - 695)
seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)); pos = torch.arange(S)
mask = ((seq[:, None] == seq[None, :]) & (pos[:, None] >= pos[None, :]))[None]
base = [torch.randn(1, h, S, 64) for h in (8, 2, 2)]
w = torch.linspace(-1, 1, S)[:, None]
def run(dev, dt, dense):
    q, k, v = (t.to(dev, dt).requires_grad_() for t in base)
    out = masked_attention(q, k, v, mask.to(dev), dense)
    g = torch.autograd.grad((out.float() * w.to(dev)).sum(), (q, k, v))
    return [t.detach().float().cpu() for t in (out, *g)]
ref = run("cpu", torch.float32, False)
res = {}
for dt in (torch.float32, torch.bfloat16):
    for dense in (True, False):
        got = run("cuda", dt, dense)
        res[f"cuda_{str(dt)[6:]}_{'dense' if dense else 'chunked'}_vs_cpu_fp32"] = [float((a - b).abs().max()) for a, b in zip(got, ref)]
for dense in (True, False):
    for _ in range(3): run("cuda", torch.bfloat16, dense)
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(20): run("cuda", torch.bfloat16, dense)
    torch.cuda.synchronize(); res[f"ms_per_fwd_bwd_bf16_{'dense' if dense else 'chunked'}"] = round(50 * (time.perf_counter() - t), 2)
res["order"] = "max abs diff of [out, dq, dk, dv]"
res["torch"] = torch.__version__
print(json.dumps(res, indent=1)); open(os.environ.get("OUT", "bench/results") + "/gpu_drafter_attention.json", "w").write(json.dumps(res, indent=1) + "\n")
