"""Ranks laid out by the node (config/layout.py) and the nodes a launcher's environment describes (launch/nodes.py):
pp outermost, tp fastest, so that with nodes of consecutive ranks tp, cp and ep groups stay inside a node and
dp and pp cross; the groups build_groups creates are the ones the layout lists; what srun, mpirun and torchrun
(Kubernetes' PyTorchJob included) set is read alike."""

from __future__ import annotations

import datetime
import json

import pytest
import torch

from qn_hf.config.dims import ParallelDims
from qn_hf.config.layout import crosses_nodes, rank_grid, rank_groups
from qn_hf.launch.nodes import launch_environment


def test_ranks_are_numbered_pp_dp_cp_tp_with_tp_fastest():
    dims = ParallelDims(dp=2, pp=2, cp=2, tp=2)
    grid = rank_grid(dims)  # indexed (dp, pp, cp, tp)
    assert grid[0, 0, 0].tolist() == [0, 1]  # the first tp group: ranks 0..tp-1 (API.md)
    assert grid[0, 0, 1, 0] == 2 and grid[1, 0, 0, 0] == 4 and grid[0, 1, 0, 0] == 8  # then cp, dp, pp
    assert rank_grid(ParallelDims(dp=2, pp=2, tp=2)).tolist() == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    assert sorted(grid.reshape(-1).tolist()) == list(range(16))


def test_two_nodes_of_four_keep_tp_and_ep_inside_and_dp_and_pp_across():
    dims = ParallelDims(dp=2, pp=2, tp=2, ep=2)
    groups = rank_groups(dims)
    assert groups["tp"] == ((0, 1), (4, 5), (2, 3), (6, 7)) and groups["ep"] == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert crosses_nodes(dims, 4) == {"dp": False, "pp": True, "tp": False, "replicas": False, "ep": False,
                                      "experts": False}
    # ep over 4 ranks of a stage's dp x tp grid: one node under pp outermost (it spanned two before)
    assert not crosses_nodes(ParallelDims(dp=4, pp=2, ep=4), 4)["ep"]
    # a world of one node crosses nothing; tp wider than a node crosses
    assert not any(crosses_nodes(ParallelDims(dp=2, pp=2, tp=2, ep=2), 8).values())
    assert crosses_nodes(ParallelDims(dp=1, tp=8), 4)["tp"]


def test_sharded_groups_follow_the_same_numbering():
    groups = rank_groups(ParallelDims(dp=4, pp=2, dp_shard=2))
    assert groups["dp_shard"] == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert groups["dp_replicate"] == ((0, 2), (1, 3), (4, 6), (5, 7))


@pytest.mark.parametrize(("env", "expected"), [
    ({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1"},
     ("torchrun", 5, 8, 1, 4, 1)),
    ({"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "2", "SLURM_NODEID": "1",
      "SLURM_STEP_TASKS_PER_NODE": "4(x2)"}, ("srun", 6, 8, 2, 4, 1)),
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "0",
      "SLURM_STEP_TASKS_PER_NODE": "2,2"}, ("srun", 1, 4, 1, 2, 0)),
    # a batch script's own process: the allocation's variables, no step's: one process, not 8
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": "4(x2)"},
     ("no launcher", 0, 1, 0, 1, 0)),
    # mpirun names no node (--map-by may deal ranks across nodes): the hosts tell them apart
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, ("mpirun", 3, 4, 1, 2, None)),
    ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}, ("another launcher", 3, 4, 1, None, None)),
    ({}, ("no launcher", 0, 1, 0, 1, 0)),
])
def test_each_launchers_variables_give_the_same_place(env, expected):
    launch = launch_environment(env)
    assert (launch.launcher, launch.rank, launch.world_size, launch.local_rank, launch.ranks_per_node,
            launch.node) == expected


def test_ranks_srun_starts_without_a_meeting_place_are_refused(monkeypatch):
    from qn_hf.mesh import init_distributed

    for key in ("MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4",
                       "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_LOCALID": "1", "SLURM_NODEID": "0"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match="srun started 4 ranks and MASTER_ADDR is not set"):
        init_distributed(device=torch.device("cpu"), timeout=datetime.timedelta(seconds=5))


