import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("VERL_PLATFORM", "cpu")


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    """The task's tokenizer, data and SFT model, from the project's cache (built once if missing)."""
    from tlt_verl.launch.runner import DEFAULT_HOME
    from tlt_verl.task.prepare import prepare

    root = Path(os.environ.get("TLT_TEST_ASSETS", DEFAULT_HOME / "assets"))
    return prepare(root)


def run_main_ppo(args, cwd, env_extra=None, timeout=900):
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env_extra or {}))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    return subprocess.run(
        [sys.executable, "-m", "verl.trainer.main_ppo", f"hydra.run.dir={cwd}/hydra", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
    )


@pytest.fixture(scope="module")
def no_leftover_ray():
    """For modules that start Ray: a failed run must not leave a cluster behind for the next."""
    yield
    if shutil.which("ray"):
        subprocess.run(["ray", "stop", "--force"], capture_output=True)
