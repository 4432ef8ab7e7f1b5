"""Asynchronous checkpoints on the device: the copy to pinned host memory on a stream of its own, the
optimizer's next step waiting for it on the device (not the host), and what is written.

A step, a synchronous save, an asynchronous save of the same state, then two more steps at once (the
first one's optimizer step must wait, on the device, for the copy): the two checkpoints must hold the
same bytes. The saving steps' times, synchronous against asynchronous, against a step without a save.
Then the same without ``optimizer=`` (the training stream waits for the copy at the save itself, so a
step at once cannot tear it), and what the saves kept: one copy stream (priority -2) for every save,
one host arena of the shards' bytes, page-locked (its size and torch's pinned allocator's reported).
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
        first_stream = pm.checkpoint_view.saves.copies.copy_stream
        after = [step(), step()]  # the first waits (on the device) for the copy before its update
        pm.wait_checkpoint()
        a, b = checkpoint_dir(os.path.join(root, "sync")), checkpoint_dir(os.path.join(root, "async"))
        files = sorted(f for f in os.listdir(a) if f.endswith(".safetensors"))
        differ = _differ(a, b)
        size = sum(os.path.getsize(os.path.join(a, f)) for f in files)
        torn = _weights_only(pm, step, root)
        kept = _what_saves_keep(pm, device, first_stream)
    pm.close()
    release(device)
    rows.append(row("checkpoint", "async save holds the state it was called with", "equal" if not differ else "different",
                    f"{len(files)} file(s), {size / 2**20:.0f} MiB" if not differ else f"differ: {differ[:3]}"))
    rows.append(row("checkpoint", "a save's cost to training", "measured",
                    f"step {plain * 1e3:.0f} ms; synchronous save {sync_s * 1e3:.0f} ms; asynchronous {async_s * 1e3:.0f} ms "
                    f"then steps of {after[0] * 1e3:.0f} and {after[1] * 1e3:.0f} ms",
                    step_s=plain, sync_save_s=sync_s, async_save_s=async_s, steps_after_s=after, checkpoint_bytes=size))
    rows.append(row("checkpoint", "async save without optimizer=, a step at once", "equal" if not torn else "different",
                    "the file holds the weights of the save" if not torn else f"differ: {torn[:3]}"))
    rows.append(row("checkpoint", "what asynchronous saves keep", "ok" if kept["ok"] else "failed", kept["detail"],
                    **{k: v for k, v in kept.items() if k not in ("ok", "detail")}))
    return rows


def _differ(a: str, b: str) -> list[str]:
    from safetensors.torch import load_file

    files = sorted(f for f in os.listdir(a) if f.endswith(".safetensors"))
    return [f"{f}:{k}" for f in files for x, y in [(load_file(os.path.join(a, f)), load_file(os.path.join(b, f)))]
            for k in x if not torch.equal(x[k], y[k])]


def _weights_only(pm, step, root: str) -> list[str]:
    """A synchronous and an asynchronous save of the weights alone, then a step at once: the tensors that differ."""
    from qn_hf.checkpoint import checkpoint_dir

    pm.save_checkpoint(os.path.join(root, "sync-weights"), step=2, keep_last=1)
    pm.save_checkpoint(os.path.join(root, "async-weights"), step=2, keep_last=1, asynchronous=True)
    step()  # no hook holds it: only the stream wait taken at the save orders its update after the copy
    pm.wait_checkpoint()
    return _differ(checkpoint_dir(os.path.join(root, "sync-weights")),
                   checkpoint_dir(os.path.join(root, "async-weights")))


def _what_saves_keep(pm, device: torch.device, first_stream) -> dict:
    """After two asynchronous saves: the first's copy stream for both (priority -2), the arena given back by
    wait_checkpoint(release=True); the arena's size and torch's pinned allocator's bytes reported."""
    copies = pm.checkpoint_view.saves.copies
    if device.type != "cuda":
        return {"ok": True, "detail": f"no CUDA: host copies, arena {copies.host_bytes / 2**20:.2f} MiB (plain memory)"}
    stream = copies.copy_stream
    arena = copies.host_bytes
    stats = getattr(torch.cuda.memory, "host_memory_stats", None)
    pinned = stats().get("allocated_bytes.current", None) if stats is not None else None
    priority = stream.priority if stream is not None else None
    pm.wait_checkpoint(release=True)
    # Off the default-priority pool NCCL's communicators draw from, and the same stream for every save
    ok = stream is not None and stream is first_stream and priority < 0 and copies.host_bytes == 0
    return {"ok": ok, "detail": f"{'one copy stream' if stream is first_stream else 'a new copy stream per save'} "
                                f"(priority {priority}); arena "
                                f"{arena / 2**20:.1f} MiB page-locked, released to {copies.host_bytes}; torch's pinned "
                                f"allocator holds {'?' if pinned is None else f'{pinned / 2**20:.1f} MiB'}",
            "arena_bytes": arena, "pinned_allocator_bytes": pinned, "stream_priority": priority}