@pytest.mark.parametrize(("env", "message"), [
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "6", "SLURM_STEP_NUM_TASKS": "6", "SLURM_STEP_TASKS_PER_NODE": "4,2"},
     "nodes run different numbers of tasks"),
    ({"RANK": "0", "WORLD_SIZE": "6", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"}, "must divide the world"),
])
def test_uneven_nodes_are_refused(env, message):
    with pytest.raises(ValueError, match=message):
        launch_environment(env)


def groups_job(dp: int, pp: int, tp: int, ep: int) -> dict:
    """The groups build_groups creates on this rank, beside the layout's lists."""
    import torch.distributed as dist

    from qn_hf.mesh import build_groups

    dims = ParallelDims(dp=dp, pp=pp, tp=tp, ep=ep)
    groups = build_groups(dims, device=torch.device("cpu"), timeout=datetime.timedelta(seconds=60))
    try:
        ranks = {kind: dist.get_process_group_ranks(getattr(groups, kind)) for kind in ("tp", "dp", "pp", "ep")}
        return {"ranks": ranks, "nodes": (groups.nodes.count, groups.nodes.ranks_per_node, groups.nodes.consecutive)}
    finally:
        groups.release()


def test_the_groups_built_are_the_layouts(worlds):
    listed = rank_groups(ParallelDims(dp=2, pp=2, ep=2))
    for rank, out in enumerate(worlds.run(4, groups_job, dp=2, pp=2, tp=1, ep=2)):
        for kind in ("dp", "pp", "ep"):
            assert tuple(out["ranks"][kind]) in listed[kind] and rank in out["ranks"][kind], (kind, out)
        assert out["nodes"] == (1, 4, True)  # a local world: one node (LOCAL_WORLD_SIZE = the world)


def test_the_planners_report_names_the_groups_across_nodes(tmp_path, capsys):
    """16 GPUs, 8 a node, dp=2, tp=4, pp=2: a stage is one node (tp and dp inside), the pipeline crosses; the
    same mesh on nodes of 16 crosses nothing."""
    from transformers import LlamaConfig

    from qn_hf.planner.cli import main

    LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=4, vocab_size=1024, architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    common = [str(tmp_path), "--dp", "2", "--tp", "4", "--pp", "2", "--seq-len", "256"]
    main([*common, "--gpus-per-node", "8"])
    out = capsys.readouterr().out
    assert "links: tp nvlink, cp nvlink, pp ib, dp nvlink" in out and "groups across nodes (8 GPUs a node): pp" in out
    main([*common, "--json", "--gpus-per-node", "8"])
    assert json.loads(capsys.readouterr().out)["links"]["pp"] == "ib"
    main([*common, "--gpus-per-node", "16"])
    assert "groups across nodes (16 GPUs a node): none" in capsys.readouterr().out


def cyclic_nodes_job() -> tuple:
    """This rank's node as srun's cyclic distribution gives it (rank r on node r % 2), agreed over the world."""
    import os
    import warnings

    from qn_hf.launch.nodes import agreed_nodes

    rank, saved = int(os.environ["RANK"]), dict(os.environ)
    os.environ.update(LOCAL_WORLD_SIZE="2", GROUP_RANK=str(rank % 2), LOCAL_RANK=str(rank // 2))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            nodes = agreed_nodes()
    finally:  # the world's ranks run later jobs: their environment as it was
        os.environ.clear()
        os.environ.update(saved)
    return nodes.count, nodes.of_rank, nodes.consecutive, [str(w.message) for w in caught]


def test_ranks_dealt_out_across_nodes_are_told_apart_and_warned_of(worlds):
    results = worlds.run(4, cyclic_nodes_job)
    for count, of_rank, consecutive, _ in results:
        assert (count, tuple(of_rank), consecutive) == (2, (0, 1, 0, 1), False)
    assert "otherwise than node by node" in " ".join(results[0][3]) and not results[1][3]  # rank 0 says it
