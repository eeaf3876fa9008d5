"""Run a test's engine phase in a fresh interpreter: JSON spec in, JSON result out.

vLLM binds threads, opens sockets and caches per process, and a dead engine can take its
process down; a child with private scratch folders keeps that away from pytest and other tests.
The child is the test file itself, run as a script whose `__main__` calls `child_main(fn)`.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable


def run_in_subprocess(script: str, spec: dict, work: Path, env_extra: dict | None = None,
                      drop_env: tuple[str, ...] = (), timeout: int = 900) -> dict:
    work = Path(work)
    scratch = work / "scratch"
    (scratch / "tmp").mkdir(parents=True, exist_ok=True)
    spec_path, out = work / "spec.json", work / "result.json"
    spec_path.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k not in drop_env}
    env.update(TLT_SCRATCH=str(scratch), TMPDIR=str(scratch / "tmp"), PYTHONUNBUFFERED="1", **(env_extra or {}))
    t0 = time.time()
    proc = subprocess.run([sys.executable, script, "--spec", str(spec_path), "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    result.setdefault("timings", {})["subprocess"] = time.time() - t0
    return result


def concurrently(jobs: dict[str, Callable[[], object]], workers: int = 2) -> dict[str, object]:
    """Independent child-process jobs, `workers` at a time: results by key. For checks whose cost
    is a child's start-up (importing verl costs ~11 s of one core) rather than its work, so that two
    of them share the two cores of this box instead of queueing."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {key: pool.submit(job) for key, job in jobs.items()}
        return {key: f.result() for key, f in futures.items()}


def child_main(fn: Callable[[dict], dict], argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    Path(args.out).write_text(json.dumps(fn(json.loads(Path(args.spec).read_text()))))
