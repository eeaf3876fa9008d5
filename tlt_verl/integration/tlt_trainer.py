"""The TLT trainer: verl's synchronous V1 trainer plus the drafter, registered as trainer mode `tlt`.

`+tlt.enable=true` makes the start-up check (tlt_setup.py) select this mode; everything verl
computes is unchanged. What it adds, through the trainer's own hooks:

- the actor worker group is built from `TLTActorRolloutRefWorker` (drafter colocated per rank);
- on_sample_begin / on_sample_end: the Spot coordinator follows the rollout and trains the
  drafter on the ranks whose replicas drained, then preempts it;
- on_step_end: after verl's target weight sync, the freshest drafter is exported and pushed to
  every replica; `tlt/...` metrics go into verl's metrics dict;
- checkpoints: the drafter of every rank is saved inside verl's `global_step_N` folder before
  verl's own files, and resumed from it with `trainer.resume_mode`;
- exports (`tlt.export`): after each save, and once after the last step (saving verl's checkpoint
  first if `trainer.save_freq` did not), the step's policy in Hugging Face format beside its
  freshest drafter, for serving (tlt_verl/serve/export.py, `./tlt serve`).
"""
from __future__ import annotations

import json
import math
import os
import time

import ray
from omegaconf import OmegaConf, open_dict
from verl.trainer.ppo.utils import Role
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils.debug import marked_timer

from tlt_verl.integration.config import TLTConfig
from tlt_verl.rollout.engine import NAME
from tlt_verl.rollout.engine.replica import server_actor_name
from tlt_verl.rollout.engine.sd_loop import pool
from tlt_verl.rollout.policy.sd_policy import sd_policy_pulls
from tlt_verl.serve.export import DRAFTER_SUBDIR, EXPORT_DIR, STEP_PREFIX, ServeHints, export_step, prune_exports
from tlt_verl.spot.coordinator import ReplicaSlot, SpotCoordinator

MODE = "tlt"
# The verl mode TLT runs as once selected (SUPPORTED_TRAINER_MODES in config.py).
BASE_MODE = "sync"
ACTOR_ROLES = (Role.ActorRollout, Role.ActorRolloutRef)
DRAFTER_DIR = DRAFTER_SUBDIR


def tlt_work_dir(config) -> str:
    return os.path.join(config.trainer.default_local_dir, "tlt")


