"""Dynamic k with parallel drafting: a step that asks for fewer drafts than the engine was started
with drafts all of them and keeps the first k.

vLLM 0.30's `SpecDecodeBaseProposer` (v1/spec_decode/llm_base_proposer.py) lays out a parallel-
drafting forward at start-up: the last real position and `num_speculative_tokens - 1` mask positions
per request (`extra_slots_per_request`), whatever k a later step asks for. With dynamic SD
(`num_speculative_tokens_per_batch_size`, which TLT's policy drives) `propose` then reshapes the
K sampled drafts per request as k per request and fails (measured: "size of tensor a (16) must
match the size of tensor b (48)" at batch 16, K=3, k=1). The k drafts a step verifies are the first
k of the K that one forward computes anyway (position j's draft does not depend on later mask
positions), so the fix costs nothing: draft K, hand back k. k=0 keeps vLLM's own early return.

Written for the code path vLLM shares between CPU and GPU.
"""
from __future__ import annotations

import functools

from tlt_verl.patches._guard import PatchError, require_attr

WHAT = "vLLM parallel drafting with a run-time k"
_FLAG = "_tlt_parallel_k"


def patch_proposer(mod) -> None:
    import inspect

    cls = require_attr(mod, "SpecDecodeBaseProposer", WHAT)
    propose = require_attr(cls, "propose", WHAT)
    require_attr(cls, "take_last_draft_probs", WHAT)   # the draft probabilities live in _last_draft_probs
    if getattr(propose, _FLAG, False):
        return
    params = tuple(inspect.signature(propose).parameters)
    if params[1:2] != ("num_speculative_tokens",):
        raise PatchError(f"{WHAT}: SpecDecodeBaseProposer.propose{params[1:]} no longer takes "
                         "num_speculative_tokens first")

    @functools.wraps(propose)
    def tlt_propose(self, num_speculative_tokens, *args, **kwargs):
        started = self.speculative_config.num_speculative_tokens
        if not (self.parallel_drafting and 0 < num_speculative_tokens < started):
            return propose(self, num_speculative_tokens, *args, **kwargs)
        drafts = propose(self, started, *args, **kwargs)[:, :num_speculative_tokens]
        if self._last_draft_probs is not None:
            self._last_draft_probs = self._last_draft_probs[:, :num_speculative_tokens].contiguous()
        # Callers after this one read the step's k from the proposer.
        self.num_speculative_tokens = num_speculative_tokens
        return drafts.contiguous()

    setattr(tlt_propose, _FLAG, True)
    cls.propose = tlt_propose
