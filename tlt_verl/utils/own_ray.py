"""A Ray of one's own: a temp dir that a test, a bench or a tool starts Ray under, and ends by
process id afterwards, leaving every other Ray cluster on the machine (a user's training) alone."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


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
