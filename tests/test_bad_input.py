"""A user's mistake stops `python -m verl.trainer.main_ppo` at start-up with one line naming it."""
import json

import pandas as pd
import pytest

from _subproc import concurrently
from conftest import run_main_ppo
from tlt_verl.task.longtail import write_parquet


def _args(model, train, *extra):
    return [f"actor_rollout_ref.model.path={model}", f"data.train_files={train}", f"data.val_files={train}",
            "actor_rollout_ref.rollout.name=vllm", *extra]


# A mistake -> (the trainer's arguments, given the inputs; what its one line must say).
TLT = ("+tlt.enable=true",)
CASES = {
    "missing_model_path": (lambda i: _args(i["dir"] / "nope", i["train"]),
                           ["actor_rollout_ref.model.path=", "no such model directory"]),
    "gpu_only_option_on_cpu": (lambda i: _args(i["model"], i["train"], "actor_rollout_ref.actor.strategy=fsdp"),
                               ["actor_rollout_ref.actor.strategy=fsdp needs a GPU", "fsdp2"]),
    "malformed_dataset_row": (lambda i: _args(i["model"], i["bad"]),
                              ["data.train_files", "bad.parquet row 5", "'prompt'"]),
    "missing_dataset_file": (lambda i: _args(i["model"], i["dir"] / "missing.parquet"),
                             ["data.train_files: no such file"]),
    "no_drafter_source": (lambda i: _args(i["model"], i["train"], *TLT),
                          ["tlt.drafter.init: not set", "scratch"]),
    "unsupported_rollout_engine": (lambda i: _args(i["model"], i["train"], *TLT, "+tlt.drafter.init=scratch",
                                                   "actor_rollout_ref.rollout.name=hf"),
                                   ["actor_rollout_ref.rollout.name=hf is not supported by TLT"]),
    "unknown_option": (lambda i: _args(i["model"], i["train"], *TLT, "+tlt.drafter.init=scratch",
                                       "+tlt.spot.train_evry_steps=2"),
                       ["tlt.spot: unknown option(s) ['train_evry_steps']"]),
}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """Every case's trainer run, two at a time: each stops at start-up, so its cost is importing verl."""
    root = tmp_path_factory.mktemp("bad_input")
    model = root / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    train = write_parquet(root / "train.parquet", 8, 0, "train")
    df = pd.read_parquet(train)
    df.at[5, "prompt"] = []  # an empty conversation
    df.to_parquet(root / "bad.parquet")
    inputs = {"model": model, "train": train, "bad": root / "bad.parquet", "dir": root}

    def job(name):
        cwd = root / name
        cwd.mkdir()
        return lambda: run_main_ppo(CASES[name][0](inputs), cwd=cwd, timeout=240)

    return concurrently({name: job(name) for name in CASES})


def _one_line_error(out):
    assert out.returncode != 0
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("tlt-verl:")]
    assert len(lines) == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("case", list(CASES))
def test_a_mistake_stops_the_trainer_in_one_line(outputs, case):
    line = _one_line_error(outputs[case])
    for text in CASES[case][1]:
        assert text in line, line


def test_tlt_yaml_mirrors_the_dataclasses():
    """recipes/tlt.yaml is the documented `tlt:` block: every option, at the dataclasses' default."""
    from dataclasses import asdict
    from pathlib import Path

    import yaml

    from tlt_verl.integration.config import TLTConfig

    def plain(x):  # tuples in the dataclasses are lists in YAML
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        return [plain(v) for v in x] if isinstance(x, (list, tuple)) else x

    documented = yaml.safe_load((Path(__file__).parents[1] / "recipes" / "tlt.yaml").read_text())["tlt"]
    assert documented == plain(asdict(TLTConfig()))
    assert TLTConfig.from_dict({**documented, "enable": True, "drafter": {**documented["drafter"], "init": "scratch"}})


def test_tlt_on_several_nodes_needs_shared_absolute_folders(tmp_path, monkeypatch):
    from omegaconf import OmegaConf

    from tlt_verl.integration.config import TLTConfig
    from tlt_verl.integration.startup_checks import ConfigError
    from tlt_verl.integration.tlt_setup import _check_shared_paths

    tlt = TLTConfig.from_dict({"enable": True, "drafter": {"init": "scratch"}})
    relative = OmegaConf.create({"trainer": {"nnodes": 2, "default_local_dir": "checkpoints/p/e"}})
    with pytest.raises(ConfigError) as e:
        _check_shared_paths(relative, tlt)
    assert str(e.value).startswith("tlt.enable=true: trainer.default_local_dir=checkpoints/p/e: trainer.nnodes=2 "
                                   "needs an absolute path") and "\n" not in str(e.value)
    shared = OmegaConf.create({"trainer": {"nnodes": 2, "default_local_dir": str(tmp_path)}})
    _check_shared_paths(shared, tlt)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "drafters" / "x").mkdir(parents=True)
    (tmp_path / "drafters" / "x" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(ConfigError, match="tlt.drafter.init=drafters/x"):
        _check_shared_paths(shared, TLTConfig.from_dict({"enable": True, "drafter": {"init": "drafters/x"}}))
    # One node: a relative folder is made absolute by the check that uses it, not refused.
    _check_shared_paths(OmegaConf.create({"trainer": {"nnodes": 1, "default_local_dir": "checkpoints"}}), tlt)


def test_drafter_kind_follows_the_init_folder(tmp_path):
    from tlt_verl.integration.config import TLTConfig, TLTConfigError

    def folder(name, arch):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(f'{{"architectures": ["{arch}"]}}')
        return str(tmp_path / name)

    e3, e1 = folder("e3", "LlamaForCausalLMEagle3"), folder("e1", "LlamaForCausalLM")

    def drafter(**d):
        return TLTConfig.from_dict({"enable": True, "drafter": d}).drafter

    assert (drafter(init=e3).kind, drafter(init=e3).buffer.kind) == ("eagle3", "eagle3")
    assert drafter(init=e1).kind == "eagle" and drafter(init="scratch").kind == "eagle"
    assert drafter(init="scratch", kind="eagle3").buffer.kind == "eagle3"
    with pytest.raises(TLTConfigError) as e:
        drafter(init=e3, kind="eagle")
    assert str(e.value) == f"tlt.drafter.kind=eagle: tlt.drafter.init={e3} is an eagle3 drafter (leave kind unset to take the folder's)"
    with pytest.raises(TLTConfigError, match=r"tlt.drafter.init=.*architecture 'GPT2' is not an EAGLE drafter"):
        drafter(init=folder("gpt", "GPT2"))

