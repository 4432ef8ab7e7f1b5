"""One job per directory (issue 46, item 9): a second job saving under a checkpoint root another job
holds is refused on every one of its ranks, naming the holder, before anything of the first job's is
touched; a killed holder leaves no lock behind. ``hold_directory`` between plain processes too."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qn_hf.checkpoint.lock import LOCK_FILE, DirectoryInUse, hold_directory, read_holder
from tests.cases import mesh_for
from tests.models import load

ROOT = Path(__file__).resolve().parent.parent
LOCK_MODULE = ROOT / "qn_hf" / "checkpoint" / "lock.py"
# A process that holds a directory until killed: lock.py alone (standard library only), so it starts at once.
HOLDER = ("import importlib.util, sys, time\n"
          "spec = importlib.util.spec_from_file_location('lock', sys.argv[1])\n"
          "lock = sys.modules['lock'] = importlib.util.module_from_spec(spec)\n"
          "spec.loader.exec_module(lock)\n"
          "held = lock.hold_directory(sys.argv[2], purpose='job A')\n"
          "print('held', flush=True)\n"
          "time.sleep(600)\n")
# A one-process qn_hf job that saves a checkpoint under a root for each step it reads on stdin.
SAVING_JOB = ("import json, sys, qn_hf\nfrom tests.models import load\n"
              "pm = qn_hf.parallelize(load('gpt2', sys.argv[1])); print(json.dumps({'ready': True}), flush=True)\n"
              "for line in sys.stdin:\n"
              "    try:\n"
              "        saved = pm.save_checkpoint(sys.argv[2], step=int(line), keep_last=1)\n"
              "        print(json.dumps({'saved': saved}), flush=True)\n"
              "    except ValueError as e:\n"
              "        print(json.dumps({'refused': str(e)}), flush=True)\n")


def _reply(job: subprocess.Popen) -> dict:
    """The job's next JSON line (anything else it prints is skipped)."""
    while line := job.stdout.readline():
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(f"the job ended (exit status {job.wait()}) without replying")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return {**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def test_a_second_process_is_refused_and_a_killed_holder_leaves_no_lock(tmp_path):
    directory = str(tmp_path / "out")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(LOCK_MODULE), directory], stdout=subprocess.PIPE,
                              text=True, env=_env())
    try:
        assert holder.stdout.readline().strip() == "held"
        began = time.perf_counter()
        with pytest.raises(DirectoryInUse) as refused:
            hold_directory(directory, purpose="job B")
        assert time.perf_counter() - began < 2
        message = str(refused.value)
        assert isinstance(refused.value, ValueError)
        assert f"process {holder.pid} on host {socket.gethostname()} holds it for job A since" in message, message
        assert str(LOCK_MODULE) in message and "Use another directory" in message, message
        assert refused.value.holder.pid == holder.pid
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with hold_directory(directory, purpose="job B") as held:  # the kernel dropped the killed holder's lock
        assert held.held and read_holder(directory).pid == os.getpid()
        with pytest.raises(DirectoryInUse, match="this process itself"):  # a second holder in one process
            hold_directory(directory, purpose="job C")
    assert read_holder(directory) is None and not held.held  # released: the record is emptied


TRY = ("import importlib.util, sys\n"
       "spec = importlib.util.spec_from_file_location('lock', sys.argv[1])\n"
       "lock = sys.modules['lock'] = importlib.util.module_from_spec(spec)\n"
       "spec.loader.exec_module(lock)\n"
       "try:\n"
       "    lock.hold_directory(sys.argv[2], purpose='job C').release(); print('held')\n"
       "except lock.DirectoryInUse:\n"
       "    print('refused')\n")


def _another_process_tries(directory: str) -> str:
    return subprocess.run([sys.executable, "-c", TRY, str(LOCK_MODULE), directory], capture_output=True, text=True,
                          env=_env(), timeout=60, check=False).stdout.strip()


