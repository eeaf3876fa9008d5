"""verl's stock trainer runs GRPO on CPU with the vLLM rollout, and the engine samples from the actor."""
import json

import pytest

from tlt_verl.launch.runner import RunConfig, run

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leftover_ray")]


@pytest.fixture(scope="module")
def two_steps(assets, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("grpo2")
    # Recompute the old log-probs with the actor (the recipe's bypass mode would reuse the
    # engine's): verl then reports how far the engine's log-probs are from the actor's.
    result = run(RunConfig(steps=2, run_dir=run_dir, quiet=True, assets_root=assets["root"],
                           overrides=["algorithm.rollout_correction.bypass_mode=False"]))
    metrics = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        d = json.loads(line)
        metrics[d["step"]] = d["data"]
    return result, metrics


def test_two_steps_complete(two_steps):
    result, metrics = two_steps
    assert sorted(metrics) == [1, 2]
    assert result["summary"]["replicas"] >= 2
    for s in result["steps"]:
        assert s["gen_s"] > 0 and s["step_s"] >= s["gen_s"]
        assert s["response_length"]["max"] >= s["response_length"]["p50"] > 0


def test_engine_logprobs_match_actor(two_steps):
    """verl recomputes the sampled tokens' log-probs with the actor and compares them with the
    engine's. Step 2 samples with the weights pushed after step 1's update, so a push that did not
    reach the engine shows up as a large difference there."""
    _, metrics = two_steps
    assert abs(metrics[1]["actor/pg_loss"]) > 0 or metrics[1]["actor/grad_norm"] > 0  # the actor moved
    for step in (1, 2):
        m = metrics[step]
        assert m["training/rollout_probs_diff_valid"] == 1.0
        assert m["training/rollout_probs_diff_max"] < 2e-3, m["training/rollout_probs_diff_max"]
        assert m["training/rollout_probs_diff_mean"] < 1e-4
        assert m["training/rollout_actor_probs_pearson_corr"] > 0.999
