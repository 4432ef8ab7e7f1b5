"""Run under torchrun with 2 processes (pp=2): rank 1 raises inside ``train_step`` or inside
``save_checkpoint`` (argv[1]); every rank prints one JSON line saying what it raised and after how
long. One case per launch: after a timeout, gloo closes the pairs involved, and the job is over.
``train_step_then_linger``: rank 1 stays alive after raising, so rank 0 waits for the timeout (a
closed connection would release it at once), as a rank blocked under NCCL does. ``user_code_then_barrier``:
after a step, rank 1 fails in code of its own and waits in a barrier; rank 0 is in the next step."""

from __future__ import annotations

import datetime
import json
import sys
import time

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel

import qn_hf
import qn_hf.checkpoint.save

TIMEOUT_S = 4


def attempt(name: str, fn) -> None:
    start = time.perf_counter()
    try:
        fn()
        outcome = {"type": None, "message": ""}
    except Exception as e:  # noqa: BLE001 - reporting whatever each rank saw is the point
        outcome = {"type": type(e).__name__, "message": str(e)}
    print(json.dumps({"case": name, "rank": dist.get_rank(), "seconds": time.perf_counter() - start, **outcome}), flush=True)


def main() -> None:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=16, vocab_size=64))
    pm = qn_hf.parallelize(model, pp=2, microbatches=2, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}

    def broken_loss(outputs, mb):
        raise ValueError("boom on the last stage")

    if sys.argv[1] == "user_code_then_barrier":
        pm.train_step(batch)
        time.sleep(1.5)  # the watchers write where each rank is once a second
        if dist.get_rank() == 1:  # fails in the user's own code, catches it, and waits in a barrier of its own
            try:
                raise RuntimeError("the user's data went wrong")
            except RuntimeError:
                attempt("barrier", dist.barrier)
            return
        attempt("train_step", lambda: pm.train_step(batch))
        return
    if sys.argv[1] in ("train_step", "train_step_then_linger"):
        attempt("train_step", lambda: pm.train_step(batch, loss_fn=broken_loss))
        if sys.argv[1] == "train_step_then_linger" and dist.get_rank() == 1:
            time.sleep(3 * TIMEOUT_S)  # alive, so rank 0 is not released by a closed connection
        return

    real_write = qn_hf.checkpoint.save.write_shard

    def write_or_fail(*args, **kwargs):
        if dist.get_rank() == 1:
            raise OSError("disk full on rank 1")
        return real_write(*args, **kwargs)

    qn_hf.checkpoint.save.write_shard = write_or_fail
    attempt("save_checkpoint", lambda: pm.save_checkpoint(sys.argv[2], step=1))


if __name__ == "__main__":
    main()
