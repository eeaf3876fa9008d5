"""vLLM rollout behind verl's rollout interfaces (replica, server actor, server adapter).

Built on vLLM's AsyncLLM directly rather than on verl's vLLM HTTP server: that server is
built around CUDA IPC weight transfer and CUDA graphs, while this one has to run on CPU,
carry the drafter, and record per-request timelines for the long-tail measurements.
"""
NAME = "tlt_vllm"
