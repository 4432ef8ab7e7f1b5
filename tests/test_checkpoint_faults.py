"""Checkpoint faults: a crash inside a save, damaged or foreign checkpoints, mismatched optimizers."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import qn_hf
from qn_hf.checkpoint import CheckpointError, checkpoint_dir
from qn_hf.checkpoint.seal import write_index
from tests.cases import mesh_for
from tests.models import load

ROOT = Path(__file__).resolve().parent.parent


# A kill while shards or the index are written stays in the CI-sized suite; the other two points are `long`.
# (Saving removes no older checkpoint: a kill while pruning is tests/test_checkpoint_safety.py's.)
@pytest.mark.parametrize("where", [pytest.param(w, marks=pytest.mark.long) if w in ("before", "latest") else w
                                   for w in ["before", "shard", "index", "latest"]])
def test_sigkill_inside_save_leaves_previous_checkpoint(model_dirs, tmp_path, where):
    ckpt = str(tmp_path / "ckpt")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "crash_during_save.py"), model_dirs["gpt2"], ckpt, where],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert os.path.basename(checkpoint_dir(ckpt)) == "ckpt-000001"
    meta, weights = _load_single(model_dirs["gpt2"], ckpt)
    assert meta["step"] == 1
    step1 = dict(load("gpt2", ckpt + "-step1-hf").named_parameters())
    assert all(torch.equal(weights[n], p) for n, p in step1.items())


def _load_single(model_dir: str, ckpt: str):
    """Load in a fresh one-rank process (the test process has no process group of its own)."""
    script = (
        "import sys, json, torch, qn_hf; from tests.models import load\n"
        "pm = qn_hf.parallelize(load('gpt2', sys.argv[1])); meta = pm.load_checkpoint(sys.argv[2])\n"
        "pm.save_pretrained(sys.argv[2] + '-loaded-hf'); print(json.dumps(meta))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", script, model_dir, ckpt], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), dict(load("gpt2", ckpt + "-loaded-hf").named_parameters())


def case_bad_checkpoints(*, gpt2_dir: str, llama_dir: str, root: str) -> dict[str, str]:
    import torch.distributed as dist

    pm = qn_hf.parallelize(load("gpt2", gpt2_dir), tp=2, mesh=mesh_for(1, 2))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    good = os.path.join(root, "good")
    pm.save_checkpoint(good, optimizer=opt, step=3)
    directory = checkpoint_dir(good)

    def variant(name: str, damage) -> str:
        path = os.path.join(root, name)
        if dist.get_rank() == 0:
            shutil.copytree(good, path)
            damage(os.path.join(path, os.path.basename(directory)))
        dist.barrier()
        return path

    def truncate(d):
        f = os.path.join(d, "shard-pp0-tp1.safetensors")
        with open(f, "r+b") as fh:
            fh.truncate(os.path.getsize(f) // 2)

    def flip(d):  # one bit of tensor data: the safetensors header stays valid
        f = os.path.join(d, "shard-pp0-tp1.safetensors")
        with open(f, "r+b") as fh:
            fh.seek(-3, os.SEEK_END)
            byte = fh.read(1)
            fh.seek(-3, os.SEEK_END)
            fh.write(bytes([byte[0] ^ 0x10]))

    def escape(d):  # sealed again: the file-name check must hold behind the index's digest too
        index = json.load(open(os.path.join(d, "index.json")))
        index["tensors"]["transformer.wte.weight"]["pieces"][0]["file"] = "../../outside.safetensors"
        write_index(index, os.path.join(d, "index.json"))

    before = [p.detach().clone() for p in pm.parameters()]
    messages = {}
    cases = {
        "missing": variant("missing", lambda d: os.unlink(os.path.join(d, "shard-pp0-tp1.safetensors"))),
        "truncated": variant("truncated", truncate),
        "corrupt": variant("corrupt", flip),
        "escape": variant("escape", escape),
    }
    for name, path in cases.items():
        try:
            pm.load_checkpoint(path)
            messages[name] = "no error"
        except CheckpointError as e:
            messages[name] = str(e)
    llama = qn_hf.parallelize(load("llama", llama_dir), tp=2, mesh=mesh_for(1, 2))
    try:
        llama.load_checkpoint(good)
        messages["architecture"] = "no error"
    except CheckpointError as e:
        messages["architecture"] = str(e)
    from transformers import GPT2Config, GPT2LMHeadModel

    wider = GPT2LMHeadModel(GPT2Config(n_layer=5, n_embd=48, n_head=4, n_positions=32, vocab_size=99))
    wide = qn_hf.parallelize(wider, tp=2, mesh=mesh_for(1, 2))
    try:
        wide.load_checkpoint(good)
        messages["config"] = "no error"
    except CheckpointError as e:
        messages["config"] = str(e)
    from qn_hf.checkpoint.load import load_checkpoint

    try:  # without the config comparison, the tensors' shapes still refuse it
        load_checkpoint(wide.module, good, placement=wide.placement, model_type="gpt2")
        messages["shape"] = "no error"
    except CheckpointError as e:
        messages["shape"] = str(e)
    two_groups = torch.optim.AdamW([{"params": list(pm.parameters())[:2]}, {"params": list(pm.parameters())[2:]}])
    try:
        pm.load_checkpoint(good, optimizer=two_groups)
        messages["optimizer"] = "no error"
    except CheckpointError as e:
        messages["optimizer"] = str(e)
    messages["unchanged"] = str(all(torch.equal(a, b) for a, b in zip(before, pm.parameters())))
    messages["good step"] = str(pm.load_checkpoint(good, optimizer=opt)["step"])
    return messages


def test_bad_checkpoints_fail_on_every_rank(worlds, model_dirs, tmp_path):
    results = worlds.run(2, case_bad_checkpoints, gpt2_dir=model_dirs["gpt2"],
                         llama_dir=model_dirs["llama"], root=str(tmp_path))
    assert results[0] == results[1]  # the same error on every rank
    m = results[0]
    assert "shard-pp0-tp1.safetensors" in m["missing"] and "is missing" in m["missing"] and m["missing"].startswith("rank 1:")
    assert "shard-pp0-tp1.safetensors" in m["truncated"] and ("cannot be read" in m["truncated"] or "is corrupt" in m["truncated"])
    assert "shard-pp0-tp1.safetensors is corrupt" in m["corrupt"] and "CRC-32" in m["corrupt"] and "(reading transformer." in m["corrupt"]
    assert "'../../outside.safetensors' is not a .safetensors name inside the checkpoint directory" in m["escape"]
    assert "holds a 'gpt2' model, this one is 'llama'" in m["architecture"]
    assert "the optimizer had 1 parameter groups, this one has 2" in m["optimizer"]
    assert "n_embd: saved 32, this model 48" in m["config"]
    assert "transformer.wte.weight has shape [99, 32], the model needs [99, 48]" in m["shape"]
    assert m["unchanged"] == "True" and m["good step"] == "3"
