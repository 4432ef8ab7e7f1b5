"""The first step's proof that every replicated parameter gets the same gradient on each tp rank.

A parameter kept whole under tensor parallelism (a norm, a router, an activation's learnable
scalars) must end each step with the gradient the plain model gives it. If it sees only this rank's
share of the activations (per-head norms after a column-parallel projection, an activation between
column and row-parallel layers) its gradient is partial, differs from rank to rank, and training
would go silently wrong unless a rule sums it (``replicate_grad_sum``). A plan cannot always see
that from the module tree, so the first synchronized gradients are checked instead: two checksums
per replicated parameter, one all-reduce for their maximum and one for their minimum over tp. A
gradient that is full on every rank is computed from identical inputs by identical code, so the
checksums agree to the last bits; a partial one differs at the first digit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

# Relative spread of a checksum over tp ranks above which a gradient counts as partial. Full
# gradients agree to rounding (bit for bit on CPU; a nondeterministic GPU kernel or bf16 may move
# the last bits); partial ones differ by O(1).
REL_TOL = 1e-3


def check_replicated_grads(grads: dict[str, torch.Tensor], *, group: ProcessGroup) -> None:
    """Raise ``ValueError`` on every rank of the job if any gradient in ``grads`` (replicated
    parameters' synchronized gradients, the same names in the same order on every rank of the tp
    ``group``) differs between the ranks of ``group``. Every rank must call it (once)."""
    if dist.get_world_size(group) == 1:
        return
    bad: list[str] = []
    if grads:
        sums = torch.stack([torch.stack([g.double().sum(), g.double().abs().sum()]) for g in grads.values()])
        high, low = sums.clone(), -sums
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(low, op=dist.ReduceOp.MAX, group=group)
        spread = (high + low).abs().amax(dim=1)  # max - min, per parameter
        scale = torch.maximum(high.abs(), low.abs()).amax(dim=1).clamp_min(1e-30)
        bad = [name for name, s, m in zip(grads, spread.tolist(), scale.tolist()) if s > REL_TOL * m]
    # Only the stages holding such a parameter see it: every rank learns of it, so all raise together.
    found: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(found, bad)
    bad = sorted({name for names in found for name in names})
    if bad:
        raise ValueError(
            f"{len(bad)} replicated parameter(s) get a different gradient on each tp rank (e.g. {bad[:3]}): they see "
            f"only this rank's share of the activations, so training would differ from the plain model. Add a "
            f"'replicate_grad_sum' rule for them to the policy (transformers' name: replicated_with_grad_allreduce), "
            f"or use tp=1")
