"""A rank that raises does not leave the others waiting: they stop within the timeout and name it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("case, origin", [
    ("train_step", "rank 1 failed in train_step: ValueError: boom on the last stage"),
    ("save_checkpoint", "rank 1 failed in save_checkpoint: OSError: disk full on rank 1"),
])
def test_one_rank_raises_the_other_stops_within_the_timeout(tmp_path, case, origin):
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(ROOT / "tests" / "fail_together_job.py"), case, str(tmp_path / "ckpt")],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120,
    )
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    by_rank = {r["rank"]: r for r in lines}
    assert set(by_rank) == {0, 1}, done.stdout + done.stderr[-3000:]
    failing, waiting = by_rank[1], by_rank[0]
    assert origin.endswith(failing["message"]) and failing["type"] in ("ValueError", "OSError")
    assert waiting["type"] == "PeerFailure"
    assert waiting["message"] == f"rank 0 stopped in {case}: {origin}"
    assert waiting["seconds"] < 4 + 10  # the 4 s timeout, not torch's default 30 minutes
    if case == "save_checkpoint":
        assert not (tmp_path / "ckpt" / "latest").exists()  # nothing half-written was published


def test_a_rank_left_waiting_names_the_failure_while_it_waits(tmp_path):
    """The failing rank stays alive, so the other waits for the whole timeout: the watcher prints the
    recorded failure on its stderr during that wait (under NCCL, where the watchdog ends a blocked
    process instead of raising, this line is how the waiting ranks name the cause)."""
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(ROOT / "tests" / "fail_together_job.py"), "train_step_then_linger", str(tmp_path / "ckpt")],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120,
    )
    by_rank = {r["rank"]: r for r in (json.loads(line) for line in done.stdout.splitlines() if line.startswith("{"))}
    assert by_rank[0]["type"] == "PeerFailure" and by_rank[0]["seconds"] >= 3, done.stdout + done.stderr[-3000:]
    origin = "rank 1 failed in train_step: ValueError: boom on the last stage"
    assert f"qn_hf: rank 0 is waiting on a rank that failed: {origin}." in done.stderr, done.stderr[-3000:]
    assert "qn_hf: rank 1 is waiting" not in done.stderr  # the failing rank does not report itself


def test_a_rank_failing_outside_qn_hf_is_named_by_the_others(tmp_path):
    """Issue 66: rank 1 fails in the user's own code and waits in a barrier of its own; rank 0, in the next
    train_step, timed out with gloo's raw message naming no cause. It now names rank 1, last seen in the step
    before, as the one it waited for."""
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(ROOT / "tests" / "fail_together_job.py"), "user_code_then_barrier", str(tmp_path / "ckpt")],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120,
    )
    by_rank = {r["rank"]: r for r in (json.loads(line) for line in done.stdout.splitlines() if line.startswith("{"))}
    waiting = by_rank[0]
    assert waiting["case"] == "train_step" and waiting["type"] == "PeerFailure", done.stdout + done.stderr[-3000:]
    assert "no rank recorded a failure in qn_hf, and rank 1 was last seen in train_step (qn_hf's operation 1; " \
           "this is 2): such a rank failed or waits outside qn_hf" in waiting["message"], waiting
    assert waiting["seconds"] < 4 + 10
