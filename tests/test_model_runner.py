"""The engine runs vLLM's V1 model runner on every device, and a runner TLT cannot drive is refused.

On CUDA vLLM 0.30 picks Model Runner V2 whenever Triton imports; nothing on this CPU runs V2, so
the choice is checked against vLLM's own decision (`VllmConfig.use_v2_model_runner`) with Triton
made available, and the start-up check against the real runner classes.
"""
from __future__ import annotations

import pytest


@pytest.fixture
def triton_available(monkeypatch):
    """vLLM's runner choice as it is made on a CUDA host with Triton."""
    import vllm.config.vllm as vllm_config

    monkeypatch.setattr(vllm_config, "HAS_TRITON", True)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)


@pytest.mark.parametrize("gpus", [["0", "1"], []], ids=["cuda", "cpu"])
def test_engine_env_forces_v1_where_vllm_would_pick_v2(triton_available, monkeypatch, gpus):
    from vllm.config import VllmConfig

    from tlt_verl.rollout.engine.replica import replica_engine_env

    config = VllmConfig()
    # The premise: left to itself, vLLM runs V2 here.
    assert config.use_v2_model_runner is True
    env = replica_engine_env(0, gpus)
    if gpus:
        assert env["CUDA_VISIBLE_DEVICES"] == "0,1"
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert config.use_v2_model_runner is False


def test_check_refuses_the_v2_runner_in_one_line():
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner

    from tlt_verl.rollout.engine.model_runner import runner_problem, runner_report

    runner = object.__new__(V2Runner)   # the real class; building one needs a GPU
    for speculative in (False, True):
        problem = runner_problem(runner, speculative)
        assert problem is not None and "\n" not in problem
        assert "vllm.v1.worker.gpu.model_runner.GPUModelRunner" in problem
        assert "VLLM_USE_V2_MODEL_RUNNER=0" in problem
    assert runner_report(runner, True)["problem"] == runner_problem(runner, True)


def test_check_refuses_a_v1_runner_without_its_drafter():
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    from tlt_verl.rollout.engine.model_runner import runner_problem

    runner = object.__new__(CPUModelRunner)
    # A plain engine needs no drafter; one given a speculative_config does.
    assert runner_problem(runner, speculative=False) is None
    problem = runner_problem(runner, speculative=True)
    assert problem is not None and "has no drafter" in problem and "CPUModelRunner" in problem


def test_check_refuses_a_drafter_the_patches_did_not_reach():
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    from tlt_verl.rollout.engine.model_runner import runner_problem

    class UnpatchedProposer:   # a proposer class outside vLLM's SpecDecodeBaseProposer
        def propose(self, *args, **kwargs):
            raise AssertionError("never called")

    from tlt_verl.patches.vllm_sd import catch_up
    import vllm.v1.worker.gpu_model_runner as v1

    catch_up.patch_runner(v1)   # idempotent: what the plugin does in an engine process
    runner = object.__new__(CPUModelRunner)
    runner.drafter = object.__new__(UnpatchedProposer)
    problem = runner_problem(runner, speculative=True)
    assert problem is not None and "UnpatchedProposer" in problem and "parallel drafting" in problem
