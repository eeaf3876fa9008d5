"""Soft cross-entropy over a large vocabulary without materialising N x V logits.

    loss[n] = -sum_v p[n, v] * log_softmax(hidden @ weight.T)[n, v]
    p       = softmax(target_hidden @ target_weight.T)   (or softmax(target_logits))

The drafter's logits and the target's are both recomputed per (token chunk, vocab chunk) tile;
only per-token statistics (running max, sum of exponentials, sum of p * z) survive across vocab
tiles (online logsumexp). Backward recomputes the tiles again and uses
d loss / d z = g * (softmax(z) - p), so peak extra memory is a couple of tiles plus the weight
gradient, independent of V * N.

The per-tile elementwise work has two interchangeable implementations (``_OPS``): plain torch,
and Triton kernels used only for CUDA tensors when Triton imports. The matmuls stay in torch
(cuBLAS / oneDNN do them better than a hand-written kernel would).

No gradient flows to the target side (``target_*``): it is the teacher.
"""
from __future__ import annotations

import torch

try:  # Triton is optional; CPU builds may ship it but can never launch it.
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the install
    triton = None


# ---------------------------------------------------------------------------- per-tile ops

# Running maxima start at, and never go below, a finite floor: a tile whose target logits are
# all -inf (a masked-out vocabulary slice) then contributes exp(-inf) = 0 instead of NaN.
_FLOOR = -1e30


def _torch_tile_stats(z: torch.Tensor, y: torch.Tensor):
    """Row statistics of one fp32 tile: max/sumexp of z, max/sumexp of y, sum exp(y-my) * z."""
    mz = z.amax(dim=1).clamp_min(_FLOOR)
    sz = torch.exp(z - mz[:, None]).sum(dim=1)
    my = y.amax(dim=1).clamp_min(_FLOOR)
    ey = torch.exp(y - my[:, None])
    return mz, sz, my, ey.sum(dim=1), (ey * z).sum(dim=1)


def _torch_tile_grad(z, y, lse_z, lse_y, g):
    """d loss / d z for one tile, written over z (z is a scratch recomputation)."""
    p = torch.exp(y - lse_y[:, None])
    return z.sub_(lse_z[:, None]).exp_().sub_(p).mul_(g[:, None])


_OPS = {"torch": (_torch_tile_stats, _torch_tile_grad)}

