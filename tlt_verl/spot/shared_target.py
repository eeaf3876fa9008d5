"""SharedTarget: the target's embedding and LM head, owned by the actor's process and read in
place by its drafter's child process.

A drafter reads the target's embedding and LM head (vocabulary x hidden each: 2.2 GB at 7B in
bf16). Sending them through the pipe at every weight sync would put a pickled copy on the sync's
critical path, and a second and third on the host. Instead the actor's process owns one segment
per rank, in the rollout's dtype on the drafter's device: host shared memory on CPU, device memory
shared by CUDA IPC on GPU; both go through torch's own tensor sharing (``torch.multiprocessing``'s
reductions), so CPU and GPU take one path. The child maps the segment once, when it starts (a
restarted child maps it again), and a weight sync rewrites it in place: what crosses the pipe is
a version number.

The owner is the process that outlives the other: the actor. The child may die (an OOM, a
SIGKILL) without taking the tensors with it; the segment is freed with the ``SharedTarget``.

Rewriting in place is safe only while the child reads nothing: the owner asks the child to hold
(its training thread parks at a micro-step boundary, ``DrafterService.hold_target``), writes, then
hands it the new version (``DrafterService.release_target``).
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing  # noqa: F401  (registers torch's tensor reductions with ForkingPickler)

# Rows compared and copied at a time: one chunk's cast is the only transient memory a write adds.
CHUNK_BYTES = 64 << 20


@dataclass(frozen=True)
class TargetRef:
    """What a child is handed instead of the tensors: a sharing handle and the version they hold.
    Open it at most once (a CPU handle is a file descriptor the owner passes once)."""
    handle: bytes
    version: int

    def open(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(embed, lm_head), mapped from the owner's segment: no copy. The same tensor twice when tied."""
        return pickle.loads(self.handle)


class SharedTarget:
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, device: str | torch.device,
                 tied: bool):
        self.device, self.dtype, self.tied = torch.device(device), dtype, tied

        def segment() -> torch.Tensor:
            t = torch.empty(vocab_size, hidden_size, dtype=dtype, device=self.device)
            # CPU memory must be moved into shared memory before a handle can name it; CUDA memory
            # is shared through IPC as it is.
            return t.share_memory_() if self.device.type == "cpu" else t

        self.embed = segment()
        self.lm_head = self.embed if tied else segment()
        self.version = 0
        self._dirty = False
        self.bytes_copied = 0        # written into the segment, all versions together

    @property
    def nbytes(self) -> int:
        n = self.embed.numel() * self.embed.element_size()
        return n if self.tied else 2 * n

    def ref(self) -> TargetRef:
        """A fresh handle (each child opens its own)."""
        return TargetRef(bytes(ForkingPickler.dumps((self.embed, self.lm_head))), self.version)

    def write(self, embed: torch.Tensor, lm_head: torch.Tensor) -> bool:
        """Copy new values in (cast to the segment's dtype, moved to its device, a chunk at a time);
        chunks that are unchanged are not copied. True, and a new version, when anything changed."""
        self.write_part("embed", embed)
        if not self.tied:
            self.write_part("lm_head", lm_head)
        return self.commit()

    def write_part(self, which: str, src: torch.Tensor) -> None:
        """One of the two tensors (``"embed"`` or ``"lm_head"``), straight from wherever it is (a
        weight stream's device tensor: no host copy first); ``commit`` closes the version. Tied:
        the model reads the embedding for both, whatever the stream names lm_head."""
        if which not in ("embed", "lm_head"):
            raise ValueError(f"SharedTarget.write_part: {which!r}: must be 'embed' or 'lm_head'")
        if self.tied and which == "lm_head":
            return
        dst = self.embed if which == "embed" else self.lm_head
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(f"SharedTarget.write: {which} has shape {tuple(src.shape)}, the segment holds "
                             f"{tuple(dst.shape)}")
        rows = max(1, CHUNK_BYTES // max(1, dst.shape[1] * dst.element_size()))
        for a in range(0, dst.shape[0], rows):
            part = src[a:a + rows].detach().to(dst.device, dst.dtype)
            if torch.equal(dst[a:a + rows], part):
                continue
            dst[a:a + rows].copy_(part)
            self.bytes_copied += part.numel() * dst.element_size()
            self._dirty = True

    def commit(self) -> bool:
        """A new version if anything was written since the last commit; True then."""
        changed, self._dirty = self._dirty, False
        if changed:
            self.version += 1
        return changed

    def load(self, folder, tie_word_embeddings: bool) -> None:
        """The target's checkpoint values, read from its safetensors a chunk at a time (version 1)."""
        from tlt_verl.drafter.target_weights import copy_target_tensors

        copy_target_tensors(folder, tie_word_embeddings, self.embed, self.lm_head, CHUNK_BYTES)
        self.bytes_copied += self.nbytes
        self.version += 1
