"""StagingBuffer: captured samples held for a drafter that lives in another process.

The actor's log-prob pass captures in the actor's process; the drafter trains in a child process
(so that its death does not take the actor down). Capture adds here, and the drafter's host hands
the staged samples over in one message before its next call, so the child's DataBuffer sees them
in capture order and applies its own budget and eviction."""
from __future__ import annotations

import threading

import torch


class StagingBuffer:
    def __init__(self):
        self._lock = threading.Lock()
        self._samples: list[tuple] = []

    def add(self, step: int, input_ids: torch.Tensor, loss_mask: torch.Tensor,
            final_hidden: torch.Tensor, aux_hidden: torch.Tensor | None = None) -> None:
        # Clones: capture hands over views of a whole micro-batch, and serialising a view
        # writes its entire storage.
        def own(t):
            return None if t is None else t.detach().to("cpu").clone()

        sample = (int(step), own(input_ids), own(loss_mask), own(final_hidden), own(aux_hidden))
        with self._lock:
            self._samples.append(sample)

    def take(self) -> list[tuple]:
        """The staged samples, oldest first, as ``DataBuffer.add`` arguments; the stage is emptied."""
        with self._lock:
            out, self._samples = self._samples, []
        return out

    def __len__(self) -> int:
        return len(self._samples)
