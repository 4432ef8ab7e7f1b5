"""Asynchronous checkpoints on the device: the copy to pinned host memory on a stream of its own, the
optimizer's next step waiting for it on the device (not the host), and what is written.

A step, a synchronous save, an asynchronous save of the same state, then two more steps at once (the
first one's optimizer step must wait, on the device, for the copy): the two checkpoints must hold the
same bytes. The saving steps' times, synchronous against asynchronous, against a step without a save.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch

from .common import build, llama_config, release, row, synchronize
from .common import device as this_device


def async_save(*, quick: bool) -> list[dict]:
    from safetensors.torch import load_file

    import qn_hf
    from qn_hf.checkpoint import checkpoint_dir

    device = this_device()
    config = llama_config(big=False, seq=128)
    if not quick and device.type == "cuda":  # ~170M parameters: a 2 GiB checkpoint with AdamW's state
        config.update(dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                           num_key_value_heads=8, vocab_size=32000))
    pm = qn_hf.parallelize(build(config, device))
    opt = qn_hf.optimizer(pm, torch.optim.AdamW, lr=1e-4)
    ids = torch.randint(3, config.vocab_size, (2, 128), generator=torch.Generator().manual_seed(0)).to(device)
    batch = {"input_ids": ids, "labels": ids}

    def step() -> float:
        synchronize(device)
        start = time.perf_counter()
        opt.zero_grad()
        pm.train_step(batch)
        opt.step()
        synchronize(device)
        return time.perf_counter() - start

    rows = []
    with tempfile.TemporaryDirectory(prefix="qn-hf-gpu-check-") as root:
        plain = statistics.median([step() for _ in range(4)][1:])
        start = time.perf_counter()
        pm.save_checkpoint(os.path.join(root, "sync"), optimizer=opt, step=1, keep_last=1)
        sync_s = time.perf_counter() - start
        synchronize(device)
        start = time.perf_counter()
        pm.save_checkpoint(os.path.join(root, "async"), optimizer=opt, step=1, keep_last=1, asynchronous=True)
        async_s = time.perf_counter() - start
        after = [step(), step()]  # the first waits (on the device) for the copy before its update
        pm.wait_checkpoint()
        a, b = checkpoint_dir(os.path.join(root, "sync")), checkpoint_dir(os.path.join(root, "async"))
        files = sorted(f for f in os.listdir(a) if f.endswith(".safetensors"))
        differ = [f"{f}:{k}" for f in files for x, y in [(load_file(os.path.join(a, f)), load_file(os.path.join(b, f)))]
                  for k in x if not torch.equal(x[k], y[k])]
        size = sum(os.path.getsize(os.path.join(a, f)) for f in files)
    pm.close()
    release(device)
    rows.append(row("checkpoint", "async save holds the state it was called with", "equal" if not differ else "different",
                    f"{len(files)} file(s), {size / 2**20:.0f} MiB" if not differ else f"differ: {differ[:3]}"))
    rows.append(row("checkpoint", "a save's cost to training", "measured",
                    f"step {plain * 1e3:.0f} ms; synchronous save {sync_s * 1e3:.0f} ms; asynchronous {async_s * 1e3:.0f} ms "
                    f"then steps of {after[0] * 1e3:.0f} and {after[1] * 1e3:.0f} ms",
                    step_s=plain, sync_save_s=sync_s, async_save_s=async_s, steps_after_s=after, checkpoint_bytes=size))
    return rows
