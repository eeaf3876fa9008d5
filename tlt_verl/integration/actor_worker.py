"""verl's actor worker with the drafter colocated on the same resources.

The TLT trainer builds its actor worker group from this class instead of verl's
`ActorRolloutRefWorker` (same resource pool, same ranks): each rank then hosts a drafter (a
`DrafterService` in a child process, `DrafterProcess`: the drafter, its optimizer, its buffer
shard), which the actor's own update forward fills through the capture hooks. The child is
what a crash or a SIGKILL of drafter training takes down, never the actor; it is restarted from
the drafter's last checkpoint. The methods below are the drafter worker group's interface; the
coordinator calls the session ones on single workers, the rest go to every rank.

On CPU the child is pinned to its replica's core with one torch thread: while it trains, the
other replicas' engines are still decoding on the other cores.
"""
from __future__ import annotations

import os
import socket
from typing import Any, Optional
from verl.single_controller.base.decorator import Dispatch, register
from verl.workers.engine_workers import ActorRolloutRefWorker


def _core_of(replica_rank: int) -> Optional[int]:
    """The core the replica's engine is bound to (tlt_verl.rollout.engine.replica.engine_env)."""
    from tlt_verl.rollout.engine.replica import engine_env

    bind = engine_env(replica_rank).get("VLLM_CPU_OMP_THREADS_BIND", "")
    return int(bind) if bind.isdigit() else None


class TLTActorRolloutRefWorker(ActorRolloutRefWorker):
    _tlt_service = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def tlt_init_drafter(self, service_config: dict, replica_of_rank: dict, train_drafter) -> dict:
        from tlt_verl.integration.config import trains_drafter
        from tlt_verl.spot import registry
        from tlt_verl.spot.drafter_process import DrafterProcess
        from tlt_verl.spot.drafter_service import DrafterServiceConfig

        target = self.config.model.get("local_path") or self.config.model.path
        self._tlt_replica = int(replica_of_rank[str(self.rank)])
        core = _core_of(self._tlt_replica) if self._device() == "cpu" else None
        # The drafter trains on this rank's own device (bf16 autocast, NCCL sessions on a GPU), and
        # holds the target's embedding and LM head in the dtype the rollout runs the target in.
        rollout_dtype = self.config.rollout.get("dtype") if "rollout" in self.config else None
        service_config = {**service_config, "device": self._rank_device(), "target_dtype": rollout_dtype}
        # A drafter that never trains reads nothing from the actor update: no capture, no staging.
        trains = trains_drafter(train_drafter, self._device())
        self._tlt_service = DrafterProcess(str(target), DrafterServiceConfig.from_dict(service_config), core=core,
                                           capture=trains)
        registry.set_service(self._tlt_service)
        return {"rank": self.rank, "replica": self._tlt_replica, "pid": self._tlt_service.pid,
                "device": self._device(), "trains": trains}

    # ---- sessions (one worker at a time, from the coordinator) -------------------------------

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def tlt_rendezvous(self) -> tuple[str, int]:
        """A host and free port for a session's store, which this worker (its rank 0) hosts."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        # The address Ray reaches this node by (its --node-ip-address), not what the host name
        # resolves to, which on many clusters is a loopback or a management interface.
        from ray.util import get_node_ip_address

        return get_node_ip_address(), port

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def tlt_start_session(self, session_id: str, rank: int, size: int, host: str, port: int, source: int) -> None:
        self._tlt_service.start_session(session_id, rank, size, host, port, source)
        # verl's driver log mirrors this: which process trains, for a person (or a test) to find.
        print(f"tlt: rank {self.rank} (pid {self._tlt_service.pid}) trains the drafter in session {session_id}",
              flush=True)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def tlt_stop_session(self, timeout_s: float) -> dict:
        # The stats carry the member's state version (0 for a member whose process died in the session).
        return self._tlt_service.stop(timeout_s)

    # ---- every rank --------------------------------------------------------------------------

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def tlt_save_drafter(self, directory: str, global_step: int) -> str:
        # Waited for: the trainer writes verl's own files (which mark the step resumable) after this.
        path = self._tlt_service.save_checkpoint(os.path.join(directory, f"rank_{self.rank}"), global_step, wait=True)
        return str(path)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def tlt_load_drafter(self, directory: str) -> bool:
        return bool(self._tlt_service.load_checkpoint(os.path.join(directory, f"rank_{self.rank}")))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def tlt_drafter_metrics(self) -> dict[str, Any]:
        from tlt_verl.spot.drafter_service import PREFIX

        metrics = self._tlt_service.metrics()
        # One round trip: the metrics carry the state version the coordinator ranks drafters by.
        return {**metrics, "state_version": int(metrics.get(PREFIX + "version", 0))}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def tlt_export_drafter(self, out_dir: str) -> str:
        return str(self._tlt_service.export(out_dir))

    def _rank_device(self) -> str:
        import torch

        return f"cuda:{torch.cuda.current_device()}" if self._device() == "cuda" else "cpu"

    def _device(self) -> str:
        from verl.utils.device import get_device_name

        return get_device_name()