if triton is not None:

    @triton.jit
    def _stats_kernel(z_ptr, y_ptr, out_ptr, n_cols, stride_z, stride_y, BLOCK: tl.constexpr):
        # One program per row; online max / sum over column blocks for both distributions.
        row = tl.program_id(0)
        mz = tl.full((), -1e30, tl.float32)
        sz = tl.zeros((), tl.float32)
        my = tl.full((), -1e30, tl.float32)
        sy = tl.zeros((), tl.float32)
        ayz = tl.zeros((), tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = cols < n_cols
            z = tl.load(z_ptr + row * stride_z + cols, mask=ok, other=-float("inf")).to(tl.float32)
            y = tl.load(y_ptr + row * stride_y + cols, mask=ok, other=-float("inf")).to(tl.float32)
            mz_new = tl.maximum(mz, tl.max(z, 0))
            sz = sz * tl.exp(mz - mz_new) + tl.sum(tl.exp(z - mz_new), 0)
            mz = mz_new
            my_new = tl.maximum(my, tl.max(y, 0))
            ey = tl.exp(y - my_new)
            scale = tl.exp(my - my_new)
            sy = sy * scale + tl.sum(ey, 0)
            ayz = ayz * scale + tl.sum(ey * tl.where(ok, z, 0.0), 0)   # ey is 0 where masked
            my = my_new
        base = out_ptr + row * 5
        tl.store(base + 0, mz)
        tl.store(base + 1, sz)
        tl.store(base + 2, my)
        tl.store(base + 3, sy)
        tl.store(base + 4, ayz)

    @triton.jit
    def _grad_kernel(z_ptr, y_ptr, lse_z_ptr, lse_y_ptr, g_ptr, n_cols, stride_z, stride_y,
                     BLOCK: tl.constexpr):
        row = tl.program_id(0)
        lse_z = tl.load(lse_z_ptr + row)
        lse_y = tl.load(lse_y_ptr + row)
        g = tl.load(g_ptr + row)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = cols < n_cols
            z = tl.load(z_ptr + row * stride_z + cols, mask=ok, other=0.0).to(tl.float32)
            y = tl.load(y_ptr + row * stride_y + cols, mask=ok, other=0.0).to(tl.float32)
            dz = g * (tl.exp(z - lse_z) - tl.exp(y - lse_y))
            tl.store(z_ptr + row * stride_z + cols, dz, mask=ok)

    # The kernels index rows by stride and columns by offset: tiles must have unit column stride.
    _unit_cols = lambda t: t if t.stride(1) == 1 else t.contiguous()

    def _triton_tile_stats(z, y):
        y = _unit_cols(y)
        out = torch.empty(z.shape[0], 5, device=z.device, dtype=torch.float32)
        _stats_kernel[(z.shape[0],)](z, y, out, z.shape[1], z.stride(0), y.stride(0), BLOCK=1024)
        return out.unbind(dim=1)

    def _triton_tile_grad(z, y, lse_z, lse_y, g):
        y, g = _unit_cols(y), g.float().contiguous()
        _grad_kernel[(z.shape[0],)](z, y, lse_z, lse_y, g, z.shape[1], z.stride(0), y.stride(0),
                                    BLOCK=1024)
        return z

    _OPS["triton"] = (_triton_tile_stats, _triton_tile_grad)


def _backend(device: torch.device, requested: str | None) -> str:
    if requested is not None:
        if requested not in _OPS:
            raise ValueError(f"soft_cross_entropy backend={requested!r}: available {sorted(_OPS)}")
        if requested == "triton" and device.type != "cuda":
            raise ValueError(f"soft_cross_entropy backend='triton': needs CUDA tensors, got {device.type}")
        return requested
    return "triton" if device.type == "cuda" and "triton" in _OPS else "torch"


# ---------------------------------------------------------------------------- autograd

class _Target:
    """The teacher's logits for a tile: from (hidden, weight) or from given logits."""

    def __init__(self, hidden, weight, logits):
        if logits is None and (hidden is None or weight is None):
            raise ValueError("soft_cross_entropy: give target_logits or target_hidden and target_weight")
        self.hidden, self.weight, self.logits = hidden, weight, logits

    def tile(self, rows: slice, cols: slice) -> torch.Tensor:
        if self.logits is not None:
            return self.logits[rows, cols].float()
        return (self.hidden[rows] @ self.weight[cols].to(self.hidden.dtype).T).float()


def _tiles(n: int, chunk: int):
    return [slice(a, min(a + chunk, n)) for a in range(0, n, chunk)]


class _SoftCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, t_hidden, t_weight, t_logits, token_chunk, vocab_chunk, backend):
        stats, _ = _OPS[backend]
        target = _Target(t_hidden, t_weight, t_logits)
        n, v = hidden.shape[0], weight.shape[0]
        lse_z = torch.empty(n, device=hidden.device, dtype=torch.float32)
        lse_y = torch.empty_like(lse_z)
        loss = torch.empty_like(lse_z)
        for rows in _tiles(n, token_chunk):
            m = rows.stop - rows.start
            mz = torch.full((m,), _FLOOR, device=hidden.device)
            my = torch.full_like(mz, _FLOOR)
            sz, sy, ayz = torch.zeros_like(mz), torch.zeros_like(mz), torch.zeros_like(mz)
            for cols in _tiles(v, vocab_chunk):
                z = (hidden[rows] @ weight[cols].to(hidden.dtype).T).float()
                cmz, csz, cmy, csy, cayz = stats(z, target.tile(rows, cols))
                new_mz, new_my = torch.maximum(mz, cmz), torch.maximum(my, cmy)
                sz = sz * torch.exp(mz - new_mz) + csz * torch.exp(cmz - new_mz)
                a, b = torch.exp(my - new_my), torch.exp(cmy - new_my)
                sy, ayz = sy * a + csy * b, ayz * a + cayz * b
                mz, my = new_mz, new_my
            lse_z[rows] = mz + torch.log(sz)
            lse_y[rows] = my + torch.log(sy)
            # -sum p (z - lse_z) = lse_z - sum p z, since p sums to one.
            loss[rows] = lse_z[rows] - ayz / sy
        ctx.save_for_backward(hidden, weight, t_hidden, t_weight, t_logits, lse_z, lse_y)
        ctx.chunks, ctx.backend = (token_chunk, vocab_chunk), backend
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, t_hidden, t_weight, t_logits, lse_z, lse_y = ctx.saved_tensors
        _, tile_grad = _OPS[ctx.backend]
        target = _Target(t_hidden, t_weight, t_logits)
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        d_hidden = torch.zeros_like(hidden, dtype=torch.float32) if want_h else None
        d_weight = torch.zeros_like(weight, dtype=torch.float32) if want_w else None
        token_chunk, vocab_chunk = ctx.chunks
        grad_loss = grad_loss.float()
        for rows in _tiles(hidden.shape[0], token_chunk):
            h = hidden[rows]
            for cols in _tiles(weight.shape[0], vocab_chunk):
                z = (h @ weight[cols].to(h.dtype).T).float()
                dz = tile_grad(z, target.tile(rows, cols), lse_z[rows], lse_y[rows], grad_loss[rows])
                if want_h:
                    d_hidden[rows] += dz @ weight[cols].float()
                if want_w:
                    d_weight[cols] += dz.T @ h.float()
        return (d_hidden.to(hidden.dtype) if want_h else None,
                d_weight.to(weight.dtype) if want_w else None,
                None, None, None, None, None, None)


