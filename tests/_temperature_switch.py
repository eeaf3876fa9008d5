"""A test-only vLLM worker extension: TLT's own, plus the negative control of the lossless tests
(tests/test_vllm_sd_patches.py): the temperatures the rejection sampler divides the target's
logits by, one per draft token, set to a known wrong value in a running engine, and back to TLT's
fix. The control runs on the engine, seeds and requests of the positive run, so that the two
differ only by the temperature (and one engine start serves both).

The wrong value is WRONG_FACTOR times the request's temperature, deterministic: the bug this
stands for (vLLM-CPU's own expand kernel, which leaves the buffer unwritten) gave whatever
memory held, so how wrong a run was depended on the allocator, and once it passed a check.
Importable in the engine's spawned worker: the test puts tests/ on PYTHONPATH."""
from __future__ import annotations

from tlt_verl.patches.vllm_sd import temperature
from tlt_verl.patches.vllm_sd.launch import CpuLaunch, point
from tlt_verl.rollout.engine.worker_extension import TLTWorkerExtension

CLS = "_temperature_switch.TemperatureControl"
WRONG_FACTOR = 2.0


def wrong_expand(only_k: int | None):
    """TLT's expand, then the temperatures of draft tokens scaled by WRONG_FACTOR: those of every
    request, or (`only_k`) of the requests that verify exactly `only_k` drafts in the step, so that
    a run is wrong only after its k switched to `only_k`."""
    import torch

    def expand(output, input, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
        temperature.expand(output, input, cu_num_tokens, replace_from, replace_to)
        # The rejection sampler expands the temperature with greedy (0) read as 1, top-k and top-p
        # with 0 kept: only the temperature is made wrong.
        if replace_to != 1 or not output.is_floating_point() or input.numel() == 0:
            return
        total = int(cu_num_tokens[-1])
        values = output[:total]
        if only_k is None:
            values.mul_(WRONG_FACTOR)
            return
        counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
        hit = (counts == only_k).repeat_interleave(counts, output_size=total)
        values[hit] *= WRONG_FACTOR

    return expand


class TemperatureControl(TLTWorkerExtension):
    def tlt_test_temperature(self, wrong: bool, only_k: int | None = None) -> None:
        """wrong=False: TLT's fix; wrong=True: the control's known wrong temperatures."""
        import vllm.v1.sample.rejection_sampler as rs

        if wrong:
            point(rs, "_expand", CpuLaunch(wrong_expand(only_k)), "test: wrong temperature")
        else:
            temperature.patch(rs)