@register_trainer(MODE)
class TLTTrainer(PPOTrainerSync):
    def __init__(self, config):
        # verl's base trainer switches on `trainer_mode == "sync"` (replay buffer, dataloader
        # batching, what a checkpoint holds): once this class is picked by mode `tlt`, verl
        # must run its synchronous path exactly, so the mode reads "sync" from here on.
        with open_dict(config):
            config.trainer.v1.trainer_mode = BASE_MODE
        super().__init__(config)
        self.tlt = TLTConfig.from_dict(OmegaConf.to_container(config.tlt, resolve=True))
        self._tlt_resume_folder = None
        self._tlt_rollout: dict = {}
        self._tlt_pending_push = False
        self._tlt_timelines: list = []
        # The step verl saved and TLT has yet to export; the last step exported; the newest acceptance.
        self._tlt_export_due: int | None = None
        self._tlt_exported: int | None = None
        self._tlt_acceptance: dict | None = None

    # ---- construction ------------------------------------------------------------------------

    def _init_resource_pool_mgr(self):
        from tlt_verl.integration.actor_worker import TLTActorRolloutRefWorker

        super()._init_resource_pool_mgr()
        for role in list(self.role_worker_mapping):
            if role in ACTOR_ROLES:
                self.role_worker_mapping[role] = ray.remote(TLTActorRolloutRefWorker)
                self._tlt_actor_key = str(role)

    def _load_checkpoint(self):
        super()._load_checkpoint()
        if self.global_steps > 0:
            self._tlt_resume_folder = os.path.join(self.config.trainer.default_local_dir,
                                                   f"global_step_{self.global_steps}")
            if self.config.trainer.resume_mode == "resume_path":
                self._tlt_resume_folder = self.config.trainer.resume_from_path

    def on_init_end(self):
        wg = self.actor_rollout_wg
        replicas = self.llm_server_manager.get_replicas()
        name = self.config.actor_rollout_ref.rollout.name or NAME
        handles = list(wg.workers)
        slots, replica_of_rank = [], {}
        for rep in replicas:
            ranks = [handles.index(w) for w in rep.workers]
            for r in ranks:
                replica_of_rank[str(r)] = rep.replica_rank
            slots.append(ReplicaSlot(rank=rep.replica_rank, server=ray.get_actor(server_actor_name(name, rep.replica_rank)),
                                     workers=list(rep.workers), worker_ranks=ranks))
        self._tlt_servers = [s.server for s in slots]
        ranks = wg.tlt_init_drafter(self._service_config(), replica_of_rank, self.tlt.spot.train_drafter)
        self._tlt_trains = all(r["trains"] for r in ranks)
        print(f"tlt: drafter training in the rollout: {'on' if self._tlt_trains else 'off'} "
              f"(tlt.spot.train_drafter={self.tlt.spot.train_drafter}, rollout on {ranks[0]['device']})", flush=True)
        self.coordinator = SpotCoordinator(slots, self._call, self.tlt.spot)
        if self._tlt_resume_folder is not None:
            loaded = wg.tlt_load_drafter(os.path.join(self._tlt_resume_folder, DRAFTER_DIR))
            policy = os.path.join(self._tlt_resume_folder, DRAFTER_DIR, "sd_policy.json")
            pulls = None
            if os.path.exists(policy):
                states = json.loads(open(policy).read())
                ray.get([s.load_sd_policy_state.remote(st) for s, st in zip(self._tlt_servers, states) if st])
                pulls = sum(sd_policy_pulls(st) for st in states if st)
            self._tlt_pending_push = any(loaded)
            # Ranks resume at different drafter versions: the push and the next session's seed
            # must come from the freshest one, as in the uninterrupted run.
            versions = [int(m.get("state_version", 0)) for m in wg.tlt_drafter_metrics()]
            self.coordinator.versions.update(dict(enumerate(versions)))
            # verl's driver log shows prints (its loggers default to WARNING); what was resumed is
            # named, so that a resume can be checked against the checkpoint (bench/reliability.py).
            print(f"tlt: drafter resumed from {self._tlt_resume_folder} on {sum(map(bool, loaded))}/{len(loaded)} ranks "
                  f"(state versions {versions}); SD policy resumed: "
                  f"{'no' if pulls is None else f'{pulls} bandit pulls'}", flush=True)
        super().on_init_end()
        if self._tlt_pending_push:
            self._push_drafter()

    def _service_config(self) -> dict:
        from dataclasses import asdict

        d = self.tlt.drafter
        init = None if d.init == "scratch" else d.init
        return {"kind": d.kind, "init": init, "trainer": asdict(d.trainer), "buffer": asdict(d.buffer)}

    def _call(self, worker, method: str, *args):
        return getattr(worker, f"{self._tlt_actor_key}_{method}").remote(*args)

    # ---- the rollout -------------------------------------------------------------------------

    def _should_train(self) -> bool:
        spot = self.tlt.spot
        if not self._tlt_trains:
            return False
        if self.global_steps % spot.train_every_steps == 0:
            return True
        acc = self._tlt_rollout.get("acceptance_length", 0.0)
        return bool(spot.retrain_below_acceptance and 0 < acc < spot.retrain_below_acceptance)

    def on_sample_begin(self):
        super().on_sample_begin()
        self.coordinator.begin_rollout(train=self._should_train())

    def on_sample_end(self):
        self._tlt_rollout = self.coordinator.end_rollout()
        self._tlt_timelines.append({"step": self.global_steps, "replicas": self.coordinator.timelines()})
        self._tlt_pending_push = self._tlt_rollout.get("train_steps", 0) > 0
        super().on_sample_end()

    def on_validate_end(self):
        super().on_validate_end()
        self.coordinator.resync()

    def on_step_end(self):
        t0 = time.time()
        super().on_step_end()   # verl's target weight sync
        t1 = time.time()
        worker_metrics = self.actor_rollout_wg.tlt_drafter_metrics()   # in rank order
        # A drafter process that died in the session came back at its last checkpoint's version:
        # the push and the next session's seed go by the versions the ranks hold now.
        self.coordinator.versions.update({r: int(m.get("state_version", 0)) for r, m in enumerate(worker_metrics)})
        push_s = self._push_drafter() if self._tlt_pending_push else 0.0
        metrics = self._metrics(worker_metrics)
        metrics["tlt/drafter_critical_path_s"] = self._tlt_rollout.get("preempt_s", 0.0) + push_s
        metrics["tlt/target_sync_s"] = t1 - t0
        self._write_timeline()
        if self._tlt_export_due is not None:
            metrics["tlt/export_s"] = self._export(self._tlt_export_due)
        pending = getattr(self, "_pending_sync_metrics", None) or {}
        self._pending_sync_metrics = {**pending, **metrics}

    def _push_drafter(self) -> float:
        t = time.time()
        rank, worker = self.coordinator.freshest_worker()
        out = os.path.join(tlt_work_dir(self.config), "push", f"step_{self.global_steps}")
        folder = ray.get(self._call(worker, "tlt_export_drafter", out))
        ray.get([s.update_drafter_from_file.remote(os.path.join(folder, "model.safetensors"))
                 for s in self._tlt_servers])
        self._tlt_pending_push = False
        print(f"tlt: step {self.global_steps}: pushed the drafter of rank {rank} to {len(self._tlt_servers)} replicas",
              flush=True)
        return time.time() - t

    def _metrics(self, worker_metrics: list[dict]) -> dict[str, float]:
        r = self._tlt_rollout
        out = {f"tlt/spot/{k}": float(v) for k, v in r.items() if isinstance(v, (int, float))}
        summaries = ray.get([s.take_sd_summary.remote() for s in self._tlt_servers])
        pooled = pool(summaries)
        if pooled["decode_steps"]:
            for key in ("sd_step_share", "acceptance_length", "decode_tokens_per_s"):
                out[f"tlt/sd/{key}"] = pooled[key]
            self._tlt_rollout["acceptance_length"] = out["tlt/sd/acceptance_length"]
            # Of the drafter that served this step's rollout (pushed after the previous step).
            self._tlt_acceptance = {"step": self.global_steps, "acceptance_length": out["tlt/sd/acceptance_length"],
                                    "sd_step_share": out["tlt/sd/sd_step_share"]}
            for bucket, k in (summaries[0].get("arms") or {}).items():
                out[f"tlt/sd/arm_bucket_{bucket}"] = float(k)
        # Ranks whose replicas never drained did not train: report the freshest drafter, the one pushed.
        freshest = worker_metrics[self.coordinator.freshest_worker()[0]] if worker_metrics else {}
        for key, value in freshest.items():
            if key.startswith("tlt/drafter/host/"):
                continue                           # every rank's, below
            if isinstance(value, (int, float)) and math.isfinite(value):
                out[key if key.startswith("tlt/") else f"tlt/drafter/{key}"] = float(value)
        # What the drafter cost the actors' own processes this step (capture in the update, the
        # hand-overs): the ranks pay it side by side, so the slowest rank's is the step's.
        host = [{k: v for k, v in m.items() if k.startswith("tlt/drafter/host/")} for m in worker_metrics]
        for key in set().union(*host):
            out[key] = max(float(h.get(key, 0.0)) for h in host)
        if host:
            out["tlt/drafter/host_s"] = max(sum(map(float, h.values())) for h in host)
        # Drafter processes restarted after dying, all ranks, since the run (re)started.
        out["tlt/drafter/restarts"] = float(sum(m.get("tlt/drafter/restarts", 0.0) for m in worker_metrics))
        return out

    def _write_timeline(self) -> None:
        path = os.path.join(tlt_work_dir(self.config), "spot_timeline.jsonl")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "a") as f:
            for entry in self._tlt_timelines:
                f.write(json.dumps({**entry, "rollout": self._tlt_rollout}) + "\n")
        self._tlt_timelines = []

    # ---- checkpoints -------------------------------------------------------------------------

    def _save_checkpoint(self):
        folder = os.path.join(self.config.trainer.default_local_dir, f"global_step_{self.global_steps}", DRAFTER_DIR)
        with marked_timer("tlt_save_drafter", self.timing_raw, color="green"):
            # Before verl's own files: once verl marks this step as the latest, its drafter is complete.
            self.actor_rollout_wg.tlt_save_drafter(folder, self.global_steps)
            states = ray.get([s.sd_policy_state.remote() for s in self._tlt_servers])
            os.makedirs(folder, exist_ok=True)
            tmp = os.path.join(folder, "sd_policy.json.tmp")
            with open(tmp, "w") as f:
                json.dump(states, f)
            os.replace(tmp, os.path.join(folder, "sd_policy.json"))
        super()._save_checkpoint()
        # Exported in on_step_end, once the step's acceptance is known (nothing trains in between).
        self._tlt_export_due = self.global_steps if self.tlt.export.enable else None

    # ---- exports for serving -----------------------------------------------------------------

    def _export(self, step: int) -> float:
        t = time.time()
        cfg = self.tlt.export
        root = os.path.join(tlt_work_dir(self.config), EXPORT_DIR)
        rollout = self.config.actor_rollout_ref.rollout
        hints = ServeHints(dtype=str(rollout.dtype),
                           max_model_len=int(rollout.get("max_model_len") or rollout.prompt_length + rollout.response_length),
                           num_speculative_tokens=max(self.tlt.sd.bandit.arms))
        # The rank whose drafter the replicas serve: its checkpoint of this step holds the same state.
        rank, _ = self.coordinator.freshest_worker()
        out = export_step(os.path.join(self.config.trainer.default_local_dir, f"global_step_{step}"), root,
                          drafter_rank=rank, acceptance=self._tlt_acceptance, serve=hints, layouts=cfg.layouts)
        prune_exports(root, cfg.keep if cfg.keep is not None else self.config.trainer.get("max_actor_ckpt_to_keep"))
        self._tlt_export_due, self._tlt_exported = None, step
        print(f"tlt: step {step}: policy and drafter exported for serving to {os.path.abspath(out)} "
              f"({time.time() - t:.1f}s)", flush=True)
        return time.time() - t

    def fit(self, *args, **kwargs):
        out = super().fit(*args, **kwargs)
        self._export_at_end()
        return out

    def _export_at_end(self) -> None:
        """The run's final export: verl's checkpoint of the last step (saved here, outside the step's
        timing, when trainer.save_freq did not save it) and its export."""
        cfg = self.tlt.export
        last = self.global_steps - 1           # fit() counts one past the last step it ran
        if not (cfg.enable and cfg.at_end) or last < 1 or self.config.trainer.get("val_only", False):
            return
        root = os.path.join(tlt_work_dir(self.config), EXPORT_DIR)
        if self._tlt_exported == last or os.path.isfile(os.path.join(root, f"{STEP_PREFIX}{last}", "manifest.json")):
            return
        tracker = os.path.join(self.config.trainer.default_local_dir, "latest_checkpointed_iteration.txt")
        saved = os.path.isfile(tracker) and open(tracker).read().strip() == str(last)
        if not saved:
            self.global_steps = last
            try:
                self._save_checkpoint()
            finally:
                self.global_steps = last + 1
        self._export(last)
