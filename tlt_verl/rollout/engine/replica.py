"""verl RolloutReplica that runs one `VllmServer` actor per replica, next to its trainer ranks."""
from __future__ import annotations

import asyncio
import os
import tempfile

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from verl.workers.rollout.replica import RolloutReplica

from tlt_verl.rollout.engine import NAME
from tlt_verl.rollout.engine.model_runner import RUNNER_ENV
from tlt_verl.rollout.engine.server import VllmServer


def server_actor_name(rollout_name: str, replica_rank: int) -> str:
    # The server adapter inside the trainer's worker finds its server by this name.
    return f"{rollout_name}_server_{replica_rank}_0"


class VllmReplica(RolloutReplica):
    def rollout_worker_use_gpu(self) -> bool:
        return False

    async def launch_servers(self):
        node_id = await self.workers[0].__ray_call__.remote(lambda w: ray.get_runtime_context().get_node_id())
        name = server_actor_name(self.config.name or NAME, self.replica_rank)
        env = replica_engine_env(self.replica_rank, await replica_gpus(self.workers))
        server = (
            ray.remote(VllmServer)
            .options(
                name=name,
                num_cpus=0,
                max_concurrency=self.max_concurrency,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
            )
            .remote(
                config=self.config,
                model_config=self.model_config,
                replica_rank=self.replica_rank,
                engine_env=env,
            )
        )
        await server.launch.remote()
        self.servers = [server]
        self._server_handle = server
        # A unique key for verl's load balancer; generation goes through the actor handle.
        self._server_address = name

    # The adaptive-SD calls the trainer side makes on a replica (one server per replica here).
    async def push_drafter(self, path: str) -> str:
        """Hot-swap the served drafter from a safetensors file; the sha256 the engine loaded."""
        return await self._server_handle.update_drafter_from_file.remote(path)

    async def take_sd_summary(self) -> dict:
        return await self._server_handle.take_sd_summary.remote()

    async def sd_policy_state(self):
        return await self._server_handle.sd_policy_state.remote()

    async def load_sd_policy_state(self, state: dict) -> None:
        await self._server_handle.load_sd_policy_state.remote(state)


async def replica_gpus(workers) -> list[str]:
    """The accelerator ids Ray gave this replica's trainer ranks (none on CPU), in rank order.

    Taken as verl's own vLLM replica takes them (`get_accelerator_ids`): verl starts its workers
    with RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES, so CUDA_VISIBLE_DEVICES there is not the
    rank's device. One server per replica runs on the first rank's node, so a replica must not
    span nodes (ids on two nodes may be equal and name different devices)."""
    def ids(_w):
        import torch
        from verl.utils.device import get_resource_name

        ctx = ray.get_runtime_context()
        # On CPU, Ray still hands out the logical GPU slots of verl's pools: not devices.
        devices = ctx.get_accelerator_ids().get(get_resource_name(), []) if torch.cuda.is_available() else []
        return ctx.get_node_id(), [str(d) for d in devices]

    found = await asyncio.gather(*(w.__ray_call__.remote(ids) for w in workers))
    nodes = {node for node, _ in found}
    if len(nodes) > 1 and any(d for _, d in found):
        raise ValueError(f"{NAME}: a rollout replica spans {len(nodes)} nodes; tensor_model_parallel_size must "
                         f"fit the GPUs of one node")
    seen: list[str] = []
    for _, devices in found:
        seen += [d for d in devices if d not in seen]
    return seen


def replica_engine_env(replica_rank: int, gpus: list[str]) -> dict[str, str]:
    """Environment of a replica's engine process: on GPUs, the trainer ranks' devices (the server
    shares them as verl's hybrid engine does: it holds no Ray GPU of its own, sleeps while the actor
    trains, wakes for the rollout); on a CPU host, `engine_env`. The model runner is V1 on both."""
    if gpus:
        return {"CUDA_VISIBLE_DEVICES": ",".join(gpus), **RUNNER_ENV}
    return engine_env(replica_rank)


def engine_env(replica_rank: int) -> dict[str, str]:
    """Environment of a replica's engine process on a CPU host."""
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = sorted(cores)
    scratch = os.environ.get("TLT_SCRATCH") or os.path.join(tempfile.gettempdir(), f"tlt-vllm-{os.getuid()}")
    return {
        # One core per replica: replicas that share cores slow each other's tail down.
        "VLLM_CPU_OMP_THREADS_BIND": str(cores[replica_rank % len(cores)]),
        "VLLM_RPC_BASE_PATH": os.path.join(scratch, "rpc"),
        "VLLM_CACHE_ROOT": os.path.join(scratch, "cache"),
        **RUNNER_ENV,
    }
