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


def composed(recipe: str, tmp_path, **env) -> dict:
    env = {**os.environ, "MODEL": "/models/m", "TRAIN": "/data/t.parquet", "VAL": "/data/v.parquet",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", **env}
    out = subprocess.run(["bash", str(REPO / "recipes" / f"{recipe}.sh"), "--cfg", "job"], cwd=tmp_path,
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
