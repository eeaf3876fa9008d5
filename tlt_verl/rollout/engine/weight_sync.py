"""Send target weights to an engine in this process the way verl's ServerAdapter does, without Ray.

verl's adapter lives in a trainer rank and reaches the server with a Ray call, then streams the
buckets; here the server (or a bare AsyncLLM) is driven from this process, so the sender runs in
a thread while the event loop carries the engine's `update_weights_from_ipc` call. For tests and
benchmarks: the transport, the receiver and the loading are the production ones.
"""
from __future__ import annotations

import asyncio
import os


def zmq_handle(replica_rank: int = 0, local_rank: int = 0) -> str:
    # verl's naming (vllm_rollout.ServerAdapter / vLLMColocateWorkerExtension._get_zmq_handle).
    job = os.environ.get("VERL_RAY_JOB_ID", "0")
    return f"ipc:///tmp/rl-colocate-zmq-{job}-replica-{replica_rank}-rank-{local_rank}.sock"


async def send_weights(collective_rpc, named_tensors, replica_rank: int = 0, bucket_mb: int = 64) -> None:
    """`collective_rpc`: the server's or the AsyncLLM's; `named_tensors`: (HF name, tensor) pairs."""
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender

    rpc = asyncio.ensure_future(collective_rpc("update_weights_from_ipc", kwargs={"use_shm": True}))
    await asyncio.sleep(0)
    sender = BucketedWeightSender(zmq_handle=zmq_handle(replica_rank), bucket_size_mb=bucket_mb, use_shm=True)
    await asyncio.gather(rpc, asyncio.to_thread(lambda: asyncio.run(sender.async_send_weights(iter(named_tensors)))))
