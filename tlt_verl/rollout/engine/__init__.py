"""vLLM rollout behind verl's rollout interfaces (replica, server actor, server adapter).

The server runs vLLM's AsyncLLM with the drafter, the adaptive SD policy and the per-request
timelines; between it and the trainer everything is verl's own vLLM rollout, subclassed: the
server adapter and its bucketed weight transport (CUDA IPC on GPU, shared memory on CPU), the
worker extension, the wake / sleep lifecycle.
"""
NAME = "tlt_vllm"
