"""The tlt_verl plugin loads through verl's own entry-point mechanism, in the driver and in Ray workers."""
import subprocess
import sys

import pytest

PROBE = r"""
import verl  # loads entry points of group verl.plugins
from verl.utils.device import get_device_name, get_torch_device
from verl.workers.rollout.base import _ROLLOUT_REGISTRY
from verl.workers.rollout.replica import RolloutReplicaRegistry
from verl.utils import config
print(get_device_name(), get_torch_device().current_device(),
      RolloutReplicaRegistry.get("vllm").__module__, _ROLLOUT_REGISTRY[("vllm", "async")],
      getattr(config.validate_config, "_tlt_wrapped", False))
"""


def _probe(env):
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


def test_plugin_in_driver(monkeypatch):
    import os

    env = {k: v for k, v in os.environ.items() if k != "VERL_PLATFORM"}  # picked on a CPU-only torch
    device, current, replica_mod, adapter, wrapped = _probe(env)
    assert (device, current) == ("cpu", "cpu")
    assert replica_mod == "tlt_verl.rollout.engine.replica"
    assert adapter == "tlt_verl.rollout.engine.adapter.VllmServerAdapter"
    assert wrapped == "True"


def test_plugin_in_ray_workers(no_leftover_ray, monkeypatch):
    import os

    import ray

    # Ray's workers inherit the driver's environment at ray.init: set for this test only.
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    # A cluster of this test's own (own temp dir, so not the user's from /tmp/ray), which
    # ray.shutdown() ends; the fixture ends whatever of it a failure leaves.
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=str(no_leftover_ray.temp_dir))
    try:

        @ray.remote
        def probe():
            import torch.distributed as dist
            from verl.utils.device import get_device_name
            from verl.workers.engine.base import EngineRegistry
            import verl.workers.engine.fsdp.transformer_impl as impl  # noqa: F401  triggers the engine patch

            cls = EngineRegistry.get_engine_cls("language_model", "fsdp2")
            # The process group must come up on gloo alone (verl would ask for cpu:gloo,cpu:gloo).
            from verl.utils.distributed import initialize_global_process_group_ray
            import socket

            with socket.socket() as s:   # a free port: another run on this machine may hold any fixed one
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            # In the Ray worker, which ends with this test's cluster.
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            initialize_global_process_group_ray()
            backend = dist.get_backend()
            dist.destroy_process_group()
            return get_device_name(), cls.__name__, backend, impl.CPUOffloadPolicy().pin_memory

        device, engine, backend, pinned = ray.get(probe.remote())
    finally:
        ray.shutdown()
    assert device == "cpu"
    assert engine == "FSDPEngineWithLMHead"
    assert backend == "cpu:gloo"
    assert pinned is False


def test_patch_refuses_other_verl_versions(monkeypatch):
    from tlt_verl.patches import PatchError, require_version

    with pytest.raises(PatchError, match="written for verl==0.8.0, found 0.9.1"):
        require_version("verl", "==0.8.0", "probe")
