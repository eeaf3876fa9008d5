"""A weight sync adds one bucket to the sending rank's host memory, not a copy of the model.

Runs bench/weight_sync_memory.py small (a 174 MiB target, 32 MiB buckets) in its own process:
the production sender (verl's, shared memory on CPU) into a real engine, peak RSS from the
kernel's high-water mark. The old path (host copy + file) is measured beside it, so the test
also shows the measurement tells the two apart.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_weight_sync_adds_one_bucket_not_a_model(tmp_path):
    out = tmp_path / "wsm.json"
    p = subprocess.run([sys.executable, str(REPO / "bench" / "weight_sync_memory.py"), "--hidden", "512",
                        "--layers", "8", "--vocab", "12288", "--bucket-mb", "32", "--repeats", "2",
                        "--work", str(tmp_path / "work"), "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["scaled_served_differs"] and r["original_served_again"]
    assert r["model_mib"] > 5 * r["bucket_mib"]
    assert r["peak_rss_added_over_bucket"] <= 1.1, r["syncs"]
    assert r["file_path_peak_rss_added_over_model"] >= 0.9, r["file_path"]
