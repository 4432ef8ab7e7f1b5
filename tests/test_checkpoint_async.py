"""Asynchronous checkpoints: what a background save writes is the state when it was called, not what
training did while it was writing; one save in flight; a failure on any rank reaches every rank and
leaves the previous checkpoint as ``latest``."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import qn_hf
from qn_hf.checkpoint import CheckpointError, checkpoint_dir, read_index
from qn_hf.local_world import LocalWorld
from tests.cases import mesh_for
from tests.models import dp_slice, load, make_batch
from tests.stream_model import LateStreams


def _run(world: int, case, **kwargs) -> list:
    """``case`` on ``world`` fresh ranks: the writer threads and their gloo groups stay out of the
    suite's shared worlds, whose later memory measurements depend on what those ranks did before."""
    with LocalWorld(world) as ranks:
        return ranks.run(case, **kwargs)


def _model(model_dir: str, *, dp: int, pp: int, zero: bool):
    pm = qn_hf.parallelize(load("llama", model_dir), dp=dp, pp=pp, microbatches=2, mesh=mesh_for(dp, 1, pp))
    opt = (qn_hf.optimizer(pm, torch.optim.AdamW, zero=True, lr=1e-3) if zero
           else torch.optim.AdamW(pm.parameters(), lr=1e-3))
    return pm, opt


def _step(pm, opt, seed: int) -> None:
    opt.zero_grad()
    pm.train_step(dp_slice(make_batch("llama", size=8, seed=seed), dp=pm.dims.dp, dp_rank=pm.coords["dp"]))
    opt.step()


def case_async_equals_sync(*, model_dir: str, root: str, dp: int, pp: int, zero: bool) -> list[str]:
    from qn_hf.checkpoint import host_copies

    pm, opt = _model(model_dir, dp=dp, pp=pp, zero=zero)
    _step(pm, opt, seed=1)
    pm.save_checkpoint(os.path.join(root, "sync"), optimizer=opt, step=1)
    real = host_copies.HostCopies.copy

    def late_copy(self, sources):  # the writer thread starts its copy after the next step began
        time.sleep(1.0)
        return real(self, sources)

    host_copies.HostCopies.copy = late_copy
    try:
        returned = pm.save_checkpoint(os.path.join(root, "async"), optimizer=opt, step=1, asynchronous=True)
        _step(pm, opt, seed=2)  # its optimizer step must wait for the copy: it changes every weight and moment
    finally:
        host_copies.HostCopies.copy = real
    _step(pm, opt, seed=3)
    published = pm.wait_checkpoint()
    assert published == returned and pm.wait_checkpoint() is None
    pm.close()
    return [returned]


@pytest.mark.parametrize("dp,pp,zero", [(2, 2, True), (4, 1, False)])
def test_async_save_writes_the_state_it_was_called_with(model_dirs, tmp_path, dp, pp, zero):
    root = str(tmp_path)
    returned = _run(dp * pp, case_async_equals_sync, model_dir=model_dirs["llama"], root=root, dp=dp, pp=pp,
                          zero=zero)
    assert len(set(map(tuple, returned))) == 1
    sync_dir, async_dir = checkpoint_dir(os.path.join(root, "sync")), checkpoint_dir(os.path.join(root, "async"))
    assert returned[0][0] == async_dir
    sync_index, async_index = read_index(sync_dir), read_index(async_dir)
    assert sync_index["tensors"] == async_index["tensors"] and sync_index["mesh"] == async_index["mesh"]
    files = sorted(n for n in os.listdir(sync_dir) if n.endswith(".safetensors"))
    assert files == sorted(n for n in os.listdir(async_dir) if n.endswith(".safetensors"))
    for name in files:
        a, b = load_file(os.path.join(sync_dir, name)), load_file(os.path.join(async_dir, name))
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), (name, key)


def case_async_failure(*, model_dir: str, root: str) -> dict:
    from qn_hf.checkpoint import save

    pm, opt = _model(model_dir, dp=2, pp=1, zero=True)  # rank 1 writes its half of the optimizer state
    _step(pm, opt, seed=1)
    first = pm.save_checkpoint(root, optimizer=opt, step=1, asynchronous=True)
    second = pm.save_checkpoint(root, optimizer=opt, step=2, asynchronous=True)  # waits for the first
    assert pm.wait_checkpoint() == second
    real = save.ShardSnapshot.write

    def full_disk(self, directory):
        if dist.get_rank() == 1:
            raise OSError(28, "No space left on device")
        return real(self, directory)

    save.ShardSnapshot.write = full_disk
    try:
        pm.save_checkpoint(root, optimizer=opt, step=3, asynchronous=True)
        _step(pm, opt, seed=2)
        try:
            pm.wait_checkpoint()
            error = None
        except CheckpointError as e:
            error = str(e)
    finally:
        save.ShardSnapshot.write = real
    later = pm.save_checkpoint(root, optimizer=opt, step=4, asynchronous=True)  # the model saves again after
    pm.close()
    return {"first": first, "error": error, "later": later}


