"""What a checkpoint's index promises is checked before it is believed (issue 46, items 11 and 13): the
index's own digest refuses any edited byte (a step, a learning rate, Adam's betas), its file digests
are required, a load with an optimizer gets every state tensor of every parameter or a clear error
naming the parameter and key, and a file whose size is not the index's is refused before a byte of
it is read (a shard grown to a terabyte, sparse, is refused at once, not CRC-read to its end)."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
from pathlib import Path

import pytest
import torch

import qn_hf
from qn_hf import convert
from qn_hf.checkpoint import INDEX, CheckpointError, checkpoint_dir, read_index
from qn_hf.checkpoint.seal import write_index
from tests.cases import freeze, mesh_for
from tests.models import dp_slice, load, make_batch

V1 = str(Path(__file__).parent / "data" / "checkpoint_v1" / "checkpoint")


def _checkpoint(model_dirs, tmp_path) -> str:
    return convert.from_hf(model_dirs["gpt2"], str(tmp_path / "ckpt"), tp=2, pp=1)


def test_every_sampled_byte_edit_of_a_real_index_is_refused_quickly(model_dirs, tmp_path):
    directory = _checkpoint(model_dirs, tmp_path)
    path = os.path.join(directory, INDEX)
    data = Path(path).read_bytes()
    # the step, the version (an older one must not skip the check), a file's CRC, the digest itself
    targeted = [data.index(b'"step": 0') + 8, data.index(b'"version": 2') + 11, data.index(b'"crc32": ') + 9, 20]
    edits = [(at, ord("1") if data[at] != ord("1") else ord("3")) for at in targeted]
    rng = random.Random(0)
    edits += [(at, data[at] ^ (1 << rng.randrange(8))) for at in rng.sample(range(len(data)), 150)]
    for at, value in edits:
        Path(path).write_bytes(data[:at] + bytes([value]) + data[at + 1:])
        with pytest.raises(CheckpointError):
            read_index(directory)
    Path(path).write_bytes(data)
    assert read_index(directory)["step"] == 0


def test_file_digests_are_required(model_dirs, tmp_path):
    directory = _checkpoint(model_dirs, tmp_path)
    index = json.loads(Path(directory, INDEX).read_text())
    for without in ("all", "one"):
        edited = {k: v for k, v in index.items() if k != "files"} if without == "all" else {
            **index, "files": {k: v for k, v in index["files"].items() if k != "shard-pp0-tp1.safetensors"}}
        write_index(edited, os.path.join(directory, INDEX))  # sealed again: the check must stand on its own
        message = "'files' is 'None'" if without == "all" else "shard-pp0-tp1.safetensors: the index records no size"
        with pytest.raises(CheckpointError, match=message):
            read_index(directory)


def test_an_index_written_before_sealing_loads_with_a_warning(tmp_path):
    with pytest.warns(UserWarning, match="written before qn_hf sealed its indexes"):
        assert read_index(checkpoint_dir(V1))["version"] == 1
    legacy = str(tmp_path / "v1")
    shutil.copytree(checkpoint_dir(V1), legacy)
    index = json.loads(Path(legacy, INDEX).read_text())
    Path(legacy, INDEX).write_text(json.dumps({**index, "version": 2}))  # claims a sealed version without a digest
    with pytest.raises(CheckpointError, match="holds no 'index_sha256'"):
        read_index(legacy)


class _Slow(Exception):
    pass


def test_a_shard_grown_to_a_terabyte_is_refused_before_it_is_read(model_dirs, tmp_path):
    directory = _checkpoint(model_dirs, tmp_path)
    shard = os.path.join(directory, "shard-pp0-tp1.safetensors")
    with open(shard, "r+b") as f:
        f.truncate(1 << 40)  # sparse: no disk used, but reading it would take hours

    def too_slow(*_):
        raise _Slow("still reading the shard after 10 s: its size was not compared first")

    previous = signal.signal(signal.SIGALRM, too_slow)
    signal.setitimer(signal.ITIMER_REAL, 10)
    try:
        # the alarm only bounds a hang (reading the shard would take hours); the refusal's message proves
        # the size was compared before any read
        with pytest.raises(CheckpointError, match="has 1,099,511,627,776 bytes, the index recorded"):
            convert.to_hf(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def case_edited_optimizer_state(*, model_dir: str, root: str) -> dict[str, str]:
    """An AdamW checkpoint after one step, then copies of it with one thing changed each; what loading
    each with the optimizer raises (the same on every rank)."""
    import torch.distributed as dist

    pm = qn_hf.parallelize(freeze(load("gpt2", model_dir), ("transformer.wpe",)), tp=2, mesh=mesh_for(1, 2))
    opt = torch.optim.AdamW(pm.parameters(), lr=0.01, betas=(0.9, 0.999))  # the frozen wpe has no state
    pm.train_step(dp_slice(make_batch("gpt2", size=4, seed=1), dp=1, dp_rank=0))
    opt.step()
    good = os.path.join(root, "good")
    directory = os.path.basename(pm.save_checkpoint(good, optimizer=opt, step=6))

    def raw(old: bytes, new: bytes):
        def edit(path: str) -> None:
            data = Path(path).read_bytes()
            assert data.count(old) >= 1, old
            Path(path).write_bytes(data.replace(old, new, 1))
        return edit

    def resealed(change):
        def edit(path: str) -> None:
            index = json.loads(Path(path).read_text())
            change(index)
            write_index(index, path)
        return edit

    def drop(keep):
        return resealed(lambda index: index.update(tensors={k: v for k, v in index["tensors"].items() if keep(k)}))

    variants = {
        "step": raw(b'"step": 6', b'"step": 7'),
        "lr": raw(b'"lr": 0.01', b'"lr": 0.03'),
        "betas": raw(b"0.999", b"0.919"),
        "one parameter": drop(lambda k: not k.startswith("optimizer/transformer.h.0.mlp.c_fc.weight/")),
        "exp_avg_sq": drop(lambda k: not k.endswith("/exp_avg_sq")),
        "files": resealed(lambda index: index.pop("files")),
        # hyperparameters forged and the index sealed again (what a tool that rewrites it does): each refused before
        # anything changes, naming the value
        "lr as text": resealed(lambda index: index["optimizer"][0].update(lr="0.01")),
        "negative lr": resealed(lambda index: index["optimizer"][0].update(lr=-1)),
        "one beta": resealed(lambda index: index["optimizer"][0].update(betas=[0.9])),
        "weight_decay as text": resealed(lambda index: index["optimizer"][0].update(weight_decay="0.01")),
    }
    before = [p.detach().clone() for p in pm.parameters()]
    out = {}
    for name, edit in variants.items():
        path = os.path.join(root, name)
        if dist.get_rank() == 0:
            shutil.copytree(good, path)
            edit(os.path.join(path, directory, INDEX))
        dist.barrier()
        try:
            pm.load_checkpoint(path, optimizer=opt)
            out[name] = "no error"
        except CheckpointError as e:
            out[name] = str(e)
    out["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, pm.parameters()))
    out["group"] = {k: v for k, v in opt.param_groups[0].items() if k in ("lr", "betas", "weight_decay")}
    out["good"] = str(pm.load_checkpoint(good, optimizer=opt)["step"])
    opt.step()  # every state tensor came back
    return out


def test_edited_or_incomplete_optimizer_state_is_refused_on_every_rank(worlds, model_dirs, tmp_path):
    results = worlds.run(2, case_edited_optimizer_state, model_dir=model_dirs["gpt2"], root=str(tmp_path))
    assert results[0] == results[1]
    out = results[0]
    for name in ("step", "lr", "betas"):
        assert "was edited or damaged after it was written: its bytes hash to" in out[name], (name, out[name])
    assert "optimizer state 'exp_avg' of parameter transformer.h.0.mlp.c_fc.weight is missing" in out["one parameter"]
    assert "load without optimizer= to start the optimizer afresh" in out["one parameter"]
    assert "optimizer state 'exp_avg_sq' of parameter transformer." in out["exp_avg_sq"], out["exp_avg_sq"]
    assert "'files' is 'None'" in out["files"]
    assert out["good"] == "6"
    for name, says in (("lr as text", "lr='0.01' is not a finite value of the type float"),
                       ("negative lr", "lr=-1 is negative"), ("one beta", "betas=[0.9] is not a finite value"),
                       ("weight_decay as text", "weight_decay='0.01' is not a finite value")):
        assert f"the saved optimizer group 0's {says}" in out[name] and "optimizer= to start" in out[name], out[name]
    assert out["unchanged"] and out["group"] == {"lr": 0.01, "betas": (0.9, 0.999), "weight_decay": 0.01}, out


@pytest.mark.parametrize(("key", "saved", "current", "says"), [
    ("lr", "0.1", 0.01, "not a finite value of the type float"), ("lr", None, 0.01, "not a finite value"),
    ("lr", -1, 0.01, "is negative"), ("lr", float("inf"), 0.01, "not a finite value"),
    ("eps", float("nan"), 1e-8, "not a finite value"), ("eps", 0.0, 1e-8, "is not positive"),
    ("betas", [0.9], (0.9, 0.999), "not a finite value of the type tuple"),
    ("betas", [0.9, 1.0], (0.9, 0.999), "outside [0, 1)"), ("betas", [0.9, "x"], (0.9, 0.999), "not a finite"),
    ("weight_decay", "0.01", 0.01, "not a finite value"), ("weight_decay", -0.1, 0.01, "is negative"),
    ("amsgrad", 1, False, "not a finite value of the type bool"), ("momentum", -0.5, 0.9, "is negative"),
    # what torch's optimizers take, and types they leave open
    ("lr", 0, 0.01, None), ("lr", 0.5, torch.tensor(0.01), None), ("betas", [0.0, 0.5], (0.9, 0.999), None),
    ("foreach", None, True, None), ("foreach", True, None, None), ("initial_lr", 0.01, 0.01, None),
])
def test_a_saved_hyperparameter_must_be_what_the_optimizer_takes(key, saved, current, says):
    from qn_hf.checkpoint.optimizer_state import hyperparameter_problem

    problem = hyperparameter_problem(key, saved, current)
    assert problem == says if says is None else says in problem, problem
