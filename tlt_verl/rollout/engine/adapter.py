"""verl's vLLM server adapter (BaseRollout inside the hybrid actor worker), for the tlt_vllm server.

Everything is verl's `ServerAdapter`: the server it talks to (named `<rollout name>_server_<replica>_<node>`),
`resume` / `release` (the server's wake_up / sleep), and the weight sync (bucketed transfer over
ZMQ, CUDA IPC on GPU and shared memory on CPU, received by `TLTWorkerExtension`). The one addition:
a drafter trained beside this process reads the target's embedding and LM head, so those two
tensors are written from the stream, as it passes, into the segment the drafter maps
(`DrafterProcess.target_update`); nothing else is held.
"""
from __future__ import annotations

import torch
from verl.workers.rollout.vllm_rollout.vllm_rollout import ServerAdapter

from tlt_verl.drafter.target_weights import EMBED, LM_HEAD


class VllmServerAdapter(ServerAdapter):
    @torch.no_grad()
    async def update_weights(self, weights, global_steps: int = None, wire_format: str = "named_tensors", **kwargs):
        if self._ensure_server_handle():
            # A sleeping server would refuse the reload, after the sender had blocked on a
            # receiver that never connects: fail here, in one line, instead.
            await self.server_handle.check_awake.remote("reload the target weights", ("weights",))
        svc = _drafter_service()
        if svc is None or not svc.capture:
            # A drafter that does not train holds no copy of the target's tensors.
            await super().update_weights(weights, global_steps=global_steps, wire_format=wire_format, **kwargs)
            return
        # The two tensors go from the stream straight into the drafter's shared segment (its child
        # holds meanwhile): one copy, and none on the host on a GPU.
        with svc.target_update() as write:
            await super().update_weights(_tap(weights, write), global_steps=global_steps, wire_format=wire_format,
                                         **kwargs)


# Weight-stream names -> the drafter's parts (tied targets stream no LM head; the drafter reads
# the embedding for both).
PARTS = {EMBED: "embed", LM_HEAD: "lm_head"}


def _tap(weights, write):
    """Pass `weights` through, writing the drafter's parts of it as they go by."""
    for name, t in weights:
        if name in PARTS:
            write(PARTS[name], t)
        yield name, t


def _drafter_service():
    from tlt_verl.spot.registry import service

    return service()
