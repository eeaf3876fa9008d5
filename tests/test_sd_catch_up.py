"""SD off runs no drafter, and the drafter catches up when SD comes back on
(patches/vllm_sd/catch_up.py).

The project's SFT target with its warm drafter, greedy, on task prompts with long worked
solutions. GRPO-like: each of 4 prompts is sampled 4 times, so prefix caching shares the prompt
blocks; the first copy of each prompt is short (SHORT tokens) and computes the prompt, the last
is long. The schedule is off (k=0) above batch 4 and k=3 at 4 and below, so SD comes on for the
4 long requests, which hold the shared prompts, the moment the 12 short ones finish:

- "off_on": that run. The drafter never ran before the switch; the first drafting step catches
  it up on every position the target computed (the prompt blocks another request computed, too).
- "all_along": the reference, an engine that drafted all along: the long requests' prompts with
  their first SHORT tokens, k=3 from the prefill on, so the drafter read every position too.
Greedy decoding makes both continue with the same tokens, so the drafts after the switch must be
the reference's: the same number accepted at each drafting step. The negative control is the same
run with the catch-up disabled (TLT_VLLM_DISABLE_SD_CATCH_UP=1, the skipped positions are then
never shown to the drafter): fewer of its drafts are accepted right after the switch than of the
reference's. All three run in one engine, the prefix cache reset and the drafter's KV cache zeroed
before each.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from _subproc import child_main, run_in_subprocess  # noqa: E402

K, COPIES, PROMPTS, SHORT, LONG = 3, 4, 4, 24, 160


def _child(spec: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.sd_threshold import task_prompt_source
    from tlt_verl.drafter.export import folder_kind
    from tlt_verl.rollout.config import drafter_speculative_config
    from tlt_verl.rollout.engine import sd_control
    from tlt_verl.rollout.engine.offline import offline_llm

    make, prompt_len = task_prompt_source(Path(spec["target"]))
    prompts = make(PROMPTS, 0)
    batch = PROMPTS * COPIES
    # The warm drafter as TLT serves it (EAGLE-3, parallel drafting: one forward drafts all k).
    sd = drafter_speculative_config(spec["drafter"], folder_kind(spec["drafter"]), K,
                                    num_speculative_tokens_per_batch_size=[[1, batch, K]])
    llm = offline_llm(spec["target"], speculative_config=sd, skip_tokenizer_init=True,
                      max_model_len=prompt_len + LONG + 2 * K, max_num_seqs=batch, max_num_batched_tokens=4096)
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    from tlt_verl.patches.vllm_sd import catch_up

    def greedy(n):
        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)

    layers = runner.compilation_config.static_forward_context

    def forget_drafter_kv():
        # A new block may be a block an earlier run wrote, with the drafter's keys and values for the
        # same tokens at the same positions: the control's holes would then hold what the catch-up
        # writes, and its acceptance would not fall. Each run starts from a drafter cache of zeros.
        for name in runner.drafter._draft_attn_layer_names:
            layers[name].kv_cache.zero_()

    def run(name, schedule, requests):
        sd_control.set_sd_schedule(llm, schedule)
        sd_control.take_sd_metrics(llm)
        llm.reset_prefix_cache()
        forget_drafter_kv()
        before = catch_up.stats(runner)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p, _ in requests], [greedy(n) for _, n in requests],
                            use_tqdm=False)
        steps = sd_control.take_sd_metrics(llm)
        after = catch_up.stats(runner)
        drafting = [m for m in steps if m.drafted_reqs]
        return {"tokens": [list(o.outputs[0].token_ids) for o in outs],
                "off_steps": sum(m.k == 0 for m in steps), "drafting_steps": len(drafting),
                "acceptance": sum(sum(m.accepted_per_pos) for m in drafting) / max(sum(m.drafted_reqs for m in drafting), 1),
                "acceptance_by_step": [sum(m.accepted_per_pos) / m.drafted_reqs for m in drafting],
                **{k: after[k] - before[k] for k in ("skipped_steps", "caught_up_rows", "truncated_rows")},
                "pending_after": after["pending_rows"]}

    switch = [[1, PROMPTS, K], [PROMPTS + 1, batch, 0]]
    try:
        # Copies of a prompt in order, the short ones first: they compute the shared prompt blocks.
        requests = [(p, SHORT) for p in prompts for _ in range(COPIES - 1)] + [(p, LONG) for p in prompts]
        off_on = run("off_on", switch, requests)
        head = off_on["tokens"][-PROMPTS:]
        all_along = run("all_along", [[1, batch, K]], [(p + h[:SHORT], LONG - SHORT) for p, h in zip(prompts, head)])
        os.environ[catch_up.DISABLE_CATCH_UP] = "1"
        off_on_control = run("off_on", switch, requests)
    finally:
        llm.llm_engine.engine_core.shutdown()
    return {"caught_up": {"off_on": off_on, "all_along": all_along},
            "not_caught_up": {"off_on": off_on_control, "all_along": all_along}, "prompt_lens": [len(p) for p in prompts]}


@pytest.fixture(scope="module")
def models(assets, warm_drafter):
    return {"target": str(assets["model"]), "drafter": str(warm_drafter)}


@pytest.fixture(scope="module")
def result(models, tmp_path_factory):
    from tlt_verl.patches.vllm_sd.catch_up import DISABLE_CATCH_UP

    res = run_in_subprocess(__file__, models, tmp_path_factory.mktemp("catch_up"), drop_env=(DISABLE_CATCH_UP,))
    for run in ("caught_up", "not_caught_up"):
        res[run]["prompt_lens"] = res["prompt_lens"]
    return res


@pytest.fixture(scope="module")
def caught_up(result):
    return result["caught_up"]


@pytest.fixture(scope="module")
def not_caught_up(result):
    return result["not_caught_up"]


def _drafts_as_if_drafting_all_along(run: dict, reference: dict, steps: int = 10) -> bool:
    """The first drafting steps after the switch accept what the reference's accept, step for step.

    Greedy, same tokens: a drafter that holds the same history drafts the same tokens, so the counts
    match exactly. History matters most right after the switch; later the skipped positions are far
    behind, and an EAGLE-3 drafter, which also reads the target's hidden state, barely misses them
    (mean acceptance over the whole tail fell only from 1.75 to 1.70 without the catch-up, within
    the noise of 50 steps of 4 requests; its first 10 steps matched the reference's in 1 of 10)."""
    return run["acceptance_by_step"][:steps] == reference["acceptance_by_step"][:steps]


def _tails(res):
    return [t[SHORT:] for t in res["off_on"]["tokens"][-PROMPTS:]], res["all_along"]["tokens"]


@pytest.mark.slow
def test_off_steps_run_no_drafter_and_the_switch_catches_up_every_position(caught_up):
    off_on = caught_up["off_on"]
    # Every step before the switch was off and skipped the drafter; nothing is left over.
    assert off_on["off_steps"] == off_on["skipped_steps"] >= SHORT
    assert off_on["pending_after"] == 0 and off_on["truncated_rows"] == 0
    # The switch caught each long request up on all it had: its prompt (computed by a short copy
    # and shared through the prefix cache) and its first SHORT - 1 decoded positions.
    assert off_on["caught_up_rows"] == sum(n + SHORT - 1 for n in caught_up["prompt_lens"])
    assert caught_up["all_along"]["skipped_steps"] == 0 == caught_up["all_along"]["caught_up_rows"]


@pytest.mark.slow
def test_acceptance_after_the_switch_equals_drafting_all_along(caught_up):
    tails, reference = _tails(caught_up)
    assert tails == reference
    off_on, all_along = caught_up["off_on"], caught_up["all_along"]
    print(f"\nacceptance (accepted drafts per drafting request-step): after the switch "
          f"{off_on['acceptance']:.3f}, drafted all along {all_along['acceptance']:.3f}")
    assert all_along["acceptance"] > 0.5, all_along    # the warm drafter is accepted: a real comparison
    assert off_on["acceptance"] >= 0.97 * all_along["acceptance"], (off_on, all_along)
    assert _drafts_as_if_drafting_all_along(off_on, all_along), (off_on["acceptance_by_step"], all_along["acceptance_by_step"])


@pytest.mark.slow
def test_without_catch_up_acceptance_falls(caught_up, not_caught_up):
    tails, reference = _tails(not_caught_up)
    assert tails == reference            # exact either way: only the drafter's guesses suffer
    assert not_caught_up["off_on"]["caught_up_rows"] == 0
    with_, without = caught_up["off_on"]["acceptance"], not_caught_up["off_on"]["acceptance"]
    print(f"\nacceptance after the switch: caught up {with_:.3f}, not caught up {without:.3f}")
    control, reference = not_caught_up["off_on"], not_caught_up["all_along"]
    # Right after the switch, where the holes in the drafter's history are nearest: fewer drafts
    # accepted than by the engine that drafted all along on the same tokens (the expectation the
    # caught-up run meets step for step, see above), not merely different ones.
    first = lambda run: sum(run["acceptance_by_step"][:10])
    assert first(control) < first(reference), (control["acceptance_by_step"], reference["acceptance_by_step"])


if __name__ == "__main__":
    child_main(_child)
