import os
import subprocess
import sys
from pathlib import Path

import pytest

from tlt_verl.utils.own_ray import OwnRay

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("VERL_PLATFORM", "cpu")


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    """The task's tokenizer, data and SFT model, from the project's cache (built once if missing)."""
    from tlt_verl.launch.runner import DEFAULT_HOME
    from tlt_verl.task.prepare import prepare

    root = Path(os.environ.get("TLT_TEST_ASSETS", DEFAULT_HOME / "assets"))
    return prepare(root)


@pytest.fixture(scope="session")
def warm_drafter(assets) -> Path:
    """The SFT model's warm drafter (exported folder with its checkpoints), built once if missing."""
    from tlt_verl.task.warm_drafter import prepare_warm_drafter

    return prepare_warm_drafter(Path(assets["root"]))


def pytest_addoption(parser):
    parser.addoption("--reverse-modules", action="store_true",
                     help="run the test modules in the reverse of their usual order (an order-dependence check)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--reverse-modules"):
        modules: dict = {}
        for item in items:
            modules.setdefault(item.path, []).append(item)
        items[:] = [item for group in reversed(list(modules.values())) for item in group]


def run_main_ppo(args, cwd, env_extra=None, timeout=900):
    """verl's trainer in a child process; a local Ray it starts is its own (see OwnRay) and is
    ended with it."""
    ray_dir = OwnRay()
    env = dict(os.environ, PYTHONUNBUFFERED="1", **ray_dir.env, **(env_extra or {}))
    env.pop("RAY_ADDRESS", None)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    try:
        return subprocess.run(
            [sys.executable, "-m", "verl.trainer.main_ppo", f"hydra.run.dir={cwd}/hydra", *args],
            cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
        )
    finally:
        ray_dir.stop()


@pytest.fixture(scope="module")
def no_leftover_ray():
    """For modules that start Ray: the module's own Ray temp dir (an OwnRay). While the module
    runs, RAY_TMPDIR names it and RAY_ADDRESS is unset, so a driver it starts (verl's main_ppo calls
    ray.init itself) starts a local cluster under it; at the module's end whatever of those still
    runs (a failed run's cluster) is ended, and nothing else."""
    ray_dir = OwnRay()
    with pytest.MonkeyPatch.context() as mp:
        for key, value in ray_dir.env.items():
            mp.setenv(key, value)
        mp.delenv("RAY_ADDRESS", raising=False)
        try:
            yield ray_dir
        finally:
            ray_dir.stop()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_node_cluster(tmp_path_factory):
    """Two Ray nodes on this machine, started with docker/launch.sh as on a real cluster: distinct
    ports, each node half the CPUs and one logical GPU slot (one trainer rank each). The cluster's
    token file starts absent, so the head creates it as on a fresh cluster. Both nodes, and the
    drivers given ``env``, live in the fixture's own Ray temp dir (an OwnRay): that is what ends
    them afterwards, and it ends no other cluster on the machine."""
    launch = ["bash", str(REPO / "docker" / "launch.sh")]
    from ray.util import get_node_ip_address

    ray_dir = OwnRay()
    port = _free_port()
    address = f"{get_node_ip_address()}:{port}"
    # Every port a node would otherwise take at a fixed default (dashboard 8265, its agent 52365,
    # client server 10001) is picked free here: a user's cluster may hold the defaults.
    common = ["--num-cpus", "8", "--num-gpus", "1", "--temp-dir", str(ray_dir.temp_dir)]
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(tmp_path_factory.mktemp("ray_auth") / "auth_token"),
               **ray_dir.env)
    env.pop("RAY_AUTH_TOKEN", None)
    env.pop("RAY_ADDRESS", None)
    nodes = [
        [*launch, "head", "--port", str(port), *common, "--dashboard-port", str(_free_port()),
         "--ray-client-server-port", str(_free_port()),
         "--dashboard-agent-listen-port", str(_free_port()), "--metrics-export-port", str(_free_port())],
        [*launch, "worker", "--address", address, *common,
         "--dashboard-agent-listen-port", str(_free_port()), "--metrics-export-port", str(_free_port())],
    ]
    try:
        for cmd in nodes:
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180)
            assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
            if cmd[2] == "head":
                assert "new cluster token" in out.stderr and len(Path(env["RAY_AUTH_TOKEN_PATH"]).read_text()) == 64
        yield {"address": address, "launch": launch, "env": env, "ray_dir": ray_dir}
    finally:
        ray_dir.stop()
