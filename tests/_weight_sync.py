"""Send target weights to a running engine the way verl's ServerAdapter does, without Ray.

verl's adapter lives in another process and reaches the server through a Ray call, then streams
the buckets; here the engine is in this process, so the sender runs in a thread while the
event loop carries the engine's `update_weights_from_ipc` call.
"""
from __future__ import annotations

import asyncio
import os


def zmq_handle(replica_rank: int = 0, local_rank: int = 0) -> str:
    # verl's naming (vllm_rollout.ServerAdapter / vLLMColocateWorkerExtension._get_zmq_handle).
    job = os.environ.get("VERL_RAY_JOB_ID", "0")
    return f"ipc:///tmp/rl-colocate-zmq-{job}-replica-{replica_rank}-rank-{local_rank}.sock"


async def sync_weights(collective_rpc, state: dict, replica_rank: int = 0, bucket_mb: int = 64) -> None:
    """`collective_rpc`: the server's or the AsyncLLM's; `state`: {name: tensor} in HF names."""
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender

    rpc = asyncio.ensure_future(collective_rpc("update_weights_from_ipc", kwargs={"use_shm": True}))
    await asyncio.sleep(0)
    sender = BucketedWeightSender(zmq_handle=zmq_handle(replica_rank), bucket_size_mb=bucket_mb, use_shm=True)
    await asyncio.gather(rpc, asyncio.to_thread(lambda: asyncio.run(sender.async_send_weights(iter(state.items())))))
