"""Jobs that survive: scripts/train_lm.py under torchrun's elastic agent, killed by signal as a
node failure or a scheduler would kill it, restarted by ``--max-restarts`` with the command that
started it, and relaunched at another world size. Each continues from its newest complete
checkpoint and ends where an uninterrupted run ends: the same weights bit for bit at the same
mesh, losses within 1e-5 relative at another one.

A shared uninterrupted run (A: 4 processes, mesh 2 1 2, 12 steps, a checkpoint every 3) is the
reference. The runs take about 20 s each here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.test_scripts import ROOT, kill_tree, metrics

ARGS = ["--model", "tiny-llama", "--mesh", "2", "1", "2", "--steps", "12", "--save-every", "3", "--no-progress"]


def torchrun(run_dir: Path, *, nproc: int = 4, restarts: int = 0, extra: tuple[str, ...] = (),
             script: str = "scripts/train_lm.py") -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "--max-restarts", str(restarts), "--monitor-interval", "0.1", str(ROOT / script), *ARGS, *extra,
           "--output-dir", str(run_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "QN_HF_TEST_WRITE_DELAY_S": "3"}
    log = open(str(run_dir) + ".log", "a")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def finish(job: subprocess.Popen, run_dir: Path, *, timeout: float = 300) -> str:
    try:
        job.wait(timeout=timeout)
    finally:
        if job.poll() is None:
            kill_tree(job.pid)
    out = Path(str(run_dir) + ".log").read_text()
    assert job.returncode == 0, out[-6000:]
    return out


def workers(agent: int) -> dict[int, int]:
    """LOCAL_RANK -> pid of the agent's worker processes (its children running the script)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if parent != agent:
                continue
            environ = (stat.parent / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        env = dict(item.split(b"=", 1) for item in environ if b"=" in item)
        if b"LOCAL_RANK" in env:
            found[int(env[b"LOCAL_RANK"])] = int(stat.parent.name)
    return found


def wait_until(condition, *, job: subprocess.Popen, timeout: float = 240, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert job.poll() is None, f"the job ended before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def logged_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    try:
        return json.loads(lines[-1])["step"] if lines else 0
    except json.JSONDecodeError:  # a line being written
        return 0


def kill_worker(job: subprocess.Popen, local_rank: int = 1) -> int:
    pid = workers(job.pid)[local_rank]
    os.kill(pid, signal.SIGKILL)
    return pid


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The exported model's tensors (one file per stage at pp > 1)."""
    weights: dict[str, torch.Tensor] = {}
    for file in sorted((run_dir / "model").glob("*.safetensors")):
        weights.update(load_file(str(file)))
    assert weights, f"no weights exported in {run_dir / 'model'}"
    return weights


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("elastic") / "uninterrupted"
    finish(torchrun(run), run)
    return run


def test_a_killed_worker_is_restarted_and_the_run_ends_as_if_uninterrupted(uninterrupted, tmp_path):
    """Done-when 1: torchrun --max-restarts 1, one worker SIGKILLed around step 7: the agent restarts the
    group, the same command resumes from step 6's checkpoint, and the final weights equal A's bit for bit."""
    run = tmp_path / "restarted"
    job = torchrun(run, restarts=1)
    wait_until(lambda: logged_step(run) >= 7, job=job, what="step 7")
    kill_worker(job)
    out = finish(job, run)
    assert "resumed from" in out and " at step 6" in out, out[-4000:]
    same_bits(final_weights(run), final_weights(uninterrupted))
    assert [r["loss"] for r in metrics(run)] == [r["loss"] for r in metrics(uninterrupted)]
    again = finish(torchrun(run, nproc=2), run)  # the same command once more: nothing is left, and it says so
    assert "at step 12 (nothing left to train; --no-resume starts over)" in again, again[-3000:]
    assert json.loads((run / "summary.json").read_text())["steps"] == 12
    assert [r["loss"] for r in metrics(run)] == [r["loss"] for r in metrics(uninterrupted)]


@pytest.mark.long  # the suite's time (issue 65): resharding on resume is proven by test_checkpoint
def test_a_run_stopped_at_4_processes_continues_at_2_with_a_mesh_of_its_own(uninterrupted, tmp_path):
    """Done-when 2: stopped after step 6 at 4 processes (the launcher and every rank SIGKILLed), relaunched
    with --nproc-per-node 2 and nothing else changed: --mesh 2 1 2 needs 4, so the planner chooses a mesh
    for 2, the checkpoint reshards, and steps 7-12 give A's losses within 1e-5 relative."""
    run = tmp_path / "moved"
    job = torchrun(run)
    wait_until(lambda: logged_step(run) >= 7, job=job, what="step 7")
    kill_tree(job.pid)
    job.wait()
    out = finish(torchrun(run, nproc=2), run)
    assert "resumed from" in out and " at step 6" in out, out[-4000:]
    moved = [line for line in out.splitlines() if "resumed at 2 processes from a checkpoint of 4 processes" in line]
    assert len(moved) == 1 and "--mesh 2 1 2 needs 4 processes" in moved[0] and "(chosen by the planner)" in moved[0], out[-4000:]
    full, continued = metrics(uninterrupted), metrics(run)
    assert [r["step"] for r in continued] == list(range(1, 13))
    for x, y in zip(full, continued):
        if x["step"] <= 6:
            assert x["loss"] == y["loss"], (x, y)  # the 4-process steps, kept in the log
        else:
            assert abs(x["loss"] - y["loss"]) <= 1e-5 * abs(x["loss"]), (x, y)
    assert json.loads((run / "summary.json").read_text())["world_size"] == 2


@pytest.mark.long  # the suite's time (issue 65): test_checkpoint_async and test_checkpoint_faults prove the writes
def test_a_kill_during_a_background_write_loses_nothing(uninterrupted, tmp_path):
    """Done-when 3's second half: --async-save, each shard's write delayed 3 s (tests/slow_writes.py), a
    worker SIGKILLed while step 6's checkpoint is being written: it was never published, so the
    restart resumes from step 3's and the run still ends on A's weights bit for bit. The save itself
    held training for less than the write takes (the step went on while it was written)."""
    run = tmp_path / "async"
    job = torchrun(run, restarts=1, extra=("--async-save",), script="tests/slow_writes.py")
    partial = run / "checkpoints" / "ckpt-000006.partial"
    wait_until(lambda: partial.is_dir(), job=job, what="step 6's checkpoint to be written")
    kill_worker(job)
    out = finish(job, run)
    assert "resumed from" in out and " at step 3" in out, out[-4000:]
    same_bits(final_weights(run), final_weights(uninterrupted))
    saves = [r["checkpoint_s"] for r in metrics(run) if "checkpoint_s" in r]
    assert len(saves) == 4 and max(saves) < 3.0, saves  # steps 3, 6, 9, 12; 6 and 9 waited for nothing
    names = os.listdir(run / "checkpoints")  # the killed attempt's step-6 .partial was redone, then published
    assert not [n for n in names if n.endswith(".partial")], names
    assert json.loads((run / "checkpoints" / "latest").read_text()) == "ckpt-000012"


@pytest.mark.long
def test_a_second_failure_during_recovery_is_survived(uninterrupted, tmp_path):
    """A worker killed around step 7, then one of the restarted workers killed while the job recovers
    (starting, joining the group, loading): --max-restarts 2 restarts it again, and it still ends on
    A's weights bit for bit."""
    run = tmp_path / "twice"
    job = torchrun(run, restarts=2)
    wait_until(lambda: logged_step(run) >= 7, job=job, what="step 7")
    first = set(workers(job.pid).values())
    kill_worker(job)
    wait_until(lambda: len(workers(job.pid)) == 4 and not first & set(workers(job.pid).values()), job=job,
               what="the restarted workers")
    time.sleep(1.0)  # inside the restarted job's start: imports, the rendezvous, the checkpoint's load
    kill_worker(job, local_rank=2)
    out = finish(job, run)
    assert out.count("exitcode: -9") == 2, out[-4000:]
    same_bits(final_weights(run), final_weights(uninterrupted))
