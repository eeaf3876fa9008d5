"""Registers the tlt_vllm rollout with verl's two registries (replica and server adapter)."""
from __future__ import annotations

from verl.workers.rollout import base as rollout_base
from verl.workers.rollout.replica import RolloutReplicaRegistry

from tlt_verl.patches import require_attr
from tlt_verl.rollout.engine import NAME

ADAPTER = "tlt_verl.rollout.engine.adapter.VllmServerAdapter"


def _load_replica():
    from tlt_verl.rollout.engine.replica import VllmReplica

    return VllmReplica


def register(on_cpu: bool) -> None:
    adapters = require_attr(rollout_base, "_ROLLOUT_REGISTRY", "tlt_vllm rollout registration")
    names = [NAME]
    # verl's own vLLM server needs CUDA; on CPU a stock recipe's rollout.name=vllm runs on this one.
    if on_cpu:
        names.append("vllm")
    for name in names:
        RolloutReplicaRegistry.register(name, _load_replica)
        adapters[(name, "async")] = ADAPTER
