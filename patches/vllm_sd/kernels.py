"""Point the speculative-decoding kernel dispatchers at vLLM's own C++ CPU implementations.

`CPUModelRunner._postprocess_triton` (vllm/v1/worker/cpu_model_runner.py) re-points three of the
EAGLE proposer's dispatchers but, for the rest, replaces module attributes such as
`rejection_sampler.rejection_greedy_sample_kernel` that nothing reads after import: each
dispatcher (`triton_kernel_dispatcher_with_warmup`) holds the kernel it was built with, which
without Triton is the bare Python function, and fails with "Cannot inspect kernel parameters".
"""
from __future__ import annotations

from tlt_verl.patches._guard import require_attr
from tlt_verl.patches.vllm_sd.launch import CpuLaunch, point

WHAT = "vLLM-CPU speculative decoding kernels"

# dispatcher in vllm.v1.sample.rejection_sampler -> (implementation in
# vllm.utils.cpu_triton_utils, kernel arguments that come from the dispatch spec).
# `_expand` is left to the temperature patch.
REJECTION_SAMPLER = {
    "_rejection_greedy_sample": ("rejection_greedy_sample_kernel", ()),
    "_rejection_random_sample": ("rejection_random_sample_kernel", ("vocab_size",)),
    "_sample_recovered_tokens": ("sample_recovered_tokens_kernel", ("vocab_size",)),
}
# vllm.v1.spec_decode.utils; the runner already re-points these three, repeated here so that
# the fix does not depend on which of its attributes the runner happens to patch.
SPEC_DECODE_UTILS = {
    "_eagle_prepare_inputs_padded": ("eagle_prepare_inputs_padded_kernel", ()),
    "_eagle_prepare_next_token_padded": ("eagle_prepare_next_token_padded_kernel", ()),
    "_copy_and_expand_eagle_inputs": ("copy_and_expand_eagle_inputs_kernel", ()),
}


def _cpu_tl():
    import vllm.utils.cpu_triton_utils as cpu_tl

    return cpu_tl


def _point_all(module, table) -> None:
    cpu_tl = _cpu_tl()
    for dispatcher, (impl, launch_kwargs) in table.items():
        point(module, dispatcher, require_attr(cpu_tl, impl, WHAT), WHAT, launch_kwargs)


def patch_rejection_sampler(mod) -> None:
    _point_all(mod, REJECTION_SAMPLER)


def patch_spec_decode_utils(mod) -> None:
    _point_all(mod, SPEC_DECODE_UTILS)
    # Drafting steps 2..k. The dispatcher passes the block-table stride as `block_table_stride`;
    # the C++ implementation names it `stride`, so the two never meet without this adapter.
    impl = require_attr(_cpu_tl(), "_eagle_step_slot_mapping_metadata_kernel_impl", WHAT)

    def eagle_step_slot_mapping_metadata(positions, block_table, block_table_stride, seq_lens,
                                         out_clamped_positions, out_slot_mapping, block_size,
                                         max_model_len, n_blocks_per_req, PAD_ID, batch_size):
        impl(positions, block_table, block_table_stride, seq_lens, out_clamped_positions,
             out_slot_mapping, block_size, max_model_len, n_blocks_per_req, PAD_ID, batch_size)

    point(mod, "_eagle_step_slot_mapping_metadata", CpuLaunch(eagle_step_slot_mapping_metadata), WHAT)
