"""DataBuffer: the per-sample target features of recent RL steps that the drafter trains on.

Each record is one sample (prompt + response) of one RL step: token ids, the response mask,
and the target's hidden states the drafter kind needs, stored in half precision:

- EAGLE-1/2: the final (post-norm) hidden state.
- EAGLE-3: the aux-layer states (its input) *and* the final hidden state: the loss's teacher is
  the target's next-token distribution, ``softmax(lm_head(h_final))``, and storing h_final
  ([T, H]) is far smaller than storing that distribution ([T, V]).

The buffer holds at most ``budget_bytes`` of tensors in memory. The target changes every step,
so older steps are worth less: when full it evicts the oldest steps first, to a spill directory
(safetensors, read back lazily when sampled) if one is configured, else for good.
"""
from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tlt_verl.drafter.packing import align_sample

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
KINDS = ("eagle", "eagle3")


@dataclass(frozen=True)
class BufferConfig:
    kind: str = "eagle"
    budget_bytes: int = 1 << 30          # in-memory tensors
    dtype: str = "bfloat16"              # storage dtype of hidden states
    spill_dir: str | None = None         # None: evicted samples are dropped
    spill_budget_bytes: int | None = None  # None: no limit on disk; else oldest files deleted

    def __post_init__(self):
        def need(cond: bool, msg: str):
            if not cond:
                raise ValueError(f"BufferConfig.{msg}")

        need(self.kind in KINDS, f"kind={self.kind!r}: must be one of {', '.join(KINDS)}")
        need(self.dtype in DTYPES, f"dtype={self.dtype!r}: must be one of {', '.join(DTYPES)}")
        need(isinstance(self.budget_bytes, int) and self.budget_bytes > 0,
             f"budget_bytes={self.budget_bytes!r}: must be a positive int")
        sb = self.spill_budget_bytes
        need(sb is None or (isinstance(sb, int) and sb > 0),
             f"spill_budget_bytes={sb!r}: must be None or a positive int")
        need(sb is None or self.spill_dir is not None, "spill_budget_bytes: set without spill_dir")


@dataclass
class Sample:
    """One sample's tensors, position by position: ``input_ids`` [T], ``loss_mask`` [T] (True on
    response tokens), ``final_hidden`` [T, H], ``aux_hidden`` [T, k*H] (EAGLE-3 only)."""
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    final_hidden: torch.Tensor
    aux_hidden: torch.Tensor | None = None
    step: int = 0
    id: int = -1

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"input_ids": self.input_ids, "loss_mask": self.loss_mask, "final_hidden": self.final_hidden}
        if self.aux_hidden is not None:
            out["aux_hidden"] = self.aux_hidden
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def truncated(self, max_len: int) -> "Sample":
        if self.length <= max_len:
            return self
        cut = {k: v[:max_len] for k, v in self.tensors().items()}
        return Sample(cut["input_ids"], cut["loss_mask"], cut["final_hidden"], cut.get("aux_hidden"),
                      self.step, self.id)

    def aligned(self) -> dict[str, torch.Tensor]:
        """The drafter-aligned training slots (see ``packing.align_sample``)."""
        return align_sample(self.input_ids.long(), self.final_hidden, self.loss_mask, self.aux_hidden)


@dataclass
class _Record:
    id: int
    step: int
    length: int
    nbytes: int
    sample: Sample | None = None     # in memory
    file: str | None = None          # spilled: file name inside spill_dir


@dataclass
class BufferStats:
    added: int = 0
    spilled: int = 0
    dropped: int = 0                 # evicted from memory with nowhere to go, or deleted from disk

    def as_dict(self) -> dict:
        return asdict(self)


