"""verl's vLLM server adapter (BaseRollout inside the hybrid actor worker), for the tlt_vllm server.

Everything is verl's `ServerAdapter`: the server it talks to (named `<rollout name>_server_<replica>_<node>`),
`resume` / `release` (the server's wake_up / sleep), and the weight sync (bucketed transfer over
ZMQ, CUDA IPC on GPU and shared memory on CPU, received by `TLTWorkerExtension`). The one addition:
a drafter trained in this process reads the target's embedding and LM head, so those two tensors
are copied out of the stream as it passes; nothing else is held on the host.
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
        if svc is not None and not svc.capture:
            svc = None             # a drafter that does not train needs no copy of the target's tensors
        taken: dict[str, torch.Tensor] = {}
        if svc is not None:
            weights = _tap(weights, (EMBED, LM_HEAD), taken)
        await super().update_weights(weights, global_steps=global_steps, wire_format=wire_format, **kwargs)
        if svc is not None and EMBED in taken:
            svc.set_target_tensors(taken[EMBED], taken.get(LM_HEAD, taken[EMBED]))


def _tap(weights, names, into: dict):
    """Pass `weights` through, keeping a host copy of the tensors named in `names`."""
    for name, t in weights:
        if name in names:
            into[name] = t.detach().to("cpu", copy=True)
        yield name, t


def _drafter_service():
    from tlt_verl.spot.registry import service

    return service()
