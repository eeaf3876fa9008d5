"""The rollout server verl uses, with the drafter and the adaptive SD policy (rollout.custom.tlt_sd).

One child process runs two `VllmServer`s built from verl's own `RolloutConfig`, plain and
adaptive, on a long-tail batch at T=0: same tokens; the policy's loop learned from the engine's
steps and its schedule is the engine's; its state round-trips; a drafter push and a target
reload go through the server's own calls.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from _subproc import child_main, run_in_subprocess  # noqa: E402

# A long tail: most requests short, two long; the batch shrinks from 12 to 2.
MAX_TOKENS = [6, 8, 10, 6, 12, 8, 10, 6, 8, 12, 96, 120]
MAX_SEQS = 16
# What vLLM learns about the test target's class (engine_dirs.py), named by its class.
TARGET_CLASS_INFO = "-LlamaForCausalLM.json"


def _rollout_config(**custom):
    from verl.workers.config.rollout import RolloutConfig

    return RolloutConfig(name="tlt_vllm", prompt_length=16, response_length=max(MAX_TOKENS), dtype="float32",
                         max_num_seqs=MAX_SEQS, tensor_model_parallel_size=1, max_num_batched_tokens=2048,
                         seed=0, custom=custom or None,
                         # The test target has no tokenizer: token ids in and out.
                         engine_kwargs={"vllm": {"skip_tokenizer_init": True}})


async def _scenario(spec: dict) -> dict:
    import torch
    from tlt_verl.rollout.engine.weight_sync import send_weights
    from omegaconf import OmegaConf
    from safetensors.torch import load_file

    from tlt_verl.rollout.engine.replica import engine_env
    from tlt_verl.rollout.engine.server import VllmServer

    target, drafter = spec["target"], spec["drafter"]
    model = OmegaConf.create({"path": target})
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 128, (8,), generator=g).tolist() for _ in MAX_TOKENS]
    res: dict = {"timings": {}}

    # Refused before any engine starts: a lossy speculative config given through engine_kwargs.
    lossy = _rollout_config()
    lossy.engine_kwargs = {"vllm": {"skip_tokenizer_init": True, "speculative_config": {"method": "eagle", "model": drafter,
                                                           "rejection_sample_method": "synthetic"}}}
    try:
        await VllmServer(lossy, model, 0, engine_env(0)).launch()
        res["lossy_error"] = None
    except ValueError as e:
        res["lossy_error"] = str(e)

    async def rollout(server, tag):
        async def one(i):
            out = await server.generate(f"{tag}-{i}", prompt_ids=prompts[i],
                                        sampling_params={"temperature": 0.0, "max_tokens": MAX_TOKENS[i],
                                                         "ignore_eos": True})
            return out.token_ids
        return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))

    plain = VllmServer(_rollout_config(), model, 0, engine_env(0))
    await plain.launch()
    res["plain_runner"] = (await plain.collective_rpc("tlt_model_runner", args=(False,)))[0]
    from tlt_verl.rollout.engine.engine_dirs import shared_modelinfo_dir

    link = os.path.join(engine_env(0)["VLLM_CACHE_ROOT"], "modelinfos")
    res["modelinfos"] = {"link": os.path.realpath(link) if os.path.islink(link) else None,
                         "shared": str(shared_modelinfo_dir().resolve()), "files": sorted(os.listdir(link))}
    try:
        res["plain"] = await rollout(plain, "plain")
        res["plain_summary"] = await plain.take_sd_summary()
        # The engine core killed mid-rollout: the rollout fails, fast, in one line with the cause.
        import signal

        from tlt_verl.rollout.engine.engine_death import core_processes

        core = core_processes(plain.engine)[0]
        dying = asyncio.create_task(rollout(plain, "dying"))
        await asyncio.sleep(0.05)
        res["killed_mid_rollout"] = not dying.done()
        os.kill(core.pid, signal.SIGKILL)
        t = time.time()
        try:
            await asyncio.wait_for(dying, 120)
            res["dying_error"] = None
        except RuntimeError as e:
            res["dying_error"] = str(e)
        res["dying_s"] = time.time() - t
        res["core_pid"] = core.pid
    finally:
        plain.shutdown()

    tlt_sd = {"drafter": drafter, "policy": {"steps_per_pull": 2, "bandit": {"seed": 3}}}
    server = VllmServer(_rollout_config(tlt_sd=tlt_sd), model, 0, engine_env(0))
    await server.launch()
    try:
        res["sd_runner"] = (await server.collective_rpc("tlt_model_runner", args=(True,)))[0]
        res["sd"] = [await rollout(server, f"sd{r}") for r in range(3)]
        res["summary"] = await server.take_sd_summary()
        state = server.sd_policy_state()
        res["state"] = state
        res["lookup"] = await server.engine.engine_core.call_utility_async("tlt_get_sd_lookup")
        res["schedule"] = [list(r) for r in server.sd_loop.policy.schedule()]
        # Restoring the saved state (as a resumed run does) is accepted and pushed to the engine.
        await server.load_sd_policy_state(state)
        res["state_after_load"] = server.sd_policy_state()
        async def checksum(which):
            return (await server.collective_rpc("tlt_weights_checksum", args=(which,)))[0]

        res["sha_before"] = {"drafter": await checksum("drafter"), "target": await checksum("target")}
        res["sha_push"] = await server.update_drafter_from_file(os.path.join(drafter, "model.safetensors"))

        # verl's lifecycle: asleep, every write into the engine and every generate is refused.
        await server.sleep()
        res["asleep"] = server.lifecycle_state()
        # As a GPU's level-2 sleep does, the CPU sleep dropped the drafter's weights (in the
        # background; a checksum through the server waits for it).
        res["sha_dropped"] = await checksum("drafter")
        res["dropped_reported"] = server.dropped_drafter_sha
        res["refused"] = {}
        for what, call in {
            "generate": lambda: rollout(server, "asleep"),
            "reload": lambda: server.collective_rpc("update_weights_from_ipc", kwargs={"use_shm": True}),
            "push": lambda: server.update_drafter_from_file(os.path.join(drafter, "model.safetensors")),
        }.items():
            try:
                await call()
                res["refused"][what] = None
            except RuntimeError as e:
                res["refused"][what] = str(e)
        # Woken as verl's weight sync does: weights, the actor's weights streamed through verl's
        # bucketed transport (shared memory here), then the KV cache.
        await server.wake_up(tags=["weights"])
        res["half_awake_generate"] = None
        try:
            await rollout(server, "half_awake")
        except RuntimeError as e:
            res["half_awake_generate"] = str(e)
        alt = {k: v * 1.5 if "layers." in k else v for k, v in load_file(os.path.join(target, "model.safetensors")).items()}
        await send_weights(server.collective_rpc, alt.items(), bucket_mb=1)
        res["sha_alt"] = await checksum("target")
        await send_weights(server.collective_rpc, load_file(os.path.join(target, "model.safetensors")).items(), bucket_mb=1)
        await server.wake_up(tags=["kv_cache"])
        await server.set_global_steps(5)
        res["sha_after"] = {"drafter": await checksum("drafter"), "target": await checksum("target")}
        # The wake restored the drafter (in the background, before any generate asked for it).
        res["woken"] = server.lifecycle_state()
        res["global_steps"] = server.global_steps
        res["after_reloads"] = await rollout(server, "again")
        # The level-2 sleep dropped the drafter: the first generate after the wake restored it.
        res["awake"] = server.lifecycle_state()
        res["sha_restored"] = await checksum("drafter")
        res["idle_polling"] = server.sd_loop.running
        # SD off at every batch size, the engine driven directly (the policy's loop stays idle): no
        # step runs the drafter, each keeps what the drafter would have read, and a sleep drops it.
        from vllm import SamplingParams, TokensPrompt

        async def drain(i):
            sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS[i], ignore_eos=True, detokenize=False)
            async for _ in server.engine.generate(TokensPrompt(prompt_token_ids=prompts[i]), sp, f"off-{i}"):
                pass

        await server.set_sd_schedule([[1, MAX_SEQS, 0]])
        res["catch_up_start"] = await server.sd_catch_up_stats()
        res["off_metrics"] = await server.take_sd_metrics()
        await asyncio.gather(*(drain(i) for i in range(len(prompts))))
        res["off_metrics"] = await server.take_sd_metrics()
        res["catch_up_before_sleep"] = await server.sd_catch_up_stats()
        await server.sleep()
        res["catch_up_after_sleep"] = await server.sd_catch_up_stats()
    finally:
        server.shutdown()
    return res


def _child(spec: dict) -> dict:
    return asyncio.run(_scenario(spec))


# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    from _drafters import write_eagle1_drafter, write_target

    root = tmp_path_factory.mktemp("server_sd")
    target = write_target(str(root / "target"))
    drafter = write_eagle1_drafter(target, str(root / "drafter"), bigram=True)
    # A shared model-info folder of its own, holding what every engine of this machine learned
    # but the target's class: the plain engine must learn that one and leave it there.
    from tlt_verl.rollout.engine.engine_dirs import MODELINFO_DIR_ENV, shared_modelinfo_dir

    shared = root / "modelinfos"
    shared.mkdir()
    for f in shared_modelinfo_dir().glob("*.json") if shared_modelinfo_dir().is_dir() else ():
        if not f.name.endswith(TARGET_CLASS_INFO):
            shutil.copy(f, shared / f.name)
    res = run_in_subprocess(__file__, {"target": target, "drafter": drafter}, root,
                            env_extra={"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VERL_RAY_JOB_ID": f"test{os.getpid()}",
                                       MODELINFO_DIR_ENV: str(shared)})
    res["shared_modelinfos"] = str(shared.resolve())
    res.update(drafter=drafter, target=target)
    return res


@pytest.mark.slow
def test_engines_run_the_v1_runner_with_the_patched_drafter(scenario):
    # What the start-up check (model_runner.runner_problem) accepted, as the workers report it.
    for key in ("plain_runner", "sd_runner"):
        assert scenario[key]["runner"] == "vllm.v1.worker.cpu_model_runner.CPUModelRunner", scenario[key]
        assert scenario[key]["problem"] is None
    assert scenario["plain_runner"]["drafter"] is None
    assert scenario["sd_runner"]["drafter"] == "vllm.v1.spec_decode.eagle.EagleProposer"


@pytest.mark.slow
def test_adaptive_server_same_tokens_as_plain_at_t0(scenario):
    assert [len(t) for t in scenario["plain"]] == MAX_TOKENS
    for tokens in scenario["sd"] + [scenario["after_reloads"]]:
        assert tokens == scenario["plain"]
    assert scenario["plain_summary"] == {}  # a plain server has no SD to report


@pytest.mark.slow
def test_policy_loop_learns_from_engine_steps(scenario):
    s = scenario["summary"]
    assert s["decode_steps"] > 20
    assert 0.0 < s["sd_step_share"] <= 1.0
    # The bigram drafter guesses the bigram target well: drafts are accepted.
    assert s["acceptance_length"] > 1.5, s
    counts = scenario["state"]["bandit"]["counts"]
    # Small buckets (the tail) were pulled, and more than one arm was tried in one of them.
    assert sum(map(sum, counts)) >= 4, counts
    assert max(sum(1 for n in row if n) for row in counts) >= 2, counts
    assert set(s["arms"]) == {"1", "2", "4", "8"}
    assert not scenario["idle_polling"]


@pytest.mark.slow
def test_engine_runs_the_policys_schedule(scenario):
    lookup = scenario["lookup"]
    for start, end, k in scenario["schedule"]:
        assert all(lookup[b] == k for b in range(start, end + 1)), (start, end, k, lookup)
    assert scenario["state_after_load"] == scenario["state"]


@pytest.mark.slow
def test_drafter_push_and_target_reload_through_the_server(scenario):
    before, after = scenario["sha_before"], scenario["sha_after"]
    # The drafter's own file pushed: it reads back as what was served; the target reloaded
    # through verl's bucketed transport in 1 MiB buckets: a changed state is served (the
    # checksum reads the weights back through the engine's kernels), the original comes back
    # exactly, and neither reload touched the other model.
    assert scenario["sha_push"] == before["drafter"] == after["drafter"] == scenario["sha_restored"]
    # The sleep really dropped the drafter, so the equality above is the restore's doing.
    assert scenario["sha_dropped"] == scenario["dropped_reported"] != before["drafter"]
    assert scenario["sha_alt"] != before["target"]
    assert before["target"] == after["target"]
    assert before["drafter"] != before["target"]
    assert scenario["global_steps"] == 5


@pytest.mark.slow
def test_sleeping_server_refuses_generate_reload_and_push(scenario):
    assert scenario["asleep"]["released"] == ["kv_cache", "weights"]
    for what, err in scenario["refused"].items():
        assert err is not None and "while asleep" in err and "\n" not in err, (what, err)
    assert "weights" in scenario["refused"]["reload"]
    # Weights woken, KV cache not yet: still no generate.
    assert "kv_cache released" in scenario["half_awake_generate"]
    assert scenario["asleep"]["drafter_lost"] is True
    restored = {"released": [], "drafter_lost": False, "drafter_restores": 1, "drafter_drops": 1}
    assert scenario["woken"] == scenario["awake"] == restored


@pytest.mark.slow
def test_sd_off_runs_no_drafter_and_sleep_drops_what_it_kept(scenario):
    start, before, after = scenario["catch_up_start"], scenario["catch_up_before_sleep"], scenario["catch_up_after_sleep"]
    steps = scenario["off_metrics"]
    assert steps and all(m["k"] == 0 and m["draft_tokens"] == 0 for m in steps)
    # Every step of the all-off rollout skipped the drafter and kept its inputs: each prompt
    # token and each decoded position but the last (which no step read as input). Counted from
    # the start: the rollout before may end on steps the bandit's k=0 arm ran, whose rows wait
    # for the next drafting step.
    assert before["skipped_steps"] - start["skipped_steps"] == len(steps)
    assert before["pending_rows"] - start["pending_rows"] == 8 * len(MAX_TOKENS) + sum(n - 1 for n in MAX_TOKENS)
    assert after["pending_rows"] == 0 and after["skipped_steps"] == before["skipped_steps"]


@pytest.mark.slow
def test_dying_engine_fails_the_rollout_fast_in_one_line(scenario):
    # SIGKILL of the engine core while 12 requests ran: every generate ends within seconds with one
    # line naming the replica, the process and the signal (vLLM's own error points elsewhere).
    err = scenario["dying_error"]
    assert scenario["killed_mid_rollout"]
    assert err is not None and "\n" not in err, err
    assert err.startswith("replica 0: its vLLM engine died during generate") and "SIGKILL" in err, err
    assert f"pid {scenario['core_pid']}" in err, err
    assert scenario["dying_s"] < 30, scenario["dying_s"]


@pytest.mark.slow
def test_engine_learns_the_model_class_into_the_shared_cache(scenario):
    # The server's own cache root is private; what vLLM learned about the target's class is in the
    # folder every engine shares, so the next engine with a fresh root does not learn it again.
    info = scenario["modelinfos"]
    assert info["link"] == info["shared"] == scenario["shared_modelinfos"]
    # Not there before the test's engines started (the fixture left it out).
    assert any(f.endswith(TARGET_CLASS_INFO) for f in info["files"]), info


@pytest.mark.slow
def test_lossy_speculative_config_refused_before_engine_start(scenario):
    assert "synthetic" in scenario["lossy_error"] and "lossless" in scenario["lossy_error"]


# ---------------------------------------------------------------------------- no engine

def test_engine_dirs_link_the_model_info_cache(tmp_path, monkeypatch):
    from tlt_verl.rollout.engine.engine_dirs import MODELINFO_DIR_ENV, make_engine_dirs

    shared = tmp_path / "shared"
    monkeypatch.setenv(MODELINFO_DIR_ENV, str(shared))
    env = {"VLLM_RPC_BASE_PATH": str(tmp_path / "a" / "rpc"), "VLLM_CACHE_ROOT": str(tmp_path / "a" / "cache")}
    make_engine_dirs(env)
    make_engine_dirs(env)   # a second engine of the same root
    link = tmp_path / "a" / "cache" / "modelinfos"
    assert (tmp_path / "a" / "rpc").is_dir() and link.is_symlink() and link.resolve() == shared.resolve()
    (link / "x.json").write_text("{}")
    assert (shared / "x.json").read_text() == "{}"
    # A cache root that already holds a folder of its own keeps it.
    own = tmp_path / "b" / "cache" / "modelinfos"
    own.mkdir(parents=True)
    make_engine_dirs({"VLLM_CACHE_ROOT": str(tmp_path / "b" / "cache")})
    assert own.is_dir() and not own.is_symlink()


def test_config_errors_name_the_option(tmp_path):
    from tlt_verl.rollout.config import AdaptiveRolloutConfig

    def err(block):
        with pytest.raises(ValueError) as e:
            AdaptiveRolloutConfig.from_rollout(_rollout_config(tlt_sd=block))
        msg = str(e.value)
        assert "\n" not in msg
        return msg

    assert AdaptiveRolloutConfig.from_rollout(_rollout_config()) is None
    assert "tlt_sd.drafter" in err({})
    assert f"tlt_sd.drafter={tmp_path}: no config.json" in err({"drafter": str(tmp_path)})
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert "unknown option(s) ['drafterr']" in err({"drafter": str(tmp_path), "drafterr": 1})
    assert "tlt_sd.method='medusa'" in err({"drafter": str(tmp_path), "method": "medusa"})
    assert "sd.threshold=0" in err({"drafter": str(tmp_path), "policy": {"threshold": 0}})
    assert "bandit.arms=[2]" in err({"drafter": str(tmp_path), "policy": {"bandit": {"arms": [2]}}})
    cfg = AdaptiveRolloutConfig.from_rollout(_rollout_config(tlt_sd={"drafter": str(tmp_path)}))
    spec = cfg.speculative_config(MAX_SEQS)
    assert spec["num_speculative_tokens"] == 3 and spec["num_speculative_tokens_per_batch_size"] == [[1, MAX_SEQS, 3]]


def test_cuda_graph_pool_is_bounded_by_the_threshold(tmp_path):
    from tlt_verl.rollout.config import (AdaptiveRolloutConfig, cuda_graph_capture_sizes, cuda_graph_engine_args,
                                         vllm_capture_grid)

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    from tlt_verl.rollout.policy import SDPolicyConfig

    cfg = AdaptiveRolloutConfig(drafter=str(tmp_path), policy=SDPolicyConfig(threshold=16))  # arms 0..3
    sizes = cuda_graph_capture_sizes(cfg, max_num_seqs=32, max_tokens=8192)
    grid = vllm_capture_grid(8192)
    # On vLLM's own grid (what it pads a batch up to): k = 0 at every batch size, and b * (1 + k)
    # for b <= 16 only: 16 * 4 = 64 is the largest, so nothing between 64 and 32 * 4 = 128.
    assert set(sizes) <= set(grid) and sizes[:4] == [1, 2, 4, 8]
    assert 3 not in sizes and set(range(8, 33, 8)) <= set(sizes)
    assert max(sizes) == 64
    every_arm_everywhere = {next(g for g in grid if g >= b * (1 + k)) for b in range(1, 33) for k in range(4)}
    assert set(sizes) < every_arm_everywhere and 128 in every_arm_everywhere
    assert cuda_graph_capture_sizes(cfg, max_num_seqs=32, max_tokens=40)[-1] == 40
    assert cuda_graph_engine_args(cfg, 32, 8192, on_gpu=False) == {}
    gpu = cuda_graph_engine_args(cfg, 32, 8192, on_gpu=True)
    assert gpu["compilation_config"]["cudagraph_capture_sizes"] == sizes
    # A user's compilation config is merged: their keys kept, their capture sizes win.
    user = cuda_graph_engine_args(cfg, 32, 8192, on_gpu=True, user={"mode": 3})
    assert user["compilation_config"] == {"mode": 3, "cudagraph_capture_sizes": sizes}
    own = cuda_graph_engine_args(cfg, 32, 8192, on_gpu=True, user={"cudagraph_capture_sizes": [1, 2]})
    assert own["compilation_config"]["cudagraph_capture_sizes"] == [1, 2]


if __name__ == "__main__":
    child_main(_child)
