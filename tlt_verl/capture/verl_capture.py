"""Target hidden states from verl's actor update, into a DataBuffer in the same process.

The actor update already runs the target over every prompt + response of the RL step (its
training forward); hooks on the actor's decoder take the states a drafter needs from that forward
instead of running another one, so TLT needs no old log-prob pass and leaves
``algorithm.rollout_correction.bypass_mode`` as the user set it. Each sample lands in the buffer
exactly as the offline path (``hf_capture`` + ``DataBuffer.add`` in ``drafter.warmup``) would store
it: its prompt + response tokens, a loss mask that is True on the response tokens the policy
generated, and the states at every one of those positions.

Only the update's first epoch is kept: each sample is captured once, from the weights the
rollout sampled it with when the step has one mini-batch (later mini-batches see the weights the
earlier ones moved, which the next rollout samples with anyway).

Capture is off unless :func:`enable` was called in this process (a drafter worker colocated with
the actor calls it); off, nothing is hooked and verl runs as shipped. ``patches.verl_capture``
scopes it to ``ActorRolloutRefWorker.update_actor`` (not the log-prob or reference passes) and
hands each micro-batch to :meth:`CapturePass.collect`.

Under Ulysses sequence parallelism every rank of a group sees the same samples and stores them:
the buffers of one group are copies.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .buffer import DTYPES, KINDS, BufferConfig, DataBuffer
from .hooks import HiddenStateHooks
from .verl_batch import SampleLayout, layout, split, unpad

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CaptureConfig:
    kind: str                            # "eagle" (final states) or "eagle3" (aux + final)
    aux_layer_ids: tuple[int, ...] = ()  # EAGLE-3 only; layer-id convention of drafter.config
    buffer: BufferConfig = BufferConfig()

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"CaptureConfig.kind={self.kind!r}: must be one of {', '.join(KINDS)}")
        ids = list(self.aux_layer_ids)
        if self.kind == "eagle" and ids:
            raise ValueError("CaptureConfig.aux_layer_ids: only for kind='eagle3'")
        if self.kind == "eagle3" and (not ids or ids != sorted(set(ids)) or ids[0] < 0):
            raise ValueError(f"CaptureConfig.aux_layer_ids={ids}: eagle3 needs distinct, ascending, "
                             f"non-negative layer ids")
        if self.buffer.kind != self.kind:
            raise ValueError(f"CaptureConfig.buffer.kind={self.buffer.kind!r} differs from kind={self.kind!r}")


@dataclass
class CaptureStats:
    passes: int = 0
    micro_batches: int = 0
    samples: int = 0
    skipped: int = 0          # no response token, or fewer than 2 tokens: nothing to train on
    seconds: float = 0.0      # spent in collect(): what capture adds to the actor update


class _Capture:
    def __init__(self, cfg: CaptureConfig, sink=None):
        self.cfg = cfg
        self.buffer = DataBuffer(cfg.buffer) if sink is None else sink
        self.stats = CaptureStats()
        self.warned_untagged = False


_lock = threading.Lock()
_state: _Capture | None = None
# The pass in flight, keyed by the engine whose forward it hooks: verl's ref and actor engines
# share the process, and only the actor's may feed the buffer.
_active: tuple[object, "CapturePass"] | None = None


def enable(kind: str, aux_layer_ids: Sequence[int] = (), buffer_config: BufferConfig | None = None,
           sink=None) -> DataBuffer:
    """Start capturing in this process into a new buffer, which is returned. ``buffer_config``
    defaults to ``BufferConfig(kind=kind)``; enabling again replaces the buffer. ``sink``: capture
    into that object instead (anything with ``DataBuffer.add``'s signature, such as the
    ``StagingBuffer`` a drafter hosted in another process is fed from)."""
    global _state
    cfg = CaptureConfig(kind, tuple(int(k) for k in aux_layer_ids), buffer_config or BufferConfig(kind=kind))
    with _lock:
        _state = _Capture(cfg, sink)
        return _state.buffer


def disable() -> DataBuffer | None:
    """Stop capturing; returns the buffer that was filled (None if capture was off). A pass already
    running finishes into it."""
    global _state
    with _lock:
        state, _state = _state, None
    return None if state is None else state.buffer


def enabled() -> bool:
    return _state is not None


def buffer() -> DataBuffer | None:
    state = _state
    return None if state is None else state.buffer


def config() -> CaptureConfig | None:
    state = _state
    return None if state is None else state.cfg


def stats() -> CaptureStats | None:
    state = _state
    return None if state is None else state.stats


class CapturePass:
    """One actor update: hooks on ``model`` while open, one :meth:`collect` per micro-batch, for
    the first ``limit`` samples (the update's first epoch; None: all)."""

    def __init__(self, state: _Capture, engine: object, model: torch.nn.Module, limit: int | None = None):
        self._state = state
        self._engine = engine
        self._hooks = HiddenStateHooks(model, state.cfg.aux_layer_ids if state.cfg.kind == "eagle3" else ())
        self._left = limit
        state.stats.passes += 1
        self._pass_index = state.stats.passes

    def __enter__(self) -> "CapturePass":
        global _active
        if _active is not None:
            raise RuntimeError("capture: an actor update is already being captured in this process")
        self._hooks.__enter__()
        _active = (self._engine, self)
        return self

    def __exit__(self, exc_type, *exc) -> None:
        global _active
        _active = None
        # A forward whose micro-batch never reached collect() means verl ran the actor through
        # a path the patch does not wrap: its samples would be missing without a word.
        missed = self._hooks.pending
        self._hooks.remove()
        if missed and exc_type is None:
            raise RuntimeError("capture: the actor ran a forward in update_actor whose outputs did not go "
                               "through FSDPEngineWithLMHead.prepare_model_outputs; nothing was captured for it")

    def collect(self, micro_batch, *, packed: bool,
                gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> int:
        """Add the samples of the forward that just ran on ``micro_batch``; returns how many."""
        if self._left is not None and self._left <= 0:
            return 0                     # a later epoch: captured already, and no hook ran
        t0 = time.perf_counter()
        try:
            return self._collect(micro_batch, packed, gather)
        finally:
            self._state.stats.seconds += time.perf_counter() - t0

    def _collect(self, micro_batch, packed: bool, gather) -> int:
        final, aux = self._hooks.take()
        lay = layout(micro_batch)
        if self._left is not None:
            self._left -= len(lay.lengths)
            if self._left <= 0:
                # The first epoch is in: the later ones run as stock verl does, without hooks.
                self._hooks.remove()
        steps = self._steps(lay)
        dtype = DTYPES[self._state.cfg.buffer.dtype]
        sink = self._state.buffer
        stats = self._state.stats
        masks = [lay.loss_mask(i) for i in range(len(lay.lengths))]
        wanted = [i for i, n in enumerate(lay.lengths) if n >= 2 and bool(masks[i].any())]
        stats.skipped += len(lay.lengths) - len(wanted)
        ids = micro_batch["input_ids"].values().cpu().split(lay.lengths)
        # The sink's budget first, then the copy: the samples it would evict at once (a micro-batch
        # larger than the whole budget) never leave the device.
        if wanted and hasattr(sink, "admit"):
            width = final.shape[-1] + (aux.shape[-1] if aux is not None else 0)
            per_token = ids[0].element_size() + 1 + width * torch.empty((), dtype=dtype).element_size()
            wanted = wanted[sink.admit([lay.lengths[i] * per_token for i in wanted]):]

        def rows(t: torch.Tensor) -> list[torch.Tensor]:
            # Un-pad on the device (under sequence parallelism it is an all-gather); then each
            # kept sample's rows are copied to the host on their own, cast to the buffer's dtype.
            return split(unpad(t, packed=packed, gather=gather), lay.lengths, packed=packed)

        finals = rows(final)
        auxes = rows(aux) if aux is not None else [None] * len(finals)

        def host(t: torch.Tensor | None) -> torch.Tensor | None:
            # On a GPU a fresh host tensor; on CPU a view, which the sink copies out (once).
            return None if t is None else t.to("cpu", dtype)

        for i in wanted:
            sink.add(steps[i], ids[i], masks[i], host(finals[i]), host(auxes[i]))
        stats.micro_batches += 1
        stats.samples += len(wanted)
        return len(wanted)

    def _steps(self, lay: SampleLayout) -> list[int]:
        if all(s is not None for s in lay.steps):
            return lay.steps
        if not self._state.warned_untagged:
            log.warning("capture: the update batch carries no step tag (global_steps / max_global_steps); "
                        "tagging its samples with the number of captured passes (%d)", self._pass_index)
            self._state.warned_untagged = True
        return [self._pass_index if s is None else s for s in lay.steps]


def capture_pass(engine: object, model: torch.nn.Module, limit: int | None = None) -> CapturePass | None:
    """A pass for the actor ``engine`` running ``model``, or None when capture is off."""
    state = _state
    return None if state is None else CapturePass(state, engine, model, limit)


def active_pass(engine: object) -> CapturePass | None:
    active = _active
    return active[1] if active is not None and active[0] is engine else None
