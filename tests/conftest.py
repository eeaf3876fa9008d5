import os
import shutil
import subprocess
import sys
import tempfile
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


class OwnRay:
    """A Ray temp dir that belongs to one test: Ray started with it (``RAY_TMPDIR``, ``ray start
    --temp-dir``, ``ray.init(_temp_dir=...)``) keeps its sessions, sockets and address file there.
    So a ``ray.init()`` under it starts a cluster of its own instead of joining the one a user
    started (whose address is in /tmp/ray/ray_current_cluster), and ``stop()`` ends the clusters
    started under it and no others: never ``ray stop``, which ends every cluster on the machine."""

    def __init__(self):
        # Short and under /tmp: Ray's unix sockets live below it, and socket paths end at 107 bytes.
        self.root = Path(tempfile.mkdtemp(prefix="tlt-ray-", dir="/tmp"))
        self.temp_dir = self.root / "ray"      # where RAY_TMPDIR=root puts Ray's own temp dir
        self.env = {"RAY_TMPDIR": str(self.root)}

    def processes(self) -> list:
        """This user's processes that run from the temp dir (Ray's node processes name it on their
        command line or hold their logs open there; drivers have it in their environment), and
        their descendants (workers retitle themselves ``ray::...``). Never this process or its
        parents."""
        import psutil

        mine, inside = str(self.root), str(self.root) + os.sep
        me = psutil.Process()
        spared = {me.pid, *(p.pid for p in me.parents())}

        def runs_from_here(p) -> bool:
            if any(mine in a for a in p.info["cmdline"] or ()):
                return True
            if (p.info["environ"] or {}).get("RAY_TMPDIR") == mine:
                return True
            try:
                return (p.cwd() + os.sep).startswith(inside) or any(f.path.startswith(inside) for f in p.open_files())
            except psutil.Error:
                return False

        found = {}
        for p in psutil.process_iter(["uids", "cmdline", "environ"]):
            try:
                if p.pid in spared or p.info["uids"] is None or p.info["uids"].real != os.getuid():
                    continue
                if runs_from_here(p):
                    found[p.pid] = p
                    found.update((c.pid, c) for c in p.children(recursive=True))
            except psutil.Error:
                continue
        return [p for pid, p in found.items() if pid not in spared]

    def stop(self, grace_s: float = 10.0) -> list[int]:
        """End what still runs from the temp dir (SIGTERM, then SIGKILL after ``grace_s``) and
        remove it; returns the pids that were running."""
        import psutil

        ended = []
        for _ in range(3):                     # a raylet may start a worker while it is told to stop
            procs = self.processes()
            if not procs:
                break
            ended += [p.pid for p in procs]
            for p in procs:
                try:
                    p.terminate()
                except psutil.Error:
                    pass
            _, alive = psutil.wait_procs(procs, timeout=grace_s)
            for p in alive:
                try:
                    p.kill()
                except psutil.Error:
                    pass
            psutil.wait_procs(alive, timeout=5)
        shutil.rmtree(self.root, ignore_errors=True)
        return ended


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
