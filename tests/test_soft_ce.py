"""The chunked soft cross-entropy kernel: exact against the naive loss, and small in memory."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tlt_verl.kernels.soft_ce import naive_soft_cross_entropy, soft_cross_entropy

torch.set_num_threads(1)


def _inputs(n=37, h=16, v=101, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: (torch.randn(*s, generator=g) * 0.5).to(dtype)
    return mk(n, h).requires_grad_(), mk(v, h).requires_grad_(), mk(n, h), mk(v, h)


def _loss_and_grads(fn, hidden, weight, **target):
    hidden.grad = weight.grad = None
    g = torch.linspace(-1, 2, hidden.shape[0], device=hidden.device)   # uneven upstream gradient
    loss = fn(hidden, weight, **target)
    (loss * g).sum().backward()
    return loss.detach(), hidden.grad.clone(), weight.grad.clone()


@pytest.mark.parametrize("target_kind", ["hidden", "logits"])
@pytest.mark.parametrize("chunks", [(8, 10), (1, 101), (64, 7)])
def test_matches_naive_loss_and_gradients(target_kind, chunks):
    h, w, th, tw = _inputs()
    target = ({"target_hidden": th, "target_weight": tw} if target_kind == "hidden"
              else {"target_logits": th @ tw.T})
    token_chunk, vocab_chunk = chunks
    chunked = _loss_and_grads(lambda *a, **k: soft_cross_entropy(
        *a, token_chunk=token_chunk, vocab_chunk=vocab_chunk, **k), h, w, **target)
    naive = _loss_and_grads(naive_soft_cross_entropy, h, w, **target)
    for a, b in zip(chunked, naive):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_masked_target_vocabulary_tiles_stay_finite():
    # A vocab tile where the teacher puts no mass at all (-inf logits) must contribute nothing.
    h, w, th, tw = _inputs(v=40)
    logits = th @ tw.T
    logits[:, 10:20] = float("-inf")
    chunked = _loss_and_grads(lambda *a, **k: soft_cross_entropy(*a, vocab_chunk=10, **k),
                              h, w, target_logits=logits)
    naive = _loss_and_grads(naive_soft_cross_entropy, h, w, target_logits=logits)
    for a, b in zip(chunked, naive):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_gradients_only_where_asked():
    h, w, th, tw = _inputs()
    w.requires_grad_(False)                 # EAGLE-1: the LM head is the target's, frozen
    th.requires_grad_(True)
    soft_cross_entropy(h, w, target_hidden=th, target_weight=tw).sum().backward()
    assert h.grad is not None and w.grad is None and th.grad is None


def test_bf16_close_to_fp32():
    h, w, th, tw = _inputs()
    ref = soft_cross_entropy(h, w, target_hidden=th, target_weight=tw)
    low = soft_cross_entropy(h.bfloat16(), w.bfloat16(), target_hidden=th.bfloat16(),
                             target_weight=tw.bfloat16(), vocab_chunk=16)
    assert low.dtype == torch.float32
    torch.testing.assert_close(low, ref, atol=0.05, rtol=0.02)


def test_bad_shapes_are_refused_in_one_line():
    h, w, th, tw = _inputs()
    with pytest.raises(ValueError, match=r"target_logits \(3, 4\) must be \[37, 101\]"):
        soft_cross_entropy(h, w, target_logits=torch.zeros(3, 4))
    with pytest.raises(ValueError, match="must be \\[N, H\\] and \\[V, H\\]"):
        soft_cross_entropy(h, w[:, :3], target_logits=th @ tw.T)
    with pytest.raises(ValueError, match="backend='cuda-magic'"):
        soft_cross_entropy(h, w, target_hidden=th, target_weight=tw, backend="cuda-magic")


def test_triton_backend_refused_off_cuda():
    h, w, th, tw = _inputs()
    from tlt_verl.kernels import soft_ce
    if "triton" not in soft_ce._OPS:
        pytest.skip("triton is not installed")
    with pytest.raises(ValueError, match="backend='triton': needs CUDA tensors, got cpu"):
        soft_cross_entropy(h, w, target_hidden=th, target_weight=tw, backend="triton")


# Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported, hence a subprocess)
# runs the kernels on CPU tensors: the kernel logic is checked here even without a GPU.
_INTERPRET = textwrap.dedent("""
    import torch
    from tlt_verl.kernels import soft_ce as m
    g = torch.Generator().manual_seed(0)
    z, y = torch.randn(5, 2500, generator=g), torch.randn(5, 2500, generator=g)
    y[:, :1100] = float("-inf")                 # whole kernel blocks without teacher mass
    for a, b in zip(m._triton_tile_stats(z, y[:, :]), m._torch_tile_stats(z, y)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)
    lz, ly, gr = torch.logsumexp(z, 1), torch.logsumexp(y, 1), torch.randn(5, generator=g)
    torch.testing.assert_close(m._triton_tile_grad(z.clone(), y, lz, ly, gr),
                               m._torch_tile_grad(z.clone(), y, lz, ly, gr), atol=1e-6, rtol=1e-5)
    print("ok")
""")


def test_triton_tile_kernels_match_torch_in_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", _INTERPRET], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


# Peak memory, measured as the kernel really sees it: each variant runs in a fresh process;
# after the inputs exist, writing "5" to /proc/self/clear_refs resets the kernel's resident-set
# high-water mark (VmHWM) to the current RSS, so VmHWM - VmRSS after forward + backward is the
# peak extra resident memory of that computation, whatever allocator torch used.
_PROBE = textwrap.dedent("""
    import gc, sys, torch
    torch.set_num_threads(1)
    from tlt_verl.kernels.soft_ce import naive_soft_cross_entropy, soft_cross_entropy
    def status(name):
        return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(name))
    N, V, H = 4096, 32768, 64
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, H, generator=g).requires_grad_()
    w = (torch.randn(V, H, generator=g) * 0.1).requires_grad_()
    th, tw = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g) * 0.1
    fn = soft_cross_entropy if sys.argv[1] == "chunked" else naive_soft_cross_entropy
    fn(h[:8], w[:64], target_hidden=th[:8], target_weight=tw[:64]).sum().backward()  # lazy init
    h.grad = w.grad = None
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = status("VmRSS")
    fn(h, w, target_hidden=th, target_weight=tw).sum().backward()
    print(status("VmHWM") - base)
""")


def _peak_extra_kb(variant: str) -> int:
    out = subprocess.run([sys.executable, "-c", _PROBE, variant], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc/self/clear_refs (Linux)")
def test_peak_memory_is_a_fraction_of_naive():
    chunked, naive = _peak_extra_kb("chunked"), _peak_extra_kb("naive")
    # The naive loss holds several 4096 x 32768 fp32 matrices (512 MiB each).
    assert naive > 1_000_000, naive
    assert chunked <= 0.25 * naive, (chunked, naive)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton path needs a CUDA device")
def test_triton_backend_matches_torch_backend():
    pytest.importorskip("triton")
    h, w, th, tw = (t.detach().cuda().requires_grad_(t.requires_grad) for t in _inputs(n=300, h=64, v=5000))
    target = {"target_hidden": th, "target_weight": tw}
    runs = [_loss_and_grads(lambda *a, **k: soft_cross_entropy(*a, backend=b, vocab_chunk=1500, **k),
                            h, w, **target) for b in ("triton", "torch")]
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
