"""StagingBuffer: captured samples held for a drafter that lives in another process.

The actor update captures in the actor's process; the drafter trains in a child process
(so that its death does not take the actor down). Capture adds here, and the drafter's host hands
the staged samples over in one message before its next call, so the child's DataBuffer sees them
in capture order and applies its own budget and eviction.

Capture asks first (``admit``) which of a micro-batch's samples would survive the budget, and
copies only those off the device: a micro-batch larger than the budget never lands on the host
whole."""
from __future__ import annotations

import threading

import torch


class StagingBuffer:
    """Bounded like the child's buffer: past ``budget_bytes`` the oldest samples go first, as the
    child would evict them on arrival anyway, so the actor's host never holds more than one
    buffer's worth of states between two calls."""

    def __init__(self, budget_bytes: int | None = None):
        self._lock = threading.Lock()
        self._samples: list[tuple] = []
        self._sizes: list[int] = []
        self.budget_bytes = budget_bytes
        self.nbytes = 0
        self.dropped = 0

    def admit(self, sizes: list[int]) -> int:
        """Of samples about to be added with these byte sizes (in order), how many leading ones
        the later ones would evict at once: those need not be copied, and are counted as dropped.
        The budget keeps the newest samples that fit, at least one."""
        if self.budget_bytes is None or not sizes:
            return 0
        kept, total = 0, 0
        for size in reversed(sizes):
            if kept and total + size > self.budget_bytes:
                break
            total += size
            kept += 1
        skip = len(sizes) - kept
        with self._lock:
            self.dropped += skip
        return skip

    def add(self, step: int, input_ids: torch.Tensor, loss_mask: torch.Tensor,
            final_hidden: torch.Tensor, aux_hidden: torch.Tensor | None = None) -> None:
        def own(t):
            if t is None:
                return None
            t = t.detach().to("cpu")
            # A view of a larger storage is cloned: serialising a view writes its entire storage.
            # A tensor that owns its storage (capture's own host copy) is taken as it is.
            whole = t.is_contiguous() and t.storage_offset() == 0 and \
                t.untyped_storage().nbytes() == t.numel() * t.element_size()
            return t if whole else t.clone()

        sample = (int(step), own(input_ids), own(loss_mask), own(final_hidden), own(aux_hidden))
        size = sum(t.numel() * t.element_size() for t in sample[1:] if t is not None)
        with self._lock:
            self._samples.append(sample)
            self._sizes.append(size)
            self.nbytes += size
            while self.budget_bytes is not None and self.nbytes > self.budget_bytes and len(self._samples) > 1:
                self._samples.pop(0)
                self.nbytes -= self._sizes.pop(0)
                self.dropped += 1

    def take(self, max_bytes: int | None = None) -> list[tuple]:
        """The oldest staged samples, up to ``max_bytes`` (at least one), as ``DataBuffer.add``
        arguments; they leave the stage. ``max_bytes=None``: all of them."""
        with self._lock:
            n, total = 0, 0
            while n < len(self._samples) and (max_bytes is None or n == 0 or total + self._sizes[n] <= max_bytes):
                total += self._sizes[n]
                n += 1
            out, self._samples = self._samples[:n], self._samples[n:]
            del self._sizes[:n]
            self.nbytes -= total
        return out

    def __len__(self) -> int:
        return len(self._samples)
