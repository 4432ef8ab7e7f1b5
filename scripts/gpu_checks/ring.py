"""Ring attention's CUDA kernels, without a ring: context parallelism's per-block attention and log-sum-exp merge
(qn_hf/context_parallel/kernels.py and ring_attention.py), forward and backward, for every simulated rank of a
cp=2 and a cp=4 ring in one process, against float32 attention of the whole sequence.

``simulated_ring`` runs the ring's own step functions (``ring_attention.attend_block`` and
``attend_block_backward``: each ring step's kernel calls, masks and log-sum-exp merges) for every simulated
rank; only the point-to-point transfers are replaced by indexing the pieces each simulated rank holds. On a GPU that is flash attention for
unmasked 16-bit blocks and memory-efficient attention otherwise; on the CPU torch's CPU flash kernel.
"""

from __future__ import annotations

import torch

from .common import device as this_device
from .common import release, row

# the ring's error may reach twice eager attention's in that dtype, and these floors (a wrong mask or merge
# is off by O(1): the floors only keep rounding from failing a case)
RING_FLOOR = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def visible_keys(documents: torch.Tensor, valid: torch.Tensor, window: int | None) -> torch.Tensor:
    """[b, queries, keys]: causal, within a document, valid keys only, and ``key > query - window``."""
    at = torch.arange(documents.shape[1], device=documents.device)
    seen = (documents[:, :, None] == documents[:, None, :]) & valid[:, None, :].bool() & (at[None, :] <= at[:, None])
    return seen & (at[None, :] > at[:, None] - window) if window is not None else seen


def attention(q, k, v, grad_out, visible, scaling: float, dtype: torch.dtype):
    """Attention of the whole sequence as transformers' eager attention computes it in ``dtype`` (products in
    ``dtype``, softmax in float32), and the q, k, v gradients of ``grad_out``; float32 throughout for the
    reference. A row that sees no key gives zeros."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    scores = (q @ k.repeat_interleave(group, 1).transpose(-1, -2) * scaling).float()
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    lse = scores.logsumexp(dim=-1, keepdim=True)
    probs = (scores - lse.masked_fill(lse == float("-inf"), 0.0)).exp().to(dtype)
    out = probs @ v.repeat_interleave(group, 1)
    out.backward(grad_out.to(dtype))
    return out.detach().float(), [t.grad.float() for t in (q, k, v)]


def simulated_ring(q, k, v, grad_out, documents, valid, *, cp: int, window: int | None, scaling: float):
    """What ring attention computes on ``cp`` ranks, in one process: each simulated rank runs the ring's own
    step functions (``attend_block`` forward, ``attend_block_backward`` backward) over the block each ring step
    hands it, its transfers replaced by indexing the pieces; each block's key and value gradient is the sum of
    every rank's share, as the ring's travelling accumulator adds them. Returns the output and the q, k, v
    gradients in the sequence's order, and the kernels the blocks can call (unmasked, masked)."""
    from qn_hf.context_parallel.kernels import NEG_INF, kernels
    from qn_hf.context_parallel.ring_attention import (
        Attending,
        PieceLayout,
        attend_block,
        attend_block_backward,
        backward_inputs,
        needs_mask,
    )

    layout, length = PieceLayout(size=cp), q.shape[2]
    masked = needs_mask(documents=documents, valid=valid)
    held = [layout.positions(r, length, device=q.device) for r in range(cp)]
    qs, ks, vs, gs = ([t[:, :, at] for at in held] for t in (q, k, v, grad_out))
    blocks = [torch.stack([ks[r], vs[r]]) for r in range(cp)]
    rule = Attending(layout=layout, documents=documents, valid=valid, masked=masked, scaling=scaling, window=window)
    used = sorted({getattr(f, "__name__", repr(f)).strip("_") for m in (False, True) for f in kernels(q, masked=m)})
    outs = []
    grads = [[torch.zeros(t.shape, dtype=torch.float32, device=q.device) for t in ts] for ts in (qs, ks, vs)]
    for rank in range(cp):
        out = torch.zeros(qs[rank].shape, dtype=torch.float32, device=q.device)
        lse = torch.full(qs[rank].shape[:3], NEG_INF, dtype=torch.float32, device=q.device)
        for step in range(cp):  # the block this rank holds at each ring step is the owner's
            attend_block(qs[rank], blocks[(rank - step) % cp], out, lse, rank=rank, owner=(rank - step) % cp, rule=rule)
        out = out.to(q.dtype)
        outs.append(out)
        go, lse = backward_inputs(gs[rank], lse, masked=masked)
        for step in range(cp):
            owner = (rank - step) % cp
            for cols, grad_k, grad_v in attend_block_backward(go, qs[rank], blocks[owner], out, lse, grads[0][rank],
                                                              rank=rank, owner=owner, rule=rule):
                grads[1][owner][:, :, cols] += grad_k
                grads[2][owner][:, :, cols] += grad_v

    def whole(parts: list[torch.Tensor]) -> torch.Tensor:
        full = parts[0].new_empty(*parts[0].shape[:2], length, parts[0].shape[3])
        for at, part in zip(held, parts):
            full[:, :, at] = part
        return full.float()

    return whole(outs), [whole(g) for g in grads], sorted(used)