def test_forked_children_neither_drop_nor_keep_their_parents_lock(tmp_path):
    directory = str(tmp_path / "out")
    held = hold_directory(directory, purpose="job A")
    child = os.fork()
    if child == 0:  # a data loader worker, say: its copy of the handle goes when it ends
        held.release()
        os._exit(0)
    os.waitpid(child, 0)
    assert _another_process_tries(directory) == "refused"  # the child's release left the parent's lock alone
    sleeper = os.fork()
    if sleeper == 0:
        time.sleep(60)
        os._exit(0)
    try:
        held.release()  # while a child holding a copy of the descriptor lives
        assert _another_process_tries(directory) == "held"
    finally:
        os.kill(sleeper, signal.SIGKILL)
        os.waitpid(sleeper, 0)


def test_a_lock_file_that_is_a_link_is_refused(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("not yours")
    (tmp_path / "out").mkdir()
    os.symlink(victim, tmp_path / "out" / LOCK_FILE)
    with pytest.raises(DirectoryInUse, match="is a symbolic link"):
        hold_directory(str(tmp_path / "out"), purpose="a job")
    assert victim.read_text() == "not yours"


def case_save_under_a_held_root(*, model_dir: str, root: str, step: int) -> dict:
    """This job (2 ranks) saves under ``root``: what each rank raised, and what the root then holds."""
    import torch.distributed as dist

    import qn_hf

    pm = qn_hf.parallelize(load("gpt2", model_dir), tp=2, mesh=mesh_for(1, 2))
    began = time.perf_counter()
    try:
        outcome = {"saved": os.path.basename(pm.save_checkpoint(root, step=step, keep_last=1))}
    except ValueError as e:
        outcome = {"type": type(e).__name__, "message": str(e)}
    outcome["seconds"] = time.perf_counter() - began
    dist.barrier()
    outcome["listing"] = sorted(os.listdir(root))
    outcome["latest"] = json.loads(Path(root, "latest").read_text())
    outcome["holder"] = read_holder(root).pid
    outcome["rank 0 pid"] = [None] * dist.get_world_size()
    dist.all_gather_object(outcome["rank 0 pid"], os.getpid())
    return outcome


def test_a_second_job_on_a_checkpoint_root_is_refused_on_every_rank(worlds, model_dirs, tmp_path):
    root = str(tmp_path / "ckpt")
    job = subprocess.Popen([sys.executable, "-c", SAVING_JOB, model_dirs["gpt2"], root], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True, env=_env())
    try:
        assert _reply(job) == {"ready": True}
        job.stdin.write("1\n")
        job.stdin.flush()
        assert _reply(job)["saved"].endswith("ckpt-000001")

        refused = worlds.run(2, case_save_under_a_held_root, model_dir=model_dirs["gpt2"], root=root, step=7)
        for rank in refused:  # the same clear refusal on both ranks, at once, naming the holder and the fix
            assert rank["type"] == "DirectoryInUse" and rank["seconds"] < 30, rank
            assert rank["message"] == refused[0]["message"]
            assert f"process {job.pid} on host {socket.gethostname()} holds it for saving checkpoints" in \
                rank["message"], rank["message"]
            assert "save this job's checkpoints under another root" in rank["message"]
            # nothing of the holder's was touched: its checkpoint, its latest, no partial of ours
            assert rank["listing"] == [LOCK_FILE, "ckpt-000001", "latest"] and rank["latest"] == "ckpt-000001"
            assert rank["holder"] == job.pid

        job.stdin.write("2\n")  # the holder goes on saving, undisturbed
        job.stdin.flush()
        assert _reply(job)["saved"].endswith("ckpt-000002")
    finally:
        job.kill()  # a job that dies without releasing anything
        job.wait()
    took_over = worlds.run(2, case_save_under_a_held_root, model_dir=model_dirs["gpt2"], root=root, step=7)[0]
    assert took_over["saved"] == "ckpt-000007" and took_over["latest"] == "ckpt-000007"
    assert took_over["holder"] == took_over["rank 0 pid"][0]  # only rank 0 holds it
