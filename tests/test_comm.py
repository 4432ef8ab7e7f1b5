"""Each autograd collective on its own: forward value and backward value on a world of 2."""

from __future__ import annotations

import torch
import torch.distributed as dist

from qn_hf.comm import copy_to_group, flat_all_reduce_, flat_broadcast_, gather_from_group, reduce_from_group, split_to_group


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
    for rank, results in enumerate(worlds.run(2, "tests.test_comm:case_primitives")):
        failed = [name for name, ok in results.items() if not ok]
        assert not failed, f"rank {rank}: {failed}"