def ring_cases(batch: int, length: int, window: int, device: torch.device) -> dict:
    """(documents, valid, window) per case: causal; packed documents with right and left padding; a window."""
    zeros = torch.zeros(batch, length, dtype=torch.long, device=device)
    ones = torch.ones_like(zeros)
    documents, valid = zeros.clone(), ones.clone()
    a, b = length // 3, length // 2 + 5  # row 0: three documents, the last padded at its end
    documents[0, a:], documents[0, b:] = 1, 2
    valid[0, length - length // 8:] = 0
    valid[1, : length // 16 + 1] = 0  # row 1: left padding, then two documents
    documents[1, length // 2 - 3:] = 1
    return {"causal": (zeros, ones, None), "packed+padding": (documents, valid, None), "window": (zeros, ones, window)}


def ring_kernels(*, quick: bool) -> list[dict]:
    """One row per ring size, case and dtype: the largest error of the output and (relative to the largest
    gradient) of the q, k, v gradients, against float32 attention; within twice eager attention's error in that
    dtype, or the dtype's floor. A kernel that raises gives an error row, and the others still run."""
    device = this_device()
    gpu = device.type == "cuda"
    if gpu:  # float32 means float32 on both sides
        torch.backends.cuda.matmul.allow_tf32 = False
    big = gpu and not quick
    batch, heads, kv_heads, dim, length, window = (2, 8, 2, 64, 4096, 1000) if big else (2, 4, 2, 16, 64, 11)
    dtypes = (torch.bfloat16, torch.float16, torch.float32) if gpu else (torch.float32, torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    q, grad_out = (torch.randn(batch, heads, length, dim, generator=gen) for _ in range(2))
    k, v = (torch.randn(batch, kv_heads, length, dim, generator=gen) for _ in range(2))
    scaling = dim**-0.5
    rows = []
    for case, (documents, valid, win) in ring_cases(batch, length, window, device).items():
        visible = visible_keys(documents, valid, win)
        for dtype in dtypes:
            qd, kd, vd, gd = (t.to(device, dtype) for t in (q, k, v, grad_out))
            ref_out, ref_grads = attention(qd, kd, vd, gd, visible, scaling, torch.float32)
            eager_out, eager_grads = attention(qd, kd, vd, gd, visible, scaling, dtype)

            def errors(out, grads):
                grad_err = max(((g - r).abs().max() / r.abs().max().clamp_min(1e-12)).item()
                               for g, r in zip(grads, ref_grads))
                return (out - ref_out).abs().max().item(), grad_err

            eager_err = errors(eager_out, eager_grads)
            tol = [max(2 * e, RING_FLOOR[dtype]) for e in eager_err]
            name = str(dtype).removeprefix("torch.")
            for cp in (2, 4):
                try:
                    out, grads, used = simulated_ring(qd, kd, vd, gd, documents, valid, cp=cp, window=win,
                                                      scaling=scaling)
                except RuntimeError as e:  # a kernel refused these inputs: the case fails, the others run
                    rows.append(row("ring kernels", f"cp={cp} {case} {name}", "error", str(e).splitlines()[0][:200]))
                    continue
                err = errors(out, grads)
                ok = all(e <= t for e, t in zip(err, tol))  # NaN compares False: fails
                rows.append(row("ring kernels", f"cp={cp} {case} {name}", "ok" if ok else "failed",
                                f"out {err[0]:.1e} (tol {tol[0]:.0e}), grads {err[1]:.1e} rel (tol {tol[1]:.0e}); "
                                f"eager {name} {eager_err[0]:.1e}/{eager_err[1]:.1e}; {', '.join(used)}",
                                out_err=err[0], grad_err=err[1], tol=tol, eager_err=eager_err, kernels=used,
                                shape=[batch, heads, kv_heads, length, dim], window=win))
            ref_out = ref_grads = eager_out = eager_grads = None  # the device memory back before the next case
            release(device)
    return rows

