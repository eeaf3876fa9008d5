import os
import signal
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest

from tlt_verl.utils.own_ray import OwnRay

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("VERL_PLATFORM", "cpu")


# The asset build in the background: the SFT model on one thread (two OpenMP threads beside the
# tests' own processes crawl, see SFTConfig.threads) and a cap no tighter than the tests' patience
# (the cap is not part of the model's identity), then the warm drafter on one thread.
BUILD_ASSETS = """
import signal, sys
from dataclasses import replace
from pathlib import Path
import torch
# Stopped early (the session ended first), the build's finally clauses remove its half-built folder.
signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
from tlt_verl.task.prepare import PrepareSettings, prepare
from tlt_verl.task.warm_drafter import prepare_warm_drafter
torch.set_num_threads(1)
root, base = Path(sys.argv[1]), PrepareSettings()
prepare(root, settings=replace(base, sft=replace(base.sft, threads=1, budget_s=3600.0)))
prepare_warm_drafter(root)
"""
_builder: dict = {}


def _assets_root() -> Path:
    from tlt_verl.launch.runner import DEFAULT_HOME

    return Path(os.environ.get("TLT_TEST_ASSETS", DEFAULT_HOME / "assets"))


def _start_asset_build() -> None:
    """On a clean clone, build the assets in a child at the lowest priority while the tests that
    need none run first (see pytest_collection_modifyitems): those leave a core idle much of the
    time (process start-ups, Ray and engine hand-offs), and the SFT model and warm drafter are
    about 9 minutes of CPU here (the suite from a clean clone: 30 min with the build beside the
    tests, 40 min with it in line, on a box whose speed drifted in between). A test that needs them waits on prepare's lock, which the child holds while
    it builds; if the child fails, that test's own prepare builds them."""
    from tlt_verl.task.prepare import stale_stages
    from tlt_verl.task.warm_drafter import is_current

    root = _assets_root()
    if not stale_stages(root) and is_current(root):
        return
    fd, name = tempfile.mkstemp(prefix="tlt-asset-build-", suffix=".log")
    os.close(fd)
    log_path = Path(name)
    with open(log_path, "w") as log:
        _builder["proc"] = subprocess.Popen([sys.executable, "-c", BUILD_ASSETS, str(root)], stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True,
                                            preexec_fn=_lowest_priority)
    _builder["log"] = log_path


def _asset_need(item) -> int:
    """0: no assets; 1: the SFT model (built first); 2: the warm drafter too (built from it)."""
    names = set(getattr(item, "fixturenames", ()))
    return 2 if "warm_drafter" in names else 1 if "assets" in names else 0


def _lowest_priority() -> None:
    # SCHED_IDLE: CPU time only when nothing else wants it. A nice-19 build still took enough from
    # the tests' own processes (verl's and Ray's run niced) to slow some modules by half.
    from tlt_verl.utils.priority import idle_priority

    idle_priority()


def pytest_collection_finish(session):
    # Only for the whole suite (no test paths given, as CI runs it): its tests that need no assets
    # take longer than the build. A few selected modules would wait for a one-thread build at idle
    # priority, slower than the fixtures' own (399 s for the SFT model alone here, against 274 s).
    if session.config.option.collectonly or session.config.args_source == pytest.Config.ArgsSource.ARGS:
        return
    needs = [_asset_need(item) > 0 for item in session.items]
    if any(needs) and not all(needs):
        _start_asset_build()


def pytest_sessionfinish(session, exitstatus):
    proc, log = _builder.pop("proc", None), _builder.pop("log", None)
    if proc is None:
        return
    if proc.poll() not in (None, 0):
        print(f"\nthe background asset build failed (exit {proc.returncode}): {log}")
        return
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
        # Only the builder this session started, and what it started (its own process group).
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    log.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    """The task's tokenizer, data and SFT model, from the project's cache (built once if missing)."""
    from tlt_verl.task.prepare import prepare

    proc = _builder.get("proc")
    if proc is not None and proc.poll() not in (None, 0):
        tail = _builder["log"].read_text(errors="replace")[-2000:]
        warnings.warn(f"the background asset build failed (exit {proc.returncode}); building here. Its log ends:\n{tail}")
    return prepare(_assets_root())


@pytest.fixture(scope="session")
def warm_drafter(assets) -> Path:
    """The SFT model's warm drafter (exported folder with its checkpoints), built once if missing."""
    from tlt_verl.task.warm_drafter import prepare_warm_drafter

    return prepare_warm_drafter(Path(assets["root"]))


@pytest.fixture(scope="session")
def tlt_e2e_run() -> dict:
    """What tests/test_tlt_e2e.py's runs wrote ("dir": its run folder), once they finished: a module
    after it (tests/test_serve.py) serves that real run's export instead of training another run."""
    return {}


def pytest_addoption(parser):
    parser.addoption("--reverse-modules", action="store_true",
                     help="run the test modules in the reverse of their usual order (an order-dependence check)")


def pytest_collection_modifyitems(config, items):
    modules: dict = {}
    for item in items:
        modules.setdefault(item.path, []).append(item)
    # Modules that need the task's assets last, those that need the warm drafter after those that need
    # only the SFT model: on a clean clone each is built while the modules before it run.
    groups = sorted(modules.values(), key=lambda group: max(_asset_need(item) for item in group))
    if config.getoption("--reverse-modules"):
        groups.reverse()
    items[:] = [item for group in groups for item in group]


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
