"""Soak: a long run at (2, 2, 2) killed with SIGKILL in the middle and resumed must end exactly
where the same run without the kill ends (every step's loss and every final weight, bit for bit).

    python scripts/soak.py                       # 500 steps, checkpoints every 50, kill after step 275
    python scripts/soak.py --steps 24 --save-every 6 --kill-after 14 --mesh 2 1 2   # the CI-sized test

The kill lands wherever the run is at that moment (a step, an evaluation or a checkpoint write);
the resumed run continues from the last complete checkpoint. Uses scripts/train_lm.py (tiny GPT-2
preset, byte-level Python reference manual), so it also soaks the data, schedule and I/O code.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def launch(args: argparse.Namespace, out: Path, *extra: str) -> subprocess.Popen:
    nproc = args.mesh[0] * args.mesh[1] * args.mesh[2]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(ROOT / "scripts" / "train_lm.py"), "--model", "tiny-gpt2", "--mesh", *map(str, args.mesh),
           "--microbatches", "2", "--batch-size", "8", "--seq-len", "32", "--steps", str(args.steps),
           "--save-every", str(args.save_every), "--eval-every", "100", "--eval-batches", "2", "--no-progress",
           "--timeline-step", "0", "--output-dir", str(out), *extra]
    log = open(out.with_suffix(".log"), "a")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def kill_tree(pid: int) -> None:
    """SIGKILL a launcher and all its descendants at once, as a scheduler killing the job would.
    (torchrun starts each rank in its own session, so killing its process group is not enough.)"""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    victims, todo = [], [pid]
    while todo:
        p = todo.pop()
        victims.append(p)
        todo += parents.get(p, [])
    for p in victims:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def last_step(out: Path) -> int:
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
        return json.loads(lines[-1])["step"] if lines else 0
    except (OSError, ValueError, KeyError):
        return 0


def weights(out: Path) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted((out / "model").glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--kill-after", type=int, default=275, help="SIGKILL the job once this step is logged")
    parser.add_argument("--mesh", type=int, nargs=3, default=[2, 2, 2])
    parser.add_argument("--out", default=str(ROOT / "runs" / "soak"))
    args = parser.parse_args()
    root = Path(args.out)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    a, b = root / "uninterrupted", root / "killed"

    start = time.perf_counter()
    if launch(args, a).wait() != 0:
        sys.exit(f"the uninterrupted run failed; see {a}.log")
    a_time = time.perf_counter() - start

    job = launch(args, b)
    while last_step(b) < args.kill_after and job.poll() is None:
        time.sleep(0.05)
    kill_tree(job.pid)  # torchrun and every rank, wherever they are
    job.wait()
    killed_at = last_step(b)
    checkpoint = json.loads((b / "checkpoints" / "latest").read_text())
    if launch(args, b, "--resume").wait() != 0:
        sys.exit(f"the resumed run failed; see {b}.log")

    la, lb = [json.loads(x) for x in (a / "metrics.jsonl").read_text().splitlines()], \
             [json.loads(x) for x in (b / "metrics.jsonl").read_text().splitlines()]
    same_losses = [r["loss"] for r in la] == [r["loss"] for r in lb] and len(la) == args.steps
    wa, wb = weights(a), weights(b)
    same_weights = wa.keys() == wb.keys() and all(wa[k].equal(wb[k]) for k in wa)
    result = {"steps": args.steps, "mesh": args.mesh, "killed_after_step": killed_at, "resumed_from": checkpoint,
              "same_losses": same_losses, "same_weights": same_weights, "tensors": len(wa),
              "uninterrupted_s": round(a_time, 1), "total_s": round(time.perf_counter() - start, 1)}
    print(json.dumps(result))
    if not (same_losses and same_weights):
        sys.exit("the killed and resumed run differs from the uninterrupted one")


if __name__ == "__main__":
    main()
