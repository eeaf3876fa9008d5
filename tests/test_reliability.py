"""Killed in the middle of a checkpoint save, resumed with nothing lost: one trial of
bench/reliability.py, short, through the bench's own watcher and kill (opt-in: two launches).
CI takes the same path in tests/test_tlt_e2e.py, whose first run is killed in step 3's save and
judged by the bench's own checks (`saved_on_disk`, `resume_verdict`).

A two-step TLT run of the CPU recipe (short steps, bench/reliability.py's SHORT; a drafter from
scratch, trained in the rollout; a checkpoint every step) has its driver SIGKILLed in the middle of
step 2's checkpoint save: its drafters are saved, so are verl's actor files, and verl has not yet
marked the step saved. Then the same command resumes it (`trainer.resume_mode=auto`). Checked with
the bench's own verdict (`trial`): every step verl marked saved is whole (verl's actor files, each
rank's drafter checkpoint against its sha256, the SD policy state), the resumed run named step 1's
checkpoint and resumed its drafters at their saved versions and its bandit at its saved pulls, not
the newer ones of the unfinished save, and finished step 2.

A tiny model's save takes well under a second, less than a busy box takes to schedule the bench's
watcher: the driver is held at that point (a `sitecustomize` on the run's PYTHONPATH, this test's
alone, stops it for a minute before it writes verl's tracker of step 2, once), where the bench's
watcher finds it and kills it.
"""
import os
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import reliability  # noqa: E402

# Two launches of Ray, verl and two vLLM replicas: 23 min on a 2-core box shared with a
# load of 25, several minutes on an idle one, more than CI's budget has left. Opt in.
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.environ.get("TLT_TEST_RELIABILITY"),
                                 reason="two launches of a real run (minutes); set TLT_TEST_RELIABILITY=1")]

HOLD = '''
import builtins, os, time
_step, _marker = os.environ["TLT_TEST_HOLD_SAVE"].split(":", 1)
_open = builtins.open


def open(file, mode="r", *args, **kwargs):
    path = str(file)
    if ("w" in str(mode) and path.endswith("latest_checkpointed_iteration.txt") and not os.path.exists(_marker)
            and os.path.isdir(os.path.join(os.path.dirname(path), "global_step_" + _step))):
        _open(_marker, "w").close()        # once: the resumed run saves the step through
        time.sleep(60)
    return _open(file, mode, *args, **kwargs)


builtins.open = open
'''


def test_a_run_killed_in_the_middle_of_a_checkpoint_save_resumes_with_nothing_lost(assets, tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HOLD)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("TLT_TEST_HOLD_SAVE", f"2:{tmp_path / 'held'}")
    monkeypatch.setenv("TLT_HOME", str(Path(assets["root"]).parent))
    # What is checked does not depend on the drafter's quality: no warm drafter to wait for.
    rec = reliability.trial("driver", tmp_path / "trial", 2, ("saving", (2, "verl")), random.Random(0),
                            (*reliability.SHORT, "+tlt.drafter.init=scratch"))
    assert (tmp_path / "held").exists() and rec["killed"], rec
    # The kill landed in step 2's save, after its drafters and verl's actor files were written and
    # before verl marked it saved: the resume had a newer checkpoint on disk than the step it resumed.
    assert rec["phase"].startswith("saving step 2"), rec
    assert rec["saved_step"] == 1 and rec["checkpoint_problems"] == [], rec
    assert rec["resumed_from"] == 1 and rec["bandit_resumed"] and rec["drafter_at_saved_version_or_later"], rec
    assert rec["finished"] and rec["lost_checkpoints"] == [] and rec["resumed"], rec
    # Step 2 was saved again, whole, by the resumed run.
    run_dir = tmp_path / "trial" / "run"
    assert reliability.saved_step(run_dir) == 2 and reliability.check_step(run_dir, 2)["problems"] == []
