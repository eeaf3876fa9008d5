"""Make verl 0.9.1 run on a CPU-only machine, without editing the installed verl.

Each fix answers one measured blocker (see README, "verl on CPU"):
platform `cpu` and its device module; `cpu:gloo` as the process-group backend; the FSDP
engines registered for device `cpu`; FSDP2's CPU offload without pinned memory; a start-up
check that refuses GPU-only options with a one-line message.
"""
from __future__ import annotations

import functools
import os

from tlt_verl.patches._guard import PatchError, require_attr, require_version, when_imported

VERL_SPEC = "==0.9.1"
_applied = False


def apply() -> None:
    global _applied
    if _applied:
        return
    require_version("verl", VERL_SPEC, "verl CPU platform")
    os.environ["VERL_PLATFORM"] = "cpu"
    _register_platform()
    when_imported("verl.utils.distributed", _patch_process_group)
    when_imported("verl.workers.engine.fsdp.transformer_impl", _patch_fsdp_engine)
    _applied = True


def _register_platform() -> None:
    from verl.plugin.platform import platform_manager

    from tlt_verl.patches.verl_cpu.platform import PlatformCPU

    registry = require_attr(platform_manager, "PlatformRegistry", "verl CPU platform")
    registry.register(platform="cpu")(PlatformCPU)


def _patch_process_group(mod) -> None:
    # verl builds "cpu:gloo,{device}:{backend}", i.e. "cpu:gloo,cpu:gloo" here, which torch rejects.
    original = require_attr(mod, "initialize_global_process_group_ray", "verl CPU process group")

    @functools.wraps(original)
    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return original(timeout_second=timeout_second, backend=backend or "cpu:gloo")

    mod.initialize_global_process_group_ray = initialize_global_process_group_ray


def _patch_fsdp_engine(mod) -> None:
    what = "verl FSDP engine on CPU"
    # Forward-only FSDP2 engines (ref, old log-prob) use CPUOffloadPolicy(pin_memory=True);
    # pinning needs an accelerator.
    policy = require_attr(mod, "CPUOffloadPolicy", what)
    mod.CPUOffloadPolicy = functools.partial(_unpinned, policy)

    from verl.workers.engine.base import EngineRegistry

    engines = require_attr(EngineRegistry, "_engines", what)
    registered = 0
    for backends in engines.values():
        for backend, by_device in backends.items():
            if backend in ("fsdp", "fsdp2") and "cuda" in by_device and "cpu" not in by_device:
                by_device["cpu"] = by_device["cuda"]
                registered += 1
    if not registered:
        raise PatchError(f"{what}: no FSDP engine registered for cuda to reuse; verl's registry changed")


def _unpinned(policy_cls, *args, pin_memory=True, **kwargs):
    return policy_cls(*args, pin_memory=False, **kwargs)
