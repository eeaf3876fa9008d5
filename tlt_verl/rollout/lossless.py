"""Refuse speculative-decoding options that change what is sampled.

TLT turns SD on and off during rollout on the promise that the sampled tokens keep the target's
distribution; only vLLM's standard rejection sampling (accept a draft x with probability
min(1, p(x)/q(x)), else resample from the residual) keeps it.
"""
from __future__ import annotations

from typing import Any, Mapping

# Knobs of vLLM 0.30 (`SpeculativeConfig`) and of the typical-acceptance sampler of vLLM 0.x V0
# and other engines, which accepts a draft whenever the target finds it plausible enough.
_TYPICAL_ACCEPTANCE_KEYS = ("posterior_threshold", "posterior_alpha",
                            "typical_acceptance_sampler_posterior_threshold",
                            "typical_acceptance_sampler_posterior_alpha")


def check_speculative_config(cfg: Mapping[str, Any] | None) -> None:
    """Raise ValueError (one line) unless `cfg`, a vLLM speculative_config dict, samples exactly."""
    if not cfg:
        return
    method = cfg.get("rejection_sample_method") or "standard"
    if method == "synthetic" or any(cfg.get(k) is not None for k in
                                    ("synthetic_acceptance_rates", "synthetic_acceptance_length")):
        raise ValueError("speculative_config: rejection_sample_method='synthetic' accepts drafts at fixed "
                         "rates whatever the target says, so it is not lossless; use 'standard'")
    if method != "standard":
        # 'block' (block verification) exists only in vLLM 0.30's V2 GPU runner; the CPU runner
        # silently samples with 'standard', so what it would do here is untested.
        raise ValueError(f"speculative_config: rejection_sample_method={method!r} is not verified lossless "
                         "on this stack; use 'standard'")
    acceptance = cfg.get("acceptance_method") or cfg.get("spec_decoding_acceptance_method")
    if acceptance not in (None, "rejection_sampler"):
        raise ValueError(f"speculative_config: acceptance method {acceptance!r} (typical acceptance) is lossy; "
                         "use rejection sampling")
    for key in _TYPICAL_ACCEPTANCE_KEYS:
        if (cfg.get(key) or 0) > 0:
            raise ValueError(f"speculative_config: {key}={cfg[key]} accepts drafts above a posterior threshold, "
                             "which is lossy; leave it at 0")
