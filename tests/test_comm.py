"""Each autograd collective on its own: forward value and backward value on a world of 2."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from qn_hf.comm import (
    copy_to_group,
    flat_all_reduce_,
    flat_broadcast_,
    gather_from_group,
    reduce_from_group,
    split_to_group,
)


def case_primitives() -> dict[str, bool]:
    group = dist.group.WORLD
    rank, n = dist.get_rank(), dist.get_world_size()
    results = {}

    x = torch.full((2, 3), float(rank + 1), requires_grad=True)
    y = copy_to_group(x, group=group)
    (y * (rank + 1)).sum().backward()  # each rank's upstream gradient is rank + 1
    results["copy forward is identity"] = torch.equal(y, x)
    results["copy backward sums"] = torch.equal(x.grad, torch.full((2, 3), float(sum(range(1, n + 1)))))

    x = torch.full((2, 3), float(rank + 1), requires_grad=True)
    y = reduce_from_group(x, group=group)
    (y * (rank + 1)).sum().backward()
    results["reduce forward sums"] = torch.equal(y, torch.full((2, 3), float(sum(range(1, n + 1)))))
    results["reduce backward is identity"] = torch.equal(x.grad, torch.full((2, 3), float(rank + 1)))

    x = torch.full((2, 2), float(rank), requires_grad=True)
    y = gather_from_group(x, group=group)
    weights = torch.arange(float(2 * n)).expand(2, -1)
    (y * weights).sum().backward()
    results["gather forward concatenates"] = torch.equal(y, torch.cat([torch.full((2, 2), float(r)) for r in range(n)], -1))
    results["gather backward keeps own chunk"] = torch.equal(x.grad, weights[:, 2 * rank : 2 * rank + 2])

    x = torch.arange(float(2 * n)).expand(2, -1).clone().requires_grad_(True)
    y = split_to_group(x, group=group)
    (y * (rank + 1)).sum().backward()
    results["split forward keeps own chunk"] = torch.equal(y, x[:, 2 * rank : 2 * rank + 2])
    results["split backward gathers"] = torch.equal(x.grad, torch.cat([torch.full((2, 2), float(r + 1)) for r in range(n)], -1))

    tensors = [torch.full((3,), float(rank)), torch.full((2, 2), float(rank), dtype=torch.float64)]
    flat_all_reduce_(tensors, group=group)
    total = float(sum(range(n)))
    results["flat all-reduce sums each tensor"] = all(bool((t == total).all()) for t in tensors)
    tensors = [torch.full((3,), float(rank)), torch.full((1,), float(rank) * 10)]
    flat_broadcast_(tensors, src_group_rank=1, group=group)
    results["flat broadcast copies from the source"] = torch.equal(tensors[0], torch.ones(3)) and tensors[1].item() == 10.0
    return results


def test_primitives(worlds):
    for rank, results in enumerate(worlds.run(2, case_primitives)):
        failed = [name for name, ok in results.items() if not ok]
        assert not failed, f"rank {rank}: {failed}"


def case_copies() -> dict[str, bool]:
    """Where the eager all-reduces write: into an intermediate result itself (no copy) when nothing can hold it,
    into a new tensor otherwise; and a backward never writes into the gradient autograd hands it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):  # as selective recomputation's cache is, around the forward
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    group = dist.group.WORLD
    rank, n = dist.get_rank(), dist.get_world_size()
    total = float(sum(range(1, n + 1)))
    results = {}

    leaf = torch.full((2, 3), float(rank + 1), requires_grad=True)
    partial = leaf * 1.0
    y = reduce_from_group(partial, group=group)
    results["intermediate reduced in place"] = y.data_ptr() == partial.data_ptr() and bool((y == total).all())
    y.sum().backward()
    results["in place: backward is identity"] = torch.equal(leaf.grad, torch.ones(2, 3))

    partial = leaf.detach().clone().requires_grad_(True) * 1.0
    with Passthrough():
        y = reduce_from_group(partial, group=group)
    kept = bool((partial == rank + 1).all())
    fresh = y.data_ptr() != partial.data_ptr()
    results["under a dispatch mode: a new tensor"] = fresh and kept and bool((y == total).all())
    y = reduce_from_group(leaf, group=group)
    results["a leaf is not written"] = bool((leaf == rank + 1).all()) and bool((y == total).all())

    # s = p + copy(q): add's backward hands the same gradient tensor to p and to the copy's backward
    p = torch.zeros(2, 3, requires_grad=True)
    q = torch.zeros(2, 3, requires_grad=True)
    ((p + copy_to_group(q, group=group)) * (rank + 1)).sum().backward()
    results["shared gradient left alone"] = torch.equal(p.grad, torch.full((2, 3), float(rank + 1)))
    results["copy backward sums"] = torch.equal(q.grad, torch.full((2, 3), total))
    return results