def test_async_save_failure_reaches_every_rank_and_keeps_latest(model_dirs, tmp_path):
    root = str(tmp_path / "ckpt")
    out = _run(2, case_async_failure, model_dir=model_dirs["llama"], root=root)
    for result in out:
        assert result["error"] is not None and "rank 1" in result["error"] and "No space left" in result["error"]
    assert sorted(n for n in os.listdir(root) if n.startswith("ckpt-")) == [
        "ckpt-000001", "ckpt-000002", "ckpt-000003.partial", "ckpt-000004"]
    assert checkpoint_dir(root) == out[0]["later"]  # close() waited for it
    assert read_index(checkpoint_dir(root))["step"] == 4


def _files(directory: str) -> dict[str, dict[str, torch.Tensor]]:
    return {n: load_file(os.path.join(directory, n)) for n in sorted(os.listdir(directory)) if n.endswith(".safetensors")}


def _launched_only(copies) -> None:
    """``wait_copied`` without its stream wait: the step waits until the copy is launched, not for the copy."""
    copies._copied.wait()


def case_stream_order(*, model_dir: str, root: str) -> dict:
    """Under a model of CUDA's streams that runs each copy as late as its events allow: an asynchronous save
    followed at once by an optimizer step (the save given the optimizer, and not) writes the weights of the save,
    and with the training stream's wait for the copy taken out it writes the step's (the model can fail)."""
    from qn_hf.checkpoint.background import BackgroundSaves
    from qn_hf.checkpoint.host_copies import HostCopies

    pm, opt = _model(model_dir, dp=1, pp=2, zero=False)
    streams = LateStreams(host_delay_s=0.5)  # the writer thread's wait for the device comes late too
    pm.checkpoint_view.saves = BackgroundSaves(timeout=pm.checkpoint_view.saves.timeout, streams=streams)
    real_wait = HostCopies.wait_copied
    out: dict = {"torn": {}}
    seed = 1
    for ordered in (True, False):
        for held in (True, False):
            seed += 1
            opt.zero_grad()
            pm.train_step(dp_slice(make_batch("llama", size=8, seed=seed), dp=1, dp_rank=0))
            name = f"{'ordered' if ordered else 'unordered'}-{'held' if held else 'none'}"
            given = opt if held else None
            pm.save_checkpoint(os.path.join(root, name, "sync"), optimizer=given, step=seed)
            if not ordered:
                HostCopies.wait_copied = _launched_only
            try:
                pm.save_checkpoint(os.path.join(root, name, "async"), optimizer=given, step=seed, asynchronous=True)
                opt.step()  # at once: every weight changes
            finally:
                HostCopies.wait_copied = real_wait
            pm.wait_checkpoint()
    out["arena"] = pm.checkpoint_view.saves.copies.host_bytes
    out["pinned"] = list(streams.pinned)
    out["launched"] = streams.copies_launched
    pm.wait_checkpoint(release=True)
    out["released"] = (pm.checkpoint_view.saves.copies.host_bytes, streams.unpinned)
    pm.close()
    return out


@pytest.mark.core
def test_async_save_orders_the_next_step_after_its_copy(model_dirs, tmp_path):
    root = str(tmp_path)
    out = _run(2, case_stream_order, model_dir=model_dirs["llama"], root=root)
    for name in ("ordered-held", "ordered-none", "unordered-held", "unordered-none"):
        sync = _files(checkpoint_dir(os.path.join(root, name, "sync")))
        written = _files(checkpoint_dir(os.path.join(root, name, "async")))
        assert sync.keys() == written.keys() and len(sync) == 2  # a file per pp stage
        same = all(torch.equal(sync[f][k], written[f][k]) for f in sync for k in sync[f])
        assert same == name.startswith("ordered"), name  # without the stream wait the step's weights are written
    # One arena per rank, its size the shards' bytes (each aligned to 64), pinned again only when the shards
    # change: the first save given the optimizer precedes Adam's first step (no moments yet), so the four saves
    # hold weights, weights, weights and moments, weights; wait_checkpoint(release=True) gives the last back
    written = _files(checkpoint_dir(os.path.join(root, "ordered-none", "async")))
    shards = sorted(sum(-(-t.numel() * t.element_size() // 64) * 64 for t in f.values()) for f in written.values())
    assert sorted(result["arena"] for result in out) == shards
    for result in out:
        weights, pinned = result["arena"], result["pinned"]
        assert result["launched"] == 4 and len(pinned) == 3 and pinned[0] == pinned[2] == weights < pinned[1]
        assert result["released"] == (0, 3)


def test_a_save_that_fails_before_its_writer_holds_no_step():
    """The optimizer's next step is held for a save's copy; a save failing before its writer starts must let
    it go (else the step waits forever for a copy nobody makes)."""
    import datetime
    import threading

    from qn_hf.checkpoint.background import BackgroundSaves

    weight = torch.nn.Parameter(torch.ones(3))
    weight.grad = torch.ones(3)
    opt = torch.optim.SGD([weight], lr=0.1)
    saves = BackgroundSaves(timeout=datetime.timedelta(seconds=5), streams=LateStreams())
    saves.copies.begin(torch.device("cpu"))
    saves.hold_step(opt)
    saves.abandon()
    stepped = threading.Thread(target=opt.step, daemon=True)
    stepped.start()
    stepped.join(timeout=10)
    assert not stepped.is_alive() and torch.equal(weight.detach(), torch.full((3,), 0.9))
    saves.close()
