"""Every recipe is a stock `verl.trainer.main_ppo` command line whose config composes under
verl's Hydra schema and whose `tlt:` block passes TLT's start-up validation."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tlt_verl.integration.config import TLTConfig

REPO = Path(__file__).resolve().parents[1]
GPU_RECIPES = {"qwen2.5_7b_grpo_8gpu": 1, "qwen2.5_32b_grpo_multinode": 4}


def composed(recipe: str, tmp_path, *overrides, **env) -> dict:
    env = {**os.environ, "MODEL": "/models/m", "TRAIN": "/data/t.parquet", "VAL": "/data/v.parquet",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", **env}
    out = subprocess.run(["bash", str(REPO / "recipes" / f"{recipe}.sh"), *overrides, "--cfg", "job"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return yaml.safe_load(out.stdout)


@pytest.mark.parametrize("recipe", sorted(GPU_RECIPES))
def test_gpu_recipe_composes_with_tlt(recipe, tmp_path):
    cfg = composed(recipe, tmp_path)
    assert cfg["trainer"]["nnodes"] == GPU_RECIPES[recipe] and cfg["trainer"]["n_gpus_per_node"] == 8
    assert cfg["actor_rollout_ref"]["rollout"]["name"] == "tlt_vllm"
    tlt = TLTConfig.from_dict(cfg["tlt"])
    assert tlt.enable and tlt.drafter.init == "scratch" and tlt.sd.threshold == 32


def test_drafter_and_nodes_come_from_the_environment(tmp_path):
    cfg = composed("qwen2.5_32b_grpo_multinode", tmp_path, NNODES="2", DRAFTER="/drafters/eagle")
    assert cfg["trainer"]["nnodes"] == 2 and cfg["tlt"]["drafter"]["init"] == "/drafters/eagle"


def test_tiny_gpu_recipe_composes_for_one_gpu_with_tlt(tmp_path):
    cfg = composed("tiny_gpu_grpo", tmp_path)
    rollout = cfg["actor_rollout_ref"]["rollout"]
    assert cfg["trainer"]["n_gpus_per_node"] == 1 and cfg["trainer"]["total_training_steps"] == 3
    assert rollout["name"] == "tlt_vllm" and rollout["tensor_model_parallel_size"] == 1
    assert rollout["gpu_memory_utilization"] == 0.4 and cfg["actor_rollout_ref"]["actor"]["strategy"] == "fsdp2"
    tlt = TLTConfig.from_dict(cfg["tlt"])
    assert tlt.enable and tlt.drafter.init == "scratch"


def test_tiny_gpu_recipe_takes_the_callers_tlt_switch(tmp_path):
    # `./tlt run` appends +tlt.enable / +tlt.drafter.init; Hydra refuses a key added twice.
    cfg = composed("tiny_gpu_grpo", tmp_path, "+tlt.enable=true", "+tlt.drafter.init=/drafters/eagle")
    assert cfg["tlt"] == {"enable": True, "drafter": {"init": "/drafters/eagle"}}
