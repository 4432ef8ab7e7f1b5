"""How long a checkpoint holds training: ``save_checkpoint`` synchronous against ``asynchronous=True``.

    python benchmarks/async_save.py [--setups 1x1 1x2 2x1] [--steps 12] [--save-every 4] [--rounds 2] [--json FILE]

A Llama whose save (weights and AdamW state; ZeRO-1 over dp=2 at 2 ranks, so both write) takes
longer than a training step trains on gloo ranks; every ``--save-every`` steps it saves. A setup
RxT is R ranks of T intra-op threads each: 1x1 on this 2-core VM leaves the writer thread a core of
its own (as on a GPU machine, whose host cores wait while the device computes); 1x2 and 2x1 keep
every core busy training, so the writer's work (copy, serialization, checksum) comes out of it. Each step's
time is measured with the save call included (a barrier before each step, rank 0's clock). Three
runs alternate within each round: no saves, synchronous saves, asynchronous saves. Reported: the
median step without a save; a saving step's time and its ratio to that; the step after a save (the
writer thread shares the cores with training); and how long the background write took (from the
save call until ``wait_checkpoint`` returns).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from world import run_world  # noqa: E402

import qn_hf  # noqa: E402
from qn_hf.checkpoint import checkpoint_dir  # noqa: E402

CONFIG = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
              num_key_value_heads=8, vocab_size=8000, max_position_embeddings=128)
ROWS, SEQ = 4, 32  # per step, over dp=2: a short step beside a save of the whole state


def body(rank: int, world: int, mode: str, steps: int, save_every: int, root: str, threads: int) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **CONFIG))
    pm = qn_hf.parallelize(model, dp=world)
    opt = qn_hf.optimizer(pm, torch.optim.AdamW, zero=world > 1, lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CONFIG["vocab_size"], (ROWS, SEQ), generator=gen)
    batch = {"input_ids": ids, "labels": ids}
    local = pm.local_batch(batch)
    times, saves, writes = [], [], []
    pending = None
    for step in range(steps + 1):  # step 0: warm-up, not timed
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad()
        pm.train_step(local)
        opt.step()
        saving = mode != "none" and step > 0 and step % save_every == 0
        if saving:
            if pending is not None:  # the previous write's duration, if it is still going this waits
                pm.wait_checkpoint()
                writes.append(time.perf_counter() - pending)
            pending = time.perf_counter()
            pm.save_checkpoint(os.path.join(root, mode), optimizer=opt, step=step, keep_last=2,
                               asynchronous=mode == "async")
            if mode == "sync":
                writes.append(time.perf_counter() - pending)
                pending = None
        if step > 0:
            times.append(time.perf_counter() - start)
            saves.append(saving)
    if pending is not None:
        pm.wait_checkpoint()
        writes.append(time.perf_counter() - pending)
    newest = checkpoint_dir(os.path.join(root, mode)) if mode != "none" else None
    size = sum(os.path.getsize(os.path.join(newest, f)) for f in os.listdir(newest)
               if f.endswith(".safetensors")) if newest is not None else 0
    pm.close()
    return {"times": times, "saves": saves, "writes": writes, "bytes": size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setups", nargs="+", default=["1x1", "1x2", "2x1"], help="RANKSxTHREADS each")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    out = {"config": CONFIG, "rows": ROWS, "seq": SEQ, "torch": torch.__version__, "setups": {}}
    for setup in args.setups:
        world, threads = map(int, setup.split("x"))
        runs: dict[str, list[dict]] = {"none": [], "sync": [], "async": []}
        with tempfile.TemporaryDirectory(prefix="async-save-") as root:
            for _ in range(args.rounds):
                for mode in runs:
                    runs[mode].append(run_world(body, world=world,
                                                extra=(mode, args.steps, args.save_every, root, threads)))
        plain = statistics.median(t for r in runs["none"] for t in r["times"])
        result = out["setups"][setup] = {"plain_step_s": plain}
        print(f"{world} rank(s) x {threads} thread(s): a step without a save {plain * 1e3:.0f} ms (median of {args.rounds} x {args.steps})")
        for mode in ("sync", "async"):
            saving = [t for r in runs[mode] for t, s in zip(r["times"], r["saves"]) if s]
            after = [r["times"][i + 1] for r in runs[mode] for i, s in enumerate(r["saves"])
                     if s and i + 1 < len(r["times"])]
            writes = [w for r in runs[mode] for w in r["writes"]]
            o = result[mode] = {"saving_step_s": statistics.median(saving), "ratio": statistics.median(saving) / plain,
                                "next_step_s": statistics.median(after) if after else None,
                                "write_s": statistics.median(writes), "checkpoint_bytes": runs[mode][0]["bytes"]}
            nxt = f"; the step after it {o['next_step_s'] * 1e3:.0f} ms (x{o['next_step_s'] / plain:.2f})" if after else ""
            print(f"  {mode:>5}: a saving step {o['saving_step_s'] * 1e3:.0f} ms (x{o['ratio']:.2f} of a step without)"
                  f"{nxt}; the write took {o['write_s'] * 1e3:.0f} ms for a checkpoint of {o['checkpoint_bytes'] / 2**20:.0f} MiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
