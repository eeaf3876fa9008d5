"""verl server adapter (BaseRollout) inside the hybrid actor worker: pushes the actor's weights.

verl calls `update_weights` on every trainer rank with a generator of full tensors (the
generator itself gathers FSDP shards, so every rank must drain it). The rank that owns a
replica writes one safetensors file and asks its server to reload from it.
"""
from __future__ import annotations

import os
import tempfile
import time

import ray
import torch
from safetensors.torch import save_file
from verl.workers.rollout.base import BaseRollout

from tlt_verl.rollout.engine import NAME
from tlt_verl.rollout.engine.replica import server_actor_name


class VllmServerAdapter(BaseRollout):
    def __init__(self, config, model_config, device_mesh, replica_rank: int = -1, **kwargs):
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", 0))
        world = self.config.tensor_model_parallel_size * self.config.data_parallel_size
        world *= self.config.pipeline_model_parallel_size
        self.replica_rank = rank // world if replica_rank == -1 else replica_rank
        self.owns_server = rank % world == 0
        self._server = None
        self.last_push_s = 0.0

    def _server_handle(self):
        if self._server is None:
            self._server = ray.get_actor(server_actor_name(self.config.name or NAME, self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]):
        return None

    async def release(self):
        return None

    @torch.no_grad()
    async def update_weights(self, weights, wire_format: str = "named_tensors", global_steps=None, **kwargs):
        if wire_format != "named_tensors":
            raise ValueError(f"{NAME} rollout takes wire_format='named_tensors', got {wire_format!r}")
        start = time.time()
        state = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in weights}
        _hand_to_drafter(state)
        if not self.owns_server:
            return
        fd, path = tempfile.mkstemp(prefix=f"tlt-target-r{self.replica_rank}-", suffix=".safetensors")
        os.close(fd)
        try:
            save_file(state, path)
            await self._server_handle().update_weights_from_file.remote(path, global_steps)
        finally:
            os.unlink(path)
        self.last_push_s = time.time() - start


def _hand_to_drafter(state: dict) -> None:
    """A drafter trained in this process reads the target's current embedding and LM head."""
    from tlt_verl.drafter.target_weights import EMBED, LM_HEAD
    from tlt_verl.spot.registry import service

    svc = service()
    if svc is not None and EMBED in state:
        svc.set_target_tensors(state[EMBED], state.get(LM_HEAD, state[EMBED]))
