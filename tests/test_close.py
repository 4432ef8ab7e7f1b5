"""``pm.close()`` releases the process groups ``parallelize`` made (every gloo group keeps threads, one
of them a TCP event loop, until it is destroyed) and leaves the world's and a caller's mesh alone."""

from __future__ import annotations

import pytest
import torch
from torch.distributed import distributed_c10d as c10d

import qn_hf
from tests.cases import mesh_for
from tests.models import load, make_batch


def _groups() -> set:
    return set(c10d._world.pg_map)  # torch's registry of live groups (no public list exists)


def case_close(*, model_dir: str) -> dict:
    before = _groups()
    pm = qn_hf.parallelize(load("gpt2", model_dir), tp=2, pp=2, microbatches=2, dp=1)  # its own mesh
    made = len(_groups() - before)
    pm.train_step(make_batch("gpt2", size=2, seed=0))
    pm.close()
    left = len(_groups() - before)
    with pytest.raises(ValueError) as refused:
        pm.train_step(make_batch("gpt2", size=2, seed=0))
    mesh = mesh_for(1, 2, 2)  # a caller's mesh: its groups outlive the model
    given = qn_hf.parallelize(load("gpt2", model_dir), tp=2, pp=2, microbatches=2, mesh=mesh)
    given.close()
    mesh_alive = all(mesh.get_group(name) in _groups() for name in ("dp", "pp", "tp"))
    torch.distributed.barrier()
    return {"made": made, "left": left, "refused": str(refused.value), "mesh_alive": mesh_alive}


def test_close_releases_the_groups_parallelize_made(worlds, model_dirs):
    for r in worlds.run(4, case_close, model_dir=model_dirs["gpt2"]):
        assert r["made"] > 3 and r["left"] == 0, r
        assert "was closed" in r["refused"], r
        assert r["mesh_alive"], r
