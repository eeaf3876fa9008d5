"""verl's stock trainer runs GRPO on CPU with the vLLM rollout, across two Ray nodes started with
docker/launch.sh, and the engine samples from the actor."""
import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leftover_ray")]


@pytest.fixture(scope="module")
def two_steps(assets, two_node_cluster, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("grpo2")
    c = two_node_cluster
    # Recompute the old log-probs with the actor (the recipe's bypass mode would reuse the
    # engine's): verl then reports how far the engine's log-probs are from the actor's.
    cmd = [*c["launch"], "submit", "--address", c["address"], "--nodes", "2", "--",
           sys.executable, "-m", "tlt_verl.cli", "run", "--no-tlt", "--steps", "2", "--run-dir", str(run_dir),
           "trainer.nnodes=2", "trainer.n_gpus_per_node=1", "algorithm.rollout_correction.bypass_mode=False"]
    env = dict(c["env"], TLT_HOME=str(assets["root"].parent))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((run_dir / "steps.json").read_text())
    metrics = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        d = json.loads(line)
        metrics[d["step"]] = d["data"]
    return result, metrics, out.stdout, c


def test_two_steps_complete(two_steps):
    result, metrics, stdout, _ = two_steps
    assert "launch.sh: 2 nodes, 16 CPUs, 2 GPUs" in stdout
    assert sorted(metrics) == [1, 2]
    assert result["summary"]["replicas"] >= 2
    for s in result["steps"]:
        assert s["gen_s"] > 0 and s["step_s"] >= s["gen_s"]
        assert s["response_length"]["max"] >= s["response_length"]["p50"] > 0


def test_trainer_ranks_and_replicas_on_both_nodes(two_steps):
    """One trainer rank per node (nnodes=2 x 1 slot), and each replica's server beside its rank."""
    *_, c = two_steps
    # In a fresh process: Ray reads its authentication mode once, at import.
    query = ("import json, ray; from ray.util.state import list_actors; ray.init(log_to_driver=False); "
             "print(json.dumps([[a.class_name, a.node_id] for a in list_actors(limit=10000, detail=True)]))")
    out = subprocess.run([sys.executable, "-c", query], capture_output=True, text=True, timeout=120,
                         env=dict(c["env"], RAY_ADDRESS=c["address"]))
    assert out.returncode == 0, out.stderr[-2000:]
    actors = json.loads(out.stdout.strip().splitlines()[-1])
    nodes_of = lambda part: {node for name, node in actors if part in (name or "")}
    assert len(nodes_of("WorkerDict")) == 2, actors
    assert len(nodes_of("VllmServer")) == 2, actors


def test_engine_logprobs_match_actor(two_steps):
    """verl recomputes the sampled tokens' log-probs with the actor and compares them with the
    engine's. Step 2 samples with the weights pushed after step 1's update, so a push that did not
    reach the engine shows up as a large difference there."""
    _, metrics, *_ = two_steps
    assert abs(metrics[1]["actor/pg_loss"]) > 0 or metrics[1]["actor/grad_norm"] > 0  # the actor moved
    for step in (1, 2):
        m = metrics[step]
        assert m["training/rollout_probs_diff_valid"] == 1.0
        assert m["training/rollout_probs_diff_max"] < 2e-3, m["training/rollout_probs_diff_max"]
        assert m["training/rollout_probs_diff_mean"] < 1e-4
        assert m["training/rollout_actor_probs_pearson_corr"] > 0.999