def soft_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, *,
                       target_hidden: torch.Tensor | None = None,
                       target_weight: torch.Tensor | None = None,
                       target_logits: torch.Tensor | None = None,
                       token_chunk: int = 1024, vocab_chunk: int = 4096,
                       backend: str | None = None) -> torch.Tensor:
    """Per-token soft cross-entropy ``[N]`` of ``softmax(hidden @ weight.T)`` against the
    target distribution. ``hidden [N, H]``, ``weight [V, H]``; the target is either
    ``target_hidden [N, Ht]`` with ``target_weight [V, Ht]`` or ``target_logits [N, V]``.
    Gradients flow to ``hidden`` and ``weight`` only."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"soft_cross_entropy: hidden {tuple(hidden.shape)} and weight "
                         f"{tuple(weight.shape)} must be [N, H] and [V, H]")
    n, v = hidden.shape[0], weight.shape[0]
    if target_logits is not None and tuple(target_logits.shape) != (n, v):
        raise ValueError(f"soft_cross_entropy: target_logits {tuple(target_logits.shape)} "
                         f"must be [{n}, {v}]")
    if target_logits is None and target_hidden is not None and target_weight is not None:
        if target_hidden.shape[0] != n or target_weight.shape[0] != v:
            raise ValueError(f"soft_cross_entropy: target_hidden {tuple(target_hidden.shape)} / "
                             f"target_weight {tuple(target_weight.shape)} must be [{n}, Ht] / [{v}, Ht]")
    detach = (lambda t: None if t is None else t.detach())
    # Under autocast (the drafter's bf16 training) the tiles' logits, log-sum-exps and gradients
    # stay in one dtype, the widest given: a bf16 hidden against the fp32 LM head is promoted, so
    # the vocabulary-wide softmax is never computed in bf16.
    # The weights themselves are cast a vocabulary tile at a time: a drafter keeps the target's
    # LM head in the rollout's dtype (bf16), and a whole fp32 copy of it per forward is what it
    # must not hold.
    dtype = torch.promote_types(hidden.dtype, weight.dtype)
    cast = (lambda t: None if t is None else t.to(dtype) if t.is_floating_point() else t)
    with torch.autocast(hidden.device.type, enabled=False):
        return _SoftCE.apply(cast(hidden), weight, cast(detach(target_hidden)), detach(target_weight),
                             cast(detach(target_logits)), token_chunk, vocab_chunk,
                             _backend(hidden.device, backend))


def naive_soft_cross_entropy(hidden, weight, *, target_hidden=None, target_weight=None,
                             target_logits=None) -> torch.Tensor:
    """The reference: full logits, for tests and for small vocabularies."""
    if target_logits is None:
        target_logits = target_hidden @ target_weight.T
    p = torch.softmax(target_logits.detach().float(), dim=-1)
    return -(p * torch.log_softmax((hidden @ weight.T).float(), dim=-1)).sum(dim=-1)
