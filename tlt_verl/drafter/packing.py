"""Sequence packing for drafter training.

Several samples share one row; each keeps its own positions (restarting at 0) and attends only
to itself: the mask is block-diagonal causal. ``seq_ids`` (the sample each slot belongs to, -1
for padding) is the single source of truth; the SDPA mask and flash-attn's ``cu_seqlens`` are
both derived from it.

Drafter alignment (``align_sample``): the drafter at position t reads the target's hidden state
h_t and the *next* token x_{t+1} (the one the target sampled from h_t) and predicts h_{t+1}.
This is how vLLM feeds it (token ids shifted left by one, positions and hidden states not), so
a sample of T tokens gives T-1 training slots.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch


def align_sample(input_ids: torch.Tensor, final_hidden: torch.Tensor, loss_mask: torch.Tensor,
                 aux_hidden: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """One sample's tensors ([T], [T, H], [T], optional [T, k*H]) in drafter alignment.

    ``loss_mask[t]`` marks response tokens; slot t is trained when the token it reads,
    x_{t+1}, is a response token: from the first response token on, the drafter is what
    proposes the continuation."""
    T = input_ids.shape[0]
    if T < 2:
        raise ValueError(f"align_sample: a sample needs >= 2 tokens, got {T}")
    for name, t in (("final_hidden", final_hidden), ("loss_mask", loss_mask), ("aux_hidden", aux_hidden)):
        if t is not None and t.shape[0] != T:
            raise ValueError(f"align_sample: {name} has {t.shape[0]} positions, input_ids {T}")
    inputs = final_hidden if aux_hidden is None else aux_hidden
    return {"input_ids": input_ids[1:], "hidden": inputs[:-1],
            "target_hidden": final_hidden[1:], "loss_mask": loss_mask[1:].float()}


@dataclass
class PackedBatch:
    """Rows of packed samples. ``tensors`` holds every per-position field [R, S, ...]."""
    tensors: dict[str, torch.Tensor]
    position_ids: torch.Tensor   # [R, S], restarting at 0 per sample
    seq_ids: torch.Tensor        # [R, S], index of the sample in the input list, -1 = padding

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def block_causal(self) -> "BlockCausal":
        return BlockCausal(self.seq_ids)

    def cu_seqlens(self) -> tuple[torch.Tensor, int]:
        return cu_seqlens_from_seq_ids(self.seq_ids)


def pack(samples: Sequence[Mapping[str, torch.Tensor]], row_len: int, trim: bool = False) -> PackedBatch:
    """First-fit-decreasing packing of samples (dicts of equal-length tensors) into rows of
    ``row_len`` slots; padding is zero and has ``seq_ids == -1``. ``trim``: the rows end where the
    fullest one does (``row_len`` is then a cap): the trainer's micro-batches fill their row to 85%
    on average, and every padding slot costs a full forward and backward."""
    if not samples:
        raise ValueError("pack: no samples")
    lengths = [next(iter(s.values())).shape[0] for s in samples]
    for i, (s, n) in enumerate(zip(samples, lengths)):
        if n > row_len:
            raise ValueError(f"pack: sample {i} has {n} positions, more than row_len={row_len}")
        if any(t.shape[0] != n for t in s.values()):
            raise ValueError(f"pack: sample {i} fields differ in length")
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(samples)), key=lambda i: -lengths[i]):
        r = next((r for r, free in enumerate(room) if free >= lengths[i]), None)
        if r is None:
            rows.append([])
            room.append(row_len)
            r = len(rows) - 1
        rows[r].append(i)
        room[r] -= lengths[i]

    if trim:
        row_len -= min(room)
    first = samples[0]
    out = {k: t.new_zeros((len(rows), row_len, *t.shape[1:])) for k, t in first.items()}
    position_ids = torch.zeros(len(rows), row_len, dtype=torch.long)
    seq_ids = torch.full((len(rows), row_len), -1, dtype=torch.long)
    for r, members in enumerate(rows):
        at = 0
        for i in members:
            n = lengths[i]
            for k, t in samples[i].items():
                out[k][r, at:at + n] = t
            position_ids[r, at:at + n] = torch.arange(n)
            seq_ids[r, at:at + n] = i
            at += n
    return PackedBatch(out, position_ids, seq_ids)


@dataclass(frozen=True)
class BlockCausal:
    """The attention pattern of packed rows, kept as the slots' sample ids rather than a mask:
    each slot sees the slots of its own sample up to itself (padding sees padding), then
    ``diagonal`` more blocks of S keys in each of which it sees only its own slot (the later steps
    of EAGLE-3's unroll). ``chunks`` gives each run of queries its keys and its piece of the mask,
    so on the CPU the [R, S, (1 + diagonal) S] mask is never built nor scanned."""
    seq_ids: torch.Tensor        # [R, S]
    diagonal: int = 0

    def dense(self) -> torch.Tensor:
        """[R, S, (1 + diagonal) S] boolean (True = may attend)."""
        mask = block_causal_mask(self.seq_ids)
        eye = torch.eye(self.seq_ids.shape[-1], dtype=torch.bool, device=self.seq_ids.device).expand_as(mask)
        return torch.cat([mask] + [eye] * self.diagonal, dim=-1)

    def chunks(self, size: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Per ``size`` queries from slot c0: (c0, key indices [K], mask [R, n, K]). The keys are the
        step-0 slots from the start of the sample holding slot c0 (the earliest over the rows) up to
        the last query, then the queries' own slots in each diagonal block: every key any of them
        may see, and no more."""
        seq = self.seq_ids
        R, S = seq.shape
        at = torch.arange(S, device=seq.device)
        new_run = torch.ones_like(seq, dtype=torch.bool)
        new_run[:, 1:] = seq[:, 1:] != seq[:, :-1]
        run_start = torch.cummax(torch.where(new_run, at, 0), dim=1).values
        starts = range(0, S, size)
        # One host sync for all chunks: where the earliest sample of each chunk starts.
        firsts = run_start[:, list(starts)].amin(dim=0).tolist()
        for c0, lo in zip(starts, firsts):
            c1 = min(c0 + size, S)
            q_at, k_at = at[c0:c1], at[lo:c1]
            mask = (seq[:, c0:c1, None] == seq[:, None, lo:c1]) & (q_at[:, None] >= k_at[None, :])
            eye = torch.eye(c1 - c0, dtype=torch.bool, device=seq.device).expand(R, -1, -1)
            index = torch.cat([k_at] + [q_at + S * i for i in range(1, self.diagonal + 1)])
            yield c0, index, torch.cat([mask] + [eye] * self.diagonal, dim=-1)


def block_causal_mask(seq_ids: torch.Tensor) -> torch.Tensor:
    """[R, S, S] boolean (True = may attend): same sample and not in the future. Padding slots
    attend to padding only, so no query row is empty (an empty row would give SDPA NaNs)."""
    S = seq_ids.shape[-1]
    same = seq_ids[:, :, None] == seq_ids[:, None, :]
    causal = torch.ones(S, S, dtype=torch.bool, device=seq_ids.device).tril()
    return same & causal


def cu_seqlens_from_seq_ids(seq_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """flash-attn varlen boundaries over the flattened rows: each sample, and each padding run,
    is one sequence (padding then attends only to padding, as in the SDPA mask)."""
    flat = seq_ids.reshape(-1)
    # A new sequence starts where the sample id changes, and at each row start.
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1]
    starts[:: seq_ids.shape[-1]] = True
    idx = torch.nonzero(starts).flatten()
    bounds = torch.cat([idx, idx.new_tensor([flat.numel()])]).to(torch.int32)
    return bounds, int((bounds[1:] - bounds[:-1]).max())


def shift_within_samples(x: torch.Tensor, seq_ids: torch.Tensor, j: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` at slot t + j of the same row ([R, S, ...]), and whether slot t + j still belongs to
    the sample of slot t. Invalid slots hold slot t's own value (never used for a loss)."""
    if j == 0:
        return x, seq_ids >= 0
    S = seq_ids.shape[-1]
    src = torch.arange(S, device=seq_ids.device) + j
    inside = src < S
    src = torch.where(inside, src, torch.arange(S, device=seq_ids.device))
    valid = inside[None, :] & (seq_ids.gather(1, src.expand_as(seq_ids)) == seq_ids) & (seq_ids >= 0)
    index = src.view(1, S, *([1] * (x.dim() - 2))).expand(x.shape[0], S, *x.shape[2:])
    shifted = x.gather(1, index)
    keep = valid.view(*valid.shape, *([1] * (x.dim() - 2)))
    return torch.where(keep, shifted, x), valid
