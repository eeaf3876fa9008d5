"""A test-only vLLM worker extension: TLT's own, plus switching the CPU temperature fix off and on
in a running engine. tests/test_vllm_sd_patches.py runs its negative control on the engine, seeds
and requests of the positive run, so that the two differ only by the fix (and one engine start
serves both). Importable in the engine's spawned worker: the test puts tests/ on PYTHONPATH."""
from __future__ import annotations

from tlt_verl.patches.vllm_sd.launch import CpuLaunch, point
from tlt_verl.rollout.engine.worker_extension import TLTWorkerExtension

CLS = "_temperature_switch.TemperatureFixSwitch"


def vendor_kernel(mod) -> None:
    """Point the rejection sampler's `_expand` dispatcher at vLLM's own CPU kernel, as its runner
    means to (through an adapter for the name of its second argument, `input_val`; the kernel's
    behaviour is vLLM's: a float output stays unwritten)."""
    import vllm.utils.cpu_triton_utils as cpu_tl

    def vendor_expand(output, input, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
        cpu_tl._expand_kernel_impl(output, input, cu_num_tokens, replace_from, replace_to)

    point(mod, "_expand", CpuLaunch(vendor_expand), "test: vendor temperature expand")


class TemperatureFixSwitch(TLTWorkerExtension):
    def tlt_test_temperature_fix(self, on: bool) -> None:
        import vllm.v1.sample.rejection_sampler as rs

        from tlt_verl.patches.vllm_sd import temperature

        (temperature.patch if on else vendor_kernel)(rs)
