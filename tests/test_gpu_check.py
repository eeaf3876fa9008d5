"""bench/gpu_check.sh: the dry run on this CPU runs every part a CPU can, with sane numbers, and
builds and validates the GPU-only ones; without a CUDA device the GPU run stops in one line that
the JSON keeps, and skips every part; on a bare GPU image (torch without vLLM, verl or Ray) the
torch-only parts run and the serving ones skip with the stack's line."""
import json
import math
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PARTS = {"stack": None, "sft": 1, "kernels": 4, "recipe": 2, "sd_decode": 3, "cuda_graphs": 5, "spot": None}
SERVING = ("recipe", "sd_decode", "cuda_graphs")
# A bare GPU image (torch and transformers, no vLLM, verl, Ray or flash-attn), as the device
# machine lent to sessions is: those packages are not found, as if not installed.
BARE_IMAGE = """
import importlib.metadata as md, sys
from importlib.machinery import PathFinder
ABSENT = ("vllm", "verl", "ray", "flash_attn")
class Finder(PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return None if name.split(".")[0] in ABSENT else PathFinder.find_spec(name, path, target)
sys.meta_path[:] = [Finder if f is PathFinder else f for f in sys.meta_path]
version = md.version
def absent_version(name):
    if name.replace("-", "_") in ABSENT:
        raise md.PackageNotFoundError(name)
    return version(name)
md.version = absent_version
"""


def gpu_check(tmp: Path, *args: str, **env_extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp / "gpu_check.json"
    env = dict(os.environ, **env_extra)
    env.pop("RAY_ADDRESS", None)
    res = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), "--out", str(out), "--work", str(tmp / "work"),
                          *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert out.exists(), res.stdout[-3000:] + res.stderr[-3000:]
    return res, json.loads(out.read_text())


@pytest.fixture(scope="module")
def dry_run(assets, tmp_path_factory):
    root = Path(assets["root"])
    assert root.name == "assets", "the dry run reads <home>/assets"
    # A generous total: on a contended box the parts still get to finish; the time a dry run
    # takes on an idle one (< 3 minutes) is in the JSON, not asserted here.
    return gpu_check(tmp_path_factory.mktemp("gpu_check"), "--cpu-dry-run", "--home", str(root.parent),
                     "--total-s", "800")


def test_report_layout(dry_run):
    res, report = dry_run
    assert res.returncode == 0, res.stdout[-3000:]
    assert report["mode"] == "cpu-dry-run" and report["status"] == "ok"
    assert list(report["parts"]) == list(PARTS)
    for name, part in report["parts"].items():
        assert part["part"] == PARTS[name]
        assert part["status"] in ("ok", "skipped"), (name, part)
        assert 0 < part["wall_s"] <= part["budget_s"] + 20
    versions = report["versions"]
    assert versions["vllm"].startswith("0.30.0") and versions["verl"].startswith("0.9.1")
    assert versions["torch"].startswith("2.") and "cuda" in versions and "gpu" not in versions
    assert report["wall_s"] >= sum(p["wall_s"] for p in report["parts"].values()) - 1


def test_the_plan_fits_a_lent_device_and_is_printed(dry_run):
    res, report = dry_run
    plans = report["plan"]
    # A lent device: 15 minutes a session, starts included; the check asks for at most 8.
    for name in ("gpu_bare_image", "gpu_full_stack"):
        assert 0 < plans[name]["planned_s"] <= 480, plans[name]
        assert f"at most {plans[name]['planned_s']}s" in res.stdout
    # Torch alone (the lent machines so far): the serving parts are planned as skipped, not run.
    assert set(plans["gpu_bare_image"]["skipped"]) == set(SERVING)
    assert set(plans["gpu_bare_image"]["parts"]) == set(PARTS) - set(SERVING)
    assert plans["gpu_full_stack"]["skipped"] == {}
    # What the dry run itself ran stayed inside its own plan.
    assert report["wall_s"] <= plans["cpu-dry-run"]["planned_s"] + 20


def test_sft_reuses_the_cached_assets_and_trains_on_the_device_path(dry_run):
    sft = dry_run[1]["parts"]["sft"]
    assert sft["status"] == "ok"
    assert {s["status"] for s in sft["stages"].values()} == {"cached"}
    assert sft["model"]["steps"] > 0 and 0 < sft["model"]["final_loss"] < 1
    smoke = sft["smoke"]
    assert smoke["steps"] == 10 and smoke["device"] == "cpu" and math.isfinite(smoke["final_loss"])


def test_soft_ce_matches_the_reference_and_flash_is_left_to_the_gpu(dry_run):
    kernels = dry_run[1]["parts"]["kernels"]
    assert kernels["status"] == "ok" and kernels["device"] == "cpu"
    ce = kernels["checks"]["soft_ce_torch"]
    assert ce["status"] == "ok" and set(ce["max_abs_diff"]) == {"loss", "d_hidden", "d_weight"}
    for key, diff in ce["max_abs_diff"].items():
        assert 0 <= diff <= 1e-4 * max(ce["max_abs_ref"][key], 1.0)
        assert ce["max_abs_ref"][key] > 0.1     # the compared tensors are not trivially zero
    assert kernels["checks"]["flash_varlen"] == {"status": "skipped", "reason": "needs a CUDA device"}


