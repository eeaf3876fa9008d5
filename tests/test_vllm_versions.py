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


if __name__ == "__main__":
    child_main(_child)
