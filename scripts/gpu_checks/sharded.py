"""dp_shard on one rank: what a one-process world can run of sharded data parallelism.

``parallelize`` takes ``dp_shard=S`` > 1 only when S divides dp, so a world of one process (dp=1) has only
``dp_shard=1``, which is plain data parallelism (no FSDP): the first row records the refusal. What one rank
can still run is qn_hf's own FSDP2 setup (qn_hf/data_parallel/sharded.py: a group per block and one for the
root, summed gradients, FSDP's mixed-precision policy) on a one-rank mesh, driven by hand on the plain model:
its hooks, dtypes and reductions over a group of one, against the same model unsharded.
"""

from __future__ import annotations

import copy

import torch

from .common import FIRST_LOSS_RTOL, LOSS_RTOL, WEIGHT_ATOL, build, llama_config, release, row
from .common import device as this_device


def sharded_one_rank(*, quick: bool) -> list[dict]:
    """parallelize refuses dp_shard > 1 at dp=1 (its row says why); what one rank can run: qn_hf's FSDP2 groups
    (data_parallel/sharded.py, one per block and the root, summed gradients) on a one-rank mesh, driven by hand,
    one SGD step against the plain model: float32 (equal) and bf16 (FSDP's bf16 compute, float32 shards and
    reduction, against the plain model under autocast)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from qn_hf.config.parallel_config import ParallelConfig
    from qn_hf.data_parallel.sharded import ShardedParameters

    device = this_device()
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        ParallelConfig.from_keywords(dp=dist.get_world_size(), dp_shard=2)
        refusal = "accepted"
    except ValueError as e:
        refusal = str(e).splitlines()[0]
    rows = [row("dp_shard", "parallelize(dp_shard=2) in a world of 1", "skipped", f"needs dp >= 2 ranks: {refusal}")]
    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("dp_shard",))
    config = llama_config(big=False, seq=64)
    ids = torch.randint(3, config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0)).to(device)
    for precision in (None, torch.bfloat16):
        ref = build(config, device)
        model = copy.deepcopy(ref)
        ShardedParameters(model, mesh=mesh, blocks=list(model.model.layers), compute_dtype=precision)
        lr = 1.0 if precision is None else 0.1
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision is not None):
            ref_loss = ref(input_ids=ids, labels=ids).loss
        loss = model(input_ids=ids, labels=ids).loss
        for m, value in ((ref, ref_loss), (model, loss)):
            value.backward()
            torch.optim.SGD(m.parameters(), lr=lr).step()
        start = build(config, device)
        refs, starts = dict(ref.named_parameters()), dict(start.named_parameters())
        diffs, moved = [], []
        for n, p in model.named_parameters():
            whole = p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()
            diffs.append((whole - refs[n].detach()).abs().max().item())
            moved.append((refs[n].detach() - starts[n].detach()).abs().max().item())
        loss_err = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
        err, distance = max(diffs), max(moved)
        if precision is None:  # float32: equal, as every parity case
            name, result = "float32", "equal" if loss_err <= LOSS_RTOL and err <= WEIGHT_ATOL else "different"
        else:  # bf16 rounding on both sides, differently: within a few % of the distance moved
            name, result = "bf16", "ok" if loss_err <= FIRST_LOSS_RTOL and err <= 0.05 * distance else "failed"
        rows.append(row("dp_shard", f"FSDP2 groups on a 1-rank mesh, {name}", result,
                        f"loss rel {loss_err:.1e}, max weight diff {err:.1e} (moved {distance:.1e})",
                        loss_err=loss_err, weight_err=err, moved=distance))
        del ref, model, start
        release(device)
    return rows