def test_copies(worlds):
    for rank, results in enumerate(worlds.run(2, case_copies)):
        failed = [name for name, ok in results.items() if not ok]
        assert not failed, f"rank {rank}: {failed}"


def case_compiled() -> dict:
    """The tp region functions traced whole by torch.compile (inductor, one graph: fullgraph=True), forward and
    backward, equal to eager."""
    from qn_hf.comm import gather_sequence_into_region, reduce_scatter_sequence

    group = dist.group.WORLD
    rank = dist.get_rank()

    def region(x: torch.Tensor, w: torch.Tensor, sequence: bool) -> torch.Tensor:
        if sequence:  # [batch, sequence slice, features]: gather, column product, reduce-scatter
            return reduce_scatter_sequence(gather_sequence_into_region(x, group=group) @ w, group=group).relu()
        return reduce_from_group(copy_to_group(x, group=group) @ w, group=group).relu()

    torch._dynamo.reset()
    compiled = torch.compile(region, fullgraph=True)
    out = {}
    for sequence in (False, True):
        gen = torch.Generator().manual_seed(rank)
        x0, w0 = torch.randn(2, 4, 8, generator=gen), torch.randn(8, 8, generator=gen)
        runs = []
        for fn in (region, compiled):
            x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
            y = fn(x, w, sequence)
            (y * torch.arange(y.numel()).view_as(y)).sum().backward()
            runs.append((y.detach(), x.grad, w.grad))
        out[sequence] = max((a - b).abs().max().item() for a, b in zip(*runs))
    return out


def test_compiled_collectives(worlds):
    for errors in worlds.run(2, case_compiled):
        assert all(err < 1e-5 for err in errors.values()), errors


def test_flat_collectives_bound_their_buffers():
    """Many small tensors share a buffer; runs stop at FLAT_BYTES, and a tensor as large as a run is
    handed to the collective itself, uncopied (the start-up broadcast of a whole stage would otherwise
    hold the stage twice)."""
    import torch

    from qn_hf import comm

    mib = 2**20
    assert comm.flat_runs([mib] * 3) == [[0, 1, 2]]
    assert comm.flat_runs([40 * mib, 40 * mib, mib, 200 * mib, mib]) == [[0], [1, 2], [3], [4]]
    big, small = torch.ones(comm.FLAT_BYTES // 4 + 1), [torch.full((3,), float(i)) for i in range(4)]
    seen = []

    def double(flat: torch.Tensor) -> None:
        seen.append((flat.data_ptr(), flat.numel()))
        flat.mul_(2)

    comm._flat_in_place([small[0], big, *small[1:]], double)
    assert (big.data_ptr(), big.numel()) in seen and len(seen) == 3  # small[0] | big alone | small[1:]
    assert torch.equal(big, torch.full_like(big, 2.0))
    assert all(torch.equal(t, torch.full((3,), 2.0 * i)) for i, t in enumerate(small))


def case_host_max(*, width: int) -> dict:
    """``host_max_`` against gloo's all-reduce on random vectors (each rank's own), and its transfers counted."""
    from qn_hf.comm import host_max_, host_max_rounds

    group = dist.new_group(backend="gloo")
    out = {"equal": True}
    for seed in range(3):
        mine = torch.randint(-50, 50, (width, 3), generator=torch.Generator().manual_seed(seed * 100 + dist.get_rank()))
        expected = mine.clone()
        dist.all_reduce(expected, op=dist.ReduceOp.MAX, group=group)
        out["equal"] &= torch.equal(host_max_(mine, group=group), expected)
    out["rounds"] = host_max_rounds(dist.get_world_size())
    dist.destroy_process_group(group)
    return out


@pytest.mark.core
@pytest.mark.parametrize("world", [5])  # not a power of two; every other world test runs 2 or 4
def test_hosts_max_in_log_rounds(world):
    """The hosts' per-step exchange (step/agreement.py) is gloo's all-reduce's result in ceil(log2 W) rounds."""
    from qn_hf.local_world import LocalWorld

    with LocalWorld(world) as ranks:
        out = ranks.run(case_host_max, width=world + 1)
    assert all(r["equal"] for r in out) and {r["rounds"] for r in out} == {(world - 1).bit_length()}


def test_host_max_rounds_at_scale():
    from qn_hf.comm import host_max_rounds

    # gloo's ring takes about 4 W sequential transfers for a small vector; this exchange log2 W
    assert [host_max_rounds(w) for w in (1, 2, 3, 4, 5, 1024, 1025, 16384)] == [0, 1, 2, 2, 3, 10, 11, 14]