class DataBuffer:
    def __init__(self, cfg: BufferConfig | None = None):
        self.cfg = cfg or BufferConfig()
        self._dtype = DTYPES[self.cfg.dtype]
        self._records: dict[int, _Record] = {}
        self._next_id = 0
        self._memory_bytes = 0
        self._spill_bytes: dict[str, int] = {}    # file -> bytes on disk
        self.stats = BufferStats()
        # Filled by the rollout / actor side, read by the trainer: mutations and snapshots are
        # serialised, sample loading is not (a spilled file is immutable once renamed in).
        self._lock = threading.RLock()
        if self.cfg.spill_dir is not None:
            Path(self.cfg.spill_dir).mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ filling

    def add(self, step: int, input_ids: torch.Tensor, loss_mask: torch.Tensor,
            final_hidden: torch.Tensor, aux_hidden: torch.Tensor | None = None) -> int:
        """Store one sample of RL step ``step``; returns its id."""
        T = int(input_ids.shape[0])
        if T < 2:
            raise ValueError(f"DataBuffer.add: a sample needs >= 2 tokens, got {T}")
        if self.cfg.kind == "eagle3" and aux_hidden is None:
            raise ValueError("DataBuffer.add: kind='eagle3' needs aux_hidden (the aux-layer states)")
        for name, t in (("loss_mask", loss_mask), ("final_hidden", final_hidden), ("aux_hidden", aux_hidden)):
            if t is not None and t.shape[0] != T:
                raise ValueError(f"DataBuffer.add: {name} has {t.shape[0]} positions, input_ids {T}")
        sample = Sample(
            input_ids=input_ids.detach().to("cpu", torch.int32).clone(),
            loss_mask=loss_mask.detach().to("cpu", torch.bool).clone(),
            final_hidden=final_hidden.detach().to("cpu", self._dtype).clone(),
            # An EAGLE-1/2 drafter never reads aux states: not storing them is free budget.
            aux_hidden=(aux_hidden.detach().to("cpu", self._dtype).clone()
                        if self.cfg.kind == "eagle3" else None),
            step=int(step),
        )
        with self._lock:
            sample.id = self._next_id
            self._next_id += 1
            rec = _Record(sample.id, sample.step, T, sample.nbytes, sample=sample)
            self._records[rec.id] = rec
            self._memory_bytes += rec.nbytes
            self.stats.added += 1
            self._evict()
        return sample.id

    def _evict(self) -> None:
        if self._memory_bytes <= self.cfg.budget_bytes:
            return
        victims = []
        for rec in sorted((r for r in self._records.values() if r.sample is not None),
                          key=lambda r: (r.step, r.id)):
            if self._memory_bytes <= self.cfg.budget_bytes:
                break
            victims.append(rec)
            self._memory_bytes -= rec.nbytes
        if self.cfg.spill_dir is None:
            for rec in victims:
                del self._records[rec.id]
            self.stats.dropped += len(victims)
            return
        by_step: dict[int, list[_Record]] = {}
        for rec in victims:
            by_step.setdefault(rec.step, []).append(rec)
        for step, recs in by_step.items():
            self._spill(step, recs)
        self._trim_spill()

    def _spill(self, step: int, recs: list[_Record]) -> None:
        """One safetensors file per (step, eviction): keys ``<id>.<field>``."""
        name = f"step{step:08d}-{recs[0].id:010d}.safetensors"
        spill = Path(self.cfg.spill_dir)
        tensors = {f"{r.id}.{k}": v.contiguous() for r in recs for k, v in r.sample.tensors().items()}
        tmp = spill / f".{name}.tmp"
        save_file(tensors, str(tmp), metadata={"step": str(step)})
        os.replace(tmp, spill / name)     # a reader never sees a half-written file
        self._spill_bytes[name] = (spill / name).stat().st_size
        for r in recs:
            r.sample, r.file = None, name
        self.stats.spilled += len(recs)

    def _trim_spill(self) -> None:
        limit = self.cfg.spill_budget_bytes
        if limit is None:
            return
        # File names sort by (step, first id): oldest first.
        for name in sorted(self._spill_bytes):
            if sum(self._spill_bytes.values()) <= limit:
                break
            gone = [r.id for r in self._records.values() if r.file == name]
            for i in gone:
                del self._records[i]
            self.stats.dropped += len(gone)
            del self._spill_bytes[name]
            (Path(self.cfg.spill_dir) / name).unlink(missing_ok=True)

    # ------------------------------------------------------------------ reading

    def __len__(self) -> int:
        return len(self._records)

    @property
    def memory_bytes(self) -> int:
        return self._memory_bytes

    @property
    def spill_bytes(self) -> int:
        return sum(self._spill_bytes.values())

    def steps(self) -> list[int]:
        with self._lock:
            return sorted({r.step for r in self._records.values()})

    def ids(self, where: str = "all") -> list[int]:
        """Record ids, oldest first; ``where`` is "all", "memory" or "disk"."""
        with self._lock:
            recs = sorted(self._records.values(), key=lambda r: (r.step, r.id))
        keep = {"all": lambda r: True, "memory": lambda r: r.sample is not None,
                "disk": lambda r: r.file is not None}[where]
        return [r.id for r in recs if keep(r)]

    def get(self, sample_id: int) -> Sample:
        with self._lock:
            rec = self._records.get(sample_id)
        if rec is None:
            raise KeyError(f"DataBuffer: no sample {sample_id} (evicted or never added)")
        if rec.sample is not None:
            return rec.sample
        return self._load(rec)

    def _load(self, rec: _Record) -> Sample:
        path = Path(self.cfg.spill_dir) / rec.file
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            t = {k: f.get_tensor(f"{rec.id}.{k}") for k in ("input_ids", "loss_mask", "final_hidden", "aux_hidden")
                 if f"{rec.id}.{k}" in keys}
        return Sample(t["input_ids"], t["loss_mask"], t["final_hidden"], t.get("aux_hidden"), rec.step, rec.id)

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """Response-token frequencies over the buffer (EAGLE-3's draft vocabulary)."""
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for i in self.ids():
            s = self.get(i)
            counts += torch.bincount(s.input_ids[s.loss_mask].long(), minlength=vocab_size)
        return counts

    def _ordering(self, seed: int, epoch: int, recency_decay: float, max_age_steps: int | None) -> list[int]:
        """One pass over the buffer, most recent steps first in expectation: a weighted random
        permutation (exponential races) with weight ``recency_decay ** age``; ``age`` counts RL
        steps back from the newest one held."""
        with self._lock:
            recs = sorted(self._records.values(), key=lambda r: r.id)
        if not recs:
            return []
        newest = max(r.step for r in recs)
        ages = torch.tensor([newest - r.step for r in recs], dtype=torch.float64)
        keep = torch.ones(len(recs), dtype=torch.bool)
        if max_age_steps is not None:
            keep &= ages <= max_age_steps
        if recency_decay == 0.0:
            keep &= ages == 0
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        race = torch.empty(len(recs), dtype=torch.float64).exponential_(generator=g).log()
        if recency_decay > 0.0:
            race -= ages * math.log(recency_decay)
        order = [i for i in torch.argsort(race, stable=True).tolist() if keep[i]]
        return [recs[i].id for i in order]

    def sample_batches(self, max_tokens: int, *, seed: int = 0, recency_decay: float = 0.5,
                       max_age_steps: int | None = None, cursor: dict | None = None
                       ) -> Iterator[tuple[list[Sample], dict]]:
        """Endless micro-batches: lists of samples holding at most ``max_tokens`` training slots
        (a sample of T tokens has T-1; longer ones are cut to ``max_tokens + 1`` tokens), each
        with the cursor to resume *after* it. Passes over the buffer follow ``_ordering``; a
        pass is re-drawn from what the buffer holds when it starts, so new steps join at once.

        The order is a function of (seed, cursor, buffer contents) only: resuming from a
        cursor on the same buffer yields the same batches."""
        if max_tokens < 1:
            raise ValueError(f"sample_batches: max_tokens={max_tokens}: must be >= 1")
        if not 0.0 <= recency_decay <= 1.0:
            raise ValueError(f"sample_batches: recency_decay={recency_decay}: must be in [0, 1]")
        epoch, index = (cursor or {}).get("epoch", 0), (cursor or {}).get("index", 0)
        while True:
            order = self._ordering(seed, epoch, recency_decay, max_age_steps)
            if not order:      # the newest step always has age 0: only an empty buffer gets here
                raise ValueError("DataBuffer: no samples to train on")
            batch, used = [], 0
            while index < len(order):
                try:
                    s = self.get(order[index])
                except KeyError:          # evicted since this pass was drawn
                    index += 1
                    continue
                slots = min(s.length - 1, max_tokens)
                if batch and used + slots > max_tokens:
                    yield batch, {"epoch": epoch, "index": index}
                    batch, used = [], 0
                batch.append(s.truncated(max_tokens + 1))
                used += slots
                index += 1
            epoch, index = epoch + 1, 0
            if batch:
                yield batch, {"epoch": epoch, "index": 0}

    # ------------------------------------------------------------------ checkpoint metadata

    def state_dict(self) -> dict:
        """Metadata only (in-memory tensors are not checkpointed: they are cheap to recapture
        and large). Spilled samples are re-attached by ``load_state_dict``."""
        with self._lock:
            return {
                "version": 1,
                "config": asdict(self.cfg),
                "next_id": self._next_id,
                "steps": sorted({r.step for r in self._records.values()}),
                "memory_samples": sum(r.sample is not None for r in self._records.values()),
                "stats": self.stats.as_dict(),
                "spilled": [{"id": r.id, "step": r.step, "length": r.length, "nbytes": r.nbytes, "file": r.file}
                            for r in sorted(self._records.values(), key=lambda r: r.id) if r.file is not None],
            }

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != 1:
            raise ValueError(f"DataBuffer.load_state_dict: version={state.get('version')!r}, expected 1")
        with self._lock:
            self._next_id = max(self._next_id, int(state["next_id"]))
            self.stats = BufferStats(**state["stats"])
            if self.cfg.spill_dir is None:
                return
            spill = Path(self.cfg.spill_dir)
            for meta in state["spilled"]:
                path = spill / meta["file"]
                if meta["id"] in self._records or not path.exists():
                    continue
                self._records[meta["id"]] = _Record(meta["id"], meta["step"], meta["length"], meta["nbytes"],
                                                    file=meta["file"])
                self._spill_bytes[meta["file"]] = path.stat().st_size
