"""A job's start-up makes a number of world-wide collectives that does not grow with its size. On NCCL with the
world bound to a device, torch splits every new group from the world's communicator, a collective of every rank
(``perform_nocolor_split`` for the others): one group per pipeline link made 2 x world splits. qn_hf makes a
round of disjoint groups with one split (``comm.member_groups``, ``p2p.link_rounds``). CPU runs have no NCCL to
split, so the world test stands a recording ``split_group`` in for torch's and checks the groups it is asked for
train a pipeline equal to the plain model."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from qn_hf.config.dims import Axis, ParallelDims
from qn_hf.config.layout import rank_groups
from qn_hf.local_world import LocalWorld
from qn_hf.pipeline.p2p import directed_pairs, link_rounds
from tests.cases import parity


@pytest.mark.parametrize("dp,tp,pp", [(512, 1, 2), (64, 4, 4), (16, 8, 8), (8, 8, 16), (11, 31, 3), (1, 1, 1024)])
def test_links_of_a_thousand_ranks_take_a_few_splits(dp, tp, pp):
    dims = ParallelDims(dp=dp, tp=tp, pp=pp)
    rings = [list(g) for g in rank_groups(dims)[Axis.PP.value]]
    order = directed_pairs(rings)
    rounds = link_rounds(order)
    assert sorted(p for r in rounds for p in r) == sorted(order)  # every link once
    for pairs in rounds:  # no rank twice in a round: one split can make its groups
        ends = [rank for pair in pairs for rank in pair]
        assert len(ends) == len(set(ends))
    # One split per round, against one per link before: 2 per rank (a ring of two: 1)
    assert len(order) == dims.world_size * (1 if pp == 2 else 2)
    assert len(rounds) == (2 if pp == 2 else 4 if pp % 2 == 0 else 6) <= 7


def case_split_groups(*, model_dir: str, out_dir: str, dp: int, tp: int, pp: int) -> dict:
    """``parity`` with the groups made as on a bound NCCL world: through ``dist.split_group``, recorded."""
    from qn_hf import comm

    calls: list[list[list[int]]] = []

    def split_group(*, split_ranks, timeout):  # NCCL's rule: each rank in at most one of the lists
        ends = [r for ranks in split_ranks for r in ranks]
        assert len(ends) == len(set(ends)), split_ranks
        calls.append(split_ranks)
        mine = dist.GroupMember.NON_GROUP_MEMBER  # what torch 2.15 returns to a rank in none of the lists
        for ranks in split_ranks:
            group = dist.new_group(ranks, timeout=timeout)
            mine = group if dist.get_rank() in ranks else mine
        return mine

    real_split, real_splits = getattr(dist, "split_group", None), comm.splits_world
    dist.split_group, comm.splits_world = split_group, lambda: True
    try:
        out = parity(kind="llama", model_dir=model_dir, out_dir=out_dir, dp=dp, tp=tp, pp=pp, microbatches=2)
    finally:
        dist.split_group, comm.splits_world = real_split, real_splits
    return {**out, "calls": calls}


@pytest.mark.core
def test_groups_split_in_rounds_train_equal(model_dirs, tmp_path):
    with LocalWorld(4) as ranks:
        out = ranks.run(case_split_groups, model_dir=model_dirs["llama"], out_dir=str(tmp_path), dp=1, tp=1, pp=4)
    for r in out:
        assert abs(r["loss"] - r["ref_loss"]) <= 1e-5 * abs(r["ref_loss"]) and r["grad_err"] <= 2e-5
        assert r["weight_err"] <= 2e-5
        links = [tuple(ranks) for call in r["calls"] for ranks in call if len(ranks) == 2]
        # every link, each made by a split (its ranks in global order, as new_group numbers a group's ranks)
        assert sorted(links) == sorted(tuple(sorted(pair)) for pair in directed_pairs([[0, 1, 2, 3]]))
        assert len(r["calls"]) == 4  # the ring of four's links: four rounds (no other group at dp=tp=1)
