"""Every recipe is a stock `verl.trainer.main_ppo` command line whose config composes under
verl's Hydra schema and whose `tlt:` block passes TLT's start-up validation."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tlt_verl.integration.config import TLTConfig

REPO = Path(__file__).resolve().parents[1]
GPU_RECIPES = {"qwen2.5_7b_grpo_8gpu": 1, "qwen2.5_32b_grpo_multinode": 4}


# A `python` first on the recipe's PATH: the recipe's own shell logic (its defaults from the
# environment, the caller's overrides) runs as written, and the command line it would exec is
# written out instead of run; other python calls (the reward function's path) go to the real one.
PYTHON_SHIM = """#!/usr/bin/env bash
if [ "$1" = -m ] && [ "$2" = verl.trainer.main_ppo ]; then
  shift 2
  exec "{python}" -c 'import json, sys; print(json.dumps(sys.argv[1:]))' "$@"
fi
exec "{python}" "$@"
"""

# verl's main_ppo composes its config with Hydra (config "ppo_trainer" in verl/trainer/config),
# which is what `main_ppo ... --cfg job` prints: the same composition of every recipe's command
# line in one child, so that verl is imported once (about 11 s of a core each time).
COMPOSE = """
import json, os, sys
import verl
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
jobs = json.load(open(sys.argv[1]))
out = {}
with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"),
                           version_base=None):
    for name, args in jobs.items():
        try:
            out[name] = OmegaConf.to_container(compose(config_name="ppo_trainer", overrides=args), resolve=False)
        except Exception as e:
            sys.exit(f"{name}: {type(e).__name__}: {e}")
json.dump(out, open(sys.argv[2], "w"))
"""


def _command_line(recipe: str, shim: Path, *overrides, **env) -> list[str]:
    """The overrides `recipes/<recipe>.sh` passes to verl's main_ppo, under ``env``."""
    env = {**os.environ, "MODEL": "/models/m", "TRAIN": "/data/t.parquet", "VAL": "/data/v.parquet",
           "PATH": f"{shim}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", **env}
    out = subprocess.run(["bash", str(REPO / "recipes" / f"{recipe}.sh"), *overrides], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


COMPOSITIONS = {
    **{recipe: (recipe, (), {}) for recipe in GPU_RECIPES},
    "multinode_from_env": ("qwen2.5_32b_grpo_multinode", (), {"NNODES": "2", "DRAFTER": "/drafters/eagle"}),
    "tiny_gpu": ("tiny_gpu_grpo", (), {}),
    # `./tlt run` appends +tlt.enable / +tlt.drafter.init; Hydra refuses a key added twice.
    "tiny_gpu_callers_switch": ("tiny_gpu_grpo", ("+tlt.enable=true", "+tlt.drafter.init=/drafters/eagle"), {}),
    "tiny_cpu": ("tiny_cpu_grpo", (), {}),
}


@pytest.fixture(scope="module")
def composed(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipes")
    shim = root / "bin"
    shim.mkdir()
    (shim / "python").write_text(PYTHON_SHIM.format(python=sys.executable))
    (shim / "python").chmod(0o755)
    jobs = {name: _command_line(r, shim, *o, **e) for name, (r, o, e) in COMPOSITIONS.items()}
    (root / "jobs.json").write_text(json.dumps(jobs))
    out = subprocess.run([sys.executable, "-c", COMPOSE, str(root / "jobs.json"), str(root / "composed.json")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads((root / "composed.json").read_text())


def test_recipes_are_main_ppo_command_lines():
    """Each recipe execs `python -m verl.trainer.main_ppo` with its overrides, and the caller's
    arguments go last: what the compositions above stand for."""
    for recipe in ("tiny_cpu_grpo", "tiny_gpu_grpo", *GPU_RECIPES):
        text = (REPO / "recipes" / f"{recipe}.sh").read_text()
        assert re.search(r"^exec python -m verl\.trainer\.main_ppo \\$", text, re.M), recipe
        assert text.rstrip().endswith('"$@"'), recipe


@pytest.mark.parametrize("recipe", sorted(GPU_RECIPES))
def test_gpu_recipe_composes_with_tlt(recipe, composed):
    cfg = composed[recipe]
    assert cfg["trainer"]["nnodes"] == GPU_RECIPES[recipe] and cfg["trainer"]["n_gpus_per_node"] == 8
    assert cfg["actor_rollout_ref"]["rollout"]["name"] == "tlt_vllm"
    tlt = TLTConfig.from_dict(cfg["tlt"])
    assert tlt.enable and tlt.drafter.init == "scratch" and tlt.sd.threshold == 32


def test_drafter_and_nodes_come_from_the_environment(composed):
    cfg = composed["multinode_from_env"]
    assert cfg["trainer"]["nnodes"] == 2 and cfg["tlt"]["drafter"]["init"] == "/drafters/eagle"


def test_tiny_gpu_recipe_composes_for_one_gpu_with_tlt(composed):
    cfg = composed["tiny_gpu"]
    rollout = cfg["actor_rollout_ref"]["rollout"]
    assert cfg["trainer"]["n_gpus_per_node"] == 1 and cfg["trainer"]["total_training_steps"] == 3
    assert rollout["name"] == "tlt_vllm" and rollout["tensor_model_parallel_size"] == 1
    assert rollout["gpu_memory_utilization"] == 0.4 and cfg["actor_rollout_ref"]["actor"]["strategy"] == "fsdp2"
    tlt = TLTConfig.from_dict(cfg["tlt"])
    assert tlt.enable and tlt.drafter.init == "scratch"


def test_tiny_gpu_recipe_takes_the_callers_tlt_switch(composed):
    assert composed["tiny_gpu_callers_switch"]["tlt"] == {"enable": True, "drafter": {"init": "/drafters/eagle"}}


@pytest.mark.parametrize("recipe", ["tiny_cpu", "tiny_gpu"])
def test_tiny_recipes_sample_with_the_fast_poll_replay_buffer(recipe, composed):
    """Both arms of a tiny-recipe comparison (TLT on and off) take verl's sync replay buffer polled
    every 0.1 s, and verl's loader finds the class the recipe names."""
    from verl.utils.import_utils import load_extern_object

    from tlt_verl.launch.sampler import DEFAULT_POLL_INTERVAL_S, FastPollReplayBuffer

    sampler = composed[recipe]["trainer"]["v1"]["sampler"]
    cls = load_extern_object(sampler["custom_sampler"]["path"], sampler["custom_sampler"]["name"])
    assert cls is FastPollReplayBuffer
    kwargs = dict(trainer_mode="sync", trainer_config={}, max_off_policy_threshold=sampler["max_off_policy_threshold"],
                  max_off_policy_strategy=sampler["max_off_policy_strategy"], refill_fn=None)
    assert cls(sampler_kwargs=sampler["sampler_kwargs"], **kwargs).poll_interval == DEFAULT_POLL_INTERVAL_S < 2.0
    assert cls(sampler_kwargs={"poll_interval_s": 0.5}, **kwargs).poll_interval == 0.5
    for bad, message in [({"poll_interval_s": 0}, "poll_interval_s=0: must be"),
                         ({"poll_intervall_s": 1}, "unknown option(s) ['poll_intervall_s']")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            cls(sampler_kwargs=bad, **kwargs)
    with pytest.raises(ValueError, match="trainer.v1.trainer_mode=async"):
        cls(sampler_kwargs={}, **{**kwargs, "trainer_mode": "async"})
