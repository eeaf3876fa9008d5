"""SD off costs what plain decoding costs: no drafter forward while k=0; the drafter catches up
in one forward when drafting resumes.

vLLM 0.30's `SpecDecodeBaseProposer.propose` (v1/spec_decode/llm_base_proposer.py) runs the
drafter's first forward at every step, also when the step asks for k=0 drafts, so that the
drafter's KV cache stays in step with the target: measured 1.6x a plain engine's step at batch 1
(bench/results/sd_threshold.json). Here a k=0 step keeps only that forward's inputs, which the
target computed anyway (tokens, positions, hidden states and KV slots of the step: a few hundred
bytes to a few KB per request-step) and runs nothing. The first step that drafts again puts the
kept inputs of each request it holds in front of the request's own tokens, so one drafter forward
writes every position the drafter skipped and then drafts as usual: its KV cache then holds what
it would hold had it run at every step, and acceptance after the switch is unchanged.

Only a step that verified no drafts is skipped (its inputs are the target's own, one row per
position); the step that turns SD off still verifies the last drafts and runs the drafter once.
Kept rows are matched to the drafting step's requests by KV slot and position (see `Pending`).
What is kept is bounded by the drafter's token budget (rows of blocks no running request holds go
first, then the oldest); a position left without its row is simply not caught up, which costs
acceptance, never exactness: verification does not depend on what the drafter saw.

Written for the path vLLM shares between CPU and GPU (`SpecDecodeBaseProposer.propose`, which
the model runner of either calls the same way; EAGLE-1/EAGLE-3 and draft models). The kept rows
are released when the next drafting step consumes them, or by `release(model_runner)`, which
TLT's worker extension calls before a sleep on every platform: they live outside the memory
vLLM's sleep frees.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from tlt_verl.patches._guard import PatchError, require_attr

WHAT = "vLLM speculative decoding catch-up (no drafter forward while SD is off)"
# Only for the test that shows what the catch-up is for: skipped positions are then dropped.
DISABLE_CATCH_UP = "TLT_VLLM_DISABLE_SD_CATCH_UP"
_STATE = "_tlt_catch_up"


@dataclass
class _Step:
    tokens: torch.Tensor
    positions: torch.Tensor
    hidden: torch.Tensor
    slots: torch.Tensor


@dataclass
class Pending:
    """The drafter inputs of the steps that skipped it, in step order, at most `capacity` rows.

    Rows are matched to requests by KV slot, not by request: a slot's drafter KV must be what the
    drafter makes of the last target write to that slot, whoever wrote it. So a prompt block that
    prefix caching shares between requests is caught up for each of them, though only the first
    one computed it, and a block freed and reused is caught up from its new owner's rows."""
    capacity: int
    block_size: int
    steps: list = field(default_factory=list)
    rows: int = 0
    # Counters, for tests and benches.
    skipped_steps: int = 0
    caught_up_rows: int = 0
    truncated_rows: int = 0

    def keep(self, cad, tokens, positions, hidden) -> None:
        n = int(tokens.shape[0])
        self.steps.append(_Step(tokens.clone(), positions.clone(), hidden.clone(), cad.slot_mapping[:n].clone()))
        self.rows += n
        self.skipped_steps += 1
        if self.rows > self.capacity:
            self._shrink(cad)

    def _shrink(self, cad) -> None:
        """Keep the last write to each slot of a block a running request holds; then, if that is still
        too much, the newest rows (down to 3/4 of the capacity, so this runs every few steps at most)."""
        tokens, positions, hidden, slots = self._joined()
        live = np.unique(cad.block_table_tensor[:cad.num_reqs].cpu().numpy())
        s = slots.cpu().numpy()
        rows = _last_write(s)
        rows = rows[np.isin(s[rows] // self.block_size, live)]
        rows = np.sort(rows)[-(self.capacity * 3 // 4):]
        idx = torch.as_tensor(rows, device=tokens.device)
        self.steps = [_Step(tokens[idx], positions[idx], hidden[idx], slots[idx])]
        self.rows = len(rows)

    def _joined(self):
        return tuple(torch.cat([getattr(s, f) for s in self.steps]) for f in ("tokens", "positions", "hidden", "slots"))

    def clear(self) -> None:
        self.steps, self.rows = [], 0

    def merge(self, cad, tokens, positions, hidden, budget: int):
        """The step's inputs with each request's caught-up rows in front of its own; the kept rows are consumed.

        A request's query must be contiguous positions (the attention kernels place query row j at
        seq_len - query_len + j), so it gets the longest run of positions right before its step
        whose slots have a kept row. Returns (tokens, positions, hidden, common_attn_metadata)."""
        k_tokens, k_positions, k_hidden, k_slots = self._joined()
        self.clear()
        batch, bs = cad.num_reqs, self.block_size
        s, p = k_slots.cpu().numpy(), k_positions.cpu().numpy()
        last = _last_write(s)
        u_slots, u_rows = s[last], last            # sorted by slot
        bounds = cad.query_start_loc_cpu[:batch + 1].numpy().astype(np.int64)
        first_pos = positions[:int(bounds[-1])].cpu().numpy()[bounds[:-1]]
        tables = cad.block_table_tensor[:batch].cpu().numpy()
        room = max(budget - int(bounds[-1]), 0)
        runs = []
        for i in range(batch):
            want = first_pos[i] - 1 - np.arange(min(int(first_pos[i]), room))     # newest first
            slot = tables[i, want // bs].astype(np.int64) * bs + want % bs
            j = np.minimum(np.searchsorted(u_slots, slot), max(len(u_slots) - 1, 0))
            ok = (u_slots[j] == slot) & (p[u_rows[j]] == want) if len(u_slots) else np.zeros(len(want), bool)
            n = int(np.argmin(ok)) if not ok.all() else len(ok)
            runs.append(u_rows[j[:n]][::-1])
        counts = np.array([len(r) for r in runs], dtype=np.int64)
        if counts.sum() > room:
            limit = _largest_limit(counts, room)
            self.truncated_rows += int(counts.sum()) - int(np.minimum(counts, limit).sum())
            runs = [r[len(r) - min(len(r), limit):] for r in runs]
            counts = np.minimum(counts, limit)
        self.caught_up_rows += int(counts.sum())

        # Gather index into cat(kept rows, step rows): per request, its caught-up rows then its own.
        new_len = counts + np.diff(bounds)
        new_bounds = np.concatenate([[0], np.cumsum(new_len)])
        gather = np.concatenate([np.concatenate([runs[i], len(s) + np.arange(bounds[i], bounds[i + 1])])
                                 for i in range(batch)]).astype(np.int64)
        idx = torch.as_tensor(gather, device=tokens.device)
        n = int(bounds[-1])

        def joined(kept, own):
            return torch.cat([kept, own[:n]]).index_select(0, idx)

        out_positions = joined(k_positions, positions)
        qsl_cpu = torch.as_tensor(new_bounds, dtype=cad.query_start_loc_cpu.dtype)
        new_cad = cad.replace(
            query_start_loc=qsl_cpu.to(cad.query_start_loc.device), query_start_loc_cpu=qsl_cpu,
            num_actual_tokens=int(new_bounds[-1]), max_query_len=int(new_len.max()),
            slot_mapping=joined(k_slots, cad.slot_mapping),
            positions=None if cad.positions is None else out_positions,
            _num_computed_tokens_cache=None, _token_to_req_indices_cache=None)
        return joined(k_tokens, tokens), out_positions, joined(k_hidden, hidden), new_cad


def _catch_up_enabled() -> bool:
    # Read when drafting resumes (once per switch), so a test can compare both in one engine.
    return os.environ.get(DISABLE_CATCH_UP, "") not in ("1", "true", "yes")


def _last_write(slots: np.ndarray) -> np.ndarray:
    """Row index of the last row for each distinct slot, ordered by slot."""
    _, first_from_end = np.unique(slots[::-1], return_index=True)
    return len(slots) - 1 - first_from_end


def _largest_limit(counts: np.ndarray, room: int) -> int:
    """The largest per-request row limit L with sum(min(counts, L)) <= room."""
    lo, hi = 0, int(counts.max())
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if np.minimum(counts, mid).sum() <= room else (lo, mid - 1)
    return lo


def state(proposer) -> Pending:
    st = proposer.__dict__.get(_STATE)
    if st is None:
        # The drafter's own input buffers bound one forward; the kept rows plus a step's own must fit.
        st = proposer.__dict__[_STATE] = Pending(capacity=int(proposer.input_ids.shape[0]),
                                                 block_size=int(proposer.block_size))
    return st


def release(model_runner) -> dict:
    """Drop the kept inputs (before a sleep: they live outside vLLM's sleep-managed memory); returns the counters."""
    drafter = getattr(model_runner, "drafter", None)
    st = drafter.__dict__.get(_STATE) if drafter is not None else None
    if st is None:
        return {}
    st.clear()
    return stats(model_runner)


def stats(model_runner) -> dict:
    drafter = getattr(model_runner, "drafter", None)
    st = drafter.__dict__.get(_STATE) if drafter is not None else None
    if st is None:
        return {"skipped_steps": 0, "caught_up_rows": 0, "truncated_rows": 0, "pending_rows": 0}
    return {"skipped_steps": st.skipped_steps, "caught_up_rows": st.caught_up_rows,
            "truncated_rows": st.truncated_rows, "pending_rows": st.rows}


# What the wrapper relies on: propose's parameters (the runner passes them by name) and the
# attention metadata fields it rewrites.
PROPOSE_PARAMS = ("num_speculative_tokens", "target_token_ids", "target_positions", "target_hidden_states",
                  "next_token_ids", "token_indices_to_sample", "common_attn_metadata", "sampling_metadata",
                  "mm_embed_inputs", "num_rejected_tokens_gpu", "slot_mappings")
CAD_FIELDS = ("query_start_loc", "query_start_loc_cpu", "slot_mapping", "num_reqs", "num_actual_tokens",
              "max_query_len", "positions", "_num_computed_tokens_cache", "_token_to_req_indices_cache")


def patch_proposer(mod) -> None:
    import inspect

    from vllm.v1.attention.backend import CommonAttentionMetadata

    cls = require_attr(mod, "SpecDecodeBaseProposer", WHAT)
    propose = require_attr(cls, "propose", WHAT)
    if getattr(propose, "_tlt_wrapped", False):
        return
    params = tuple(inspect.signature(propose).parameters)[1:]
    if params != PROPOSE_PARAMS:
        raise PatchError(f"{WHAT}: SpecDecodeBaseProposer.propose{params} is not the signature it was written for")
    missing = [f for f in CAD_FIELDS if f not in CommonAttentionMetadata.__dataclass_fields__]
    if missing:
        raise PatchError(f"{WHAT}: CommonAttentionMetadata lacks {missing}; the patched code has changed")
    @functools.wraps(propose)
    def tlt_propose(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                    next_token_ids, token_indices_to_sample, common_attn_metadata, sampling_metadata,
                    mm_embed_inputs=None, num_rejected_tokens_gpu=None, slot_mappings=None):
        st = self.__dict__.get(_STATE)
        if st is not None and st.rows:
            # Drafting resumes: the target's own rows this step (no verified drafts), of a text model.
            if (token_indices_to_sample is None and num_rejected_tokens_gpu is None
                    and target_positions.dim() == 1 and mm_embed_inputs is None and _catch_up_enabled()):
                budget = st.capacity - getattr(self, "net_num_new_slots_per_request", 0) * common_attn_metadata.num_reqs
                target_token_ids, target_positions, target_hidden_states, common_attn_metadata = st.merge(
                    common_attn_metadata, target_token_ids, target_positions, target_hidden_states, budget)
            else:
                st.clear()
        return propose(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                       next_token_ids, token_indices_to_sample, common_attn_metadata, sampling_metadata,
                       mm_embed_inputs=mm_embed_inputs, num_rejected_tokens_gpu=num_rejected_tokens_gpu,
                       slot_mappings=slot_mappings)

    tlt_propose._tlt_wrapped = True
    cls.propose = tlt_propose


RUNNER_PARAMS = ("scheduler_output", "sampled_token_ids", "sampling_metadata", "hidden_states",
                 "sample_hidden_states", "aux_hidden_states", "spec_decode_metadata", "common_attn_metadata",
                 "slot_mappings")


def patch_runner(mod) -> None:
    """A k=0 step that verified no drafts runs none of the runner's drafting: not the drafter, not
    the next-token bookkeeping for it, not the hand-over of an empty draft to the scheduler. What
    is left is what a plain engine's step runs (the sampled tokens then reach the next step the
    way they do without SD: `_bookkeeping_sync` caches them)."""
    import inspect

    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    cls = require_attr(mod, "GPUModelRunner", WHAT)
    fn = require_attr(cls, "propose_draft_token_ids", WHAT)
    copy = require_attr(cls, "_copy_draft_token_ids_to_cpu", WHAT)
    require_attr(cls, "_get_positions", WHAT)
    if getattr(fn, "_tlt_wrapped", False):
        return
    params = tuple(inspect.signature(fn).parameters)[1:]
    if params != RUNNER_PARAMS:
        raise PatchError(f"{WHAT}: GPUModelRunner.propose_draft_token_ids{params} is not the signature it was "
                         "written for")

    @functools.wraps(fn)
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                                sample_hidden_states, aux_hidden_states, spec_decode_metadata, common_attn_metadata,
                                slot_mappings):
        if (scheduler_output.num_spec_tokens_to_schedule == 0 and spec_decode_metadata is None
                and self.speculative_config.method in ("eagle", "eagle3")
                and isinstance(self.drafter, SpecDecodeBaseProposer) and not self.supports_mm_inputs):
            n = scheduler_output.total_num_scheduled_tokens
            hidden = (torch.cat([h[:n] for h in aux_hidden_states], dim=-1) if self.use_aux_hidden_state_outputs
                      else hidden_states[:n])
            positions = self._get_positions(n)
            if positions.dim() == 1:
                state(self.drafter).keep(common_attn_metadata, self.input_ids.gpu[:n], positions, hidden)
                return torch.empty(common_attn_metadata.num_reqs, 0, device=hidden.device, dtype=torch.int64)
        return fn(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states, sample_hidden_states,
                  aux_hidden_states, spec_decode_metadata, common_attn_metadata, slot_mappings)

    @functools.wraps(copy)
    def copy_draft_token_ids_to_cpu(self, scheduler_output, zeros_only: bool = False):
        drafts = self._draft_token_ids
        if torch.is_tensor(drafts) and drafts.shape[-1] == 0 and not zeros_only:
            # No drafts: nothing for the scheduler (it clears a request's drafts when it schedules it).
            self.prev_num_spec_tokens = 0
            self._draft_token_req_ids = None
            return
        return copy(self, scheduler_output, zeros_only)

    propose_draft_token_ids._tlt_wrapped = True
    cls.propose_draft_token_ids = propose_draft_token_ids
    cls._copy_draft_token_ids_to_cpu = copy_draft_token_ids_to_cpu