def test_decode_bench_has_plain_and_sd_rows_per_batch(dry_run):
    sd = dry_run[1]["parts"]["sd_decode"]
    assert sd["status"] == "ok" and sd["drafter"] == "warmed" and sd["drafter_warmup"]["status"] == "ok"
    assert set(sd["by_batch"]) == {"1", "2"}
    for row in sd["by_batch"].values():
        assert row["plain_wall_tok_s"] > 0 and row["plain_decode_step_ms"] > 0
        assert set(row["sd"]) == {"0", "1", "2"} and row["best_k"] in (1, 2)
        assert row["sd"]["0"]["acceptance_rate"] is None
        for k in ("1", "2"):
            assert row["sd"][k]["wall_tok_s"] > 0 and 0 <= row["sd"][k]["acceptance_rate"] <= 1


def test_gpu_only_parts_are_built_and_validated(dry_run):
    parts = dry_run[1]["parts"]
    recipe = parts["recipe"]
    assert recipe["status"] == "skipped" and recipe["reason"] == "needs a GPU"
    assert all(recipe["validated"]["checks"].values()), recipe["validated"]["checks"]
    command = recipe["validated"]["command"]
    assert command[:2] == ["bash", "recipes/tiny_gpu_grpo.sh"]
    assert "+tlt.enable=true" in command and "+tlt.drafter.init=scratch" in command
    graphs = parts["cuda_graphs"]
    assert graphs["status"] == "skipped" and graphs["validated"] is True
    sizes = graphs["config"]["pool_capture_sizes"]
    assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] <= graphs["config"]["max_num_batched_tokens"]
    assert graphs["config"]["pool_n_sizes"] == len(sizes)


def test_the_spot_trainer_learns_on_the_device_path(dry_run):
    spot = dry_run[1]["parts"]["spot"]
    assert spot["status"] == "ok" and spot["device"] == "cpu" and spot["backend"] == "gloo"
    assert spot["generation"]["responses"] == 8 and spot["capture"]["samples"] == 8
    training = spot["training"]
    assert training["steps"] >= 2 and training["tokens"] > 0 and training["seconds"] > 0
    assert training["last_loss"] < training["first_loss"]
    assert 0 <= spot["top1_agreement"]["untrained"] <= 1 and 0 <= spot["top1_agreement"]["trained"] <= 1
    assert len(spot["export"]["sha256"]) == 64


def test_a_bare_gpu_image_runs_the_torch_parts_and_skips_the_serving_ones(assets, tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BARE_IMAGE)
    res, report = gpu_check(tmp_path, "--cpu-dry-run", "--home", str(Path(assets["root"]).parent), "--total-s", "600",
                            "--only", "recipe,sd_decode,cuda_graphs,spot", PYTHONPATH=str(site))
    assert res.returncode == 1 and report["status"] == "failed"
    line = report["error"]
    assert line.startswith("GPU stack missing: vllm, verl, ray;") and "\n" not in line
    assert report["versions"]["vllm"] is None and report["versions"]["torch"].startswith("2.")
    parts = report["parts"]
    assert parts["stack"]["status"] == "failed" and parts["stack"]["error"] == [line]
    assert all(parts[name] == {"part": PARTS[name], "status": "skipped", "reason": line} for name in SERVING)
    assert parts["sft"]["status"] == "ok" and parts["spot"]["status"] == "ok"
    assert parts["spot"]["training"]["steps"] >= 1
    assert parts["kernels"]["reason"] == "not selected (--only)"


def test_without_a_gpu_the_gpu_run_stops_in_one_line(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    res, report = gpu_check(tmp_path, "--home", str(tmp_path / "home"))
    assert res.returncode == 1 and report["mode"] == "gpu" and report["status"] == "failed"
    line = report["error"]
    assert line.startswith("no CUDA device visible to torch") and "\n" not in line
    assert report["parts"]["stack"]["error"] == [line]
    assert all(p["status"] == "skipped" and p["reason"] == line
               for name, p in report["parts"].items() if name != "stack")
    assert line in res.stdout


def test_sft_device_is_not_part_of_the_assets_cache_key(tmp_path):
    # The GPU run's SFT model must look up to date to `tlt run`, which prepares with defaults.
    from dataclasses import replace

    import torch

    from tlt_verl.task.prepare import PrepareSettings, _hash, _stage_settings
    from tlt_verl.task.sft import SFTConfig, train_sft

    cpu = PrepareSettings()
    gpu = replace(cpu, sft=replace(cpu.sft, device="cuda"))
    assert _hash(_stage_settings(gpu)["model"]) == _hash(_stage_settings(cpu)["model"])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"^SFTConfig.device='cuda': this torch sees no CUDA device$"):
            train_sft(None, tmp_path, SFTConfig(device="cuda"))
