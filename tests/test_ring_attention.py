"""Ring attention (fused kernels, blocks merged by log-sum-exp) equals plain float64 softmax attention
over the whole sequence: outputs and q/k/v gradients at cp = 2 and 4, both layouts (and a strided
one that needs the explicit causal mask), packed documents, padding, GQA, float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

from qn_hf.context_parallel.kernels import kernels
from qn_hf.context_parallel.ring_attention import PieceLayout, needs_mask, ring_block, ring_blocks
from tests import ring_cases
from tests.ring_cases import StridedLayout, batch_meta

FLOAT32 = 2e-5  # the project's gradient tolerance, relative to the largest reference value
# bfloat16 inputs: the kernel rounds its block outputs and probabilities to bfloat16 (8 bits of
# mantissa, 2**-8 = 0.4%) and the results are bfloat16: a few roundings of that size.
BFLOAT16 = 2e-2

CASES = [  # cp, layout, heads, kv_heads, dtype, packed, padded, force_mask
    (2, "balanced", 4, 2, "float32", False, False, False),  # no mask: the kernel's causal and full blocks
    (2, "contiguous", 4, 4, "float32", False, False, False),
    (2, "balanced", 4, 2, "float32", True, True, False),
    (2, "contiguous", 4, 2, "float32", True, False, False),
    (2, "strided", 4, 2, "float32", False, False, False),  # explicit causal masks without documents
    (2, "balanced", 4, 2, "float32", False, False, True),  # the masked path on a batch that needs none
    (4, "balanced", 4, 2, "float32", False, False, False),
    (4, "balanced", 4, 1, "float32", True, True, False),
    (4, "contiguous", 4, 2, "float32", False, True, False),
    (4, "strided", 4, 2, "float32", True, False, False),
    (2, "balanced", 4, 2, "bfloat16", False, False, False),
    (2, "contiguous", 4, 2, "bfloat16", True, True, False),
    (4, "balanced", 4, 2, "bfloat16", True, True, False),
]


# sliding windows (transformers' key > query - window) shorter than a piece (8 tokens at cp=2, 4 at
# cp=4), across piece borders, and longer than the sequence; Gemma 2's logit softcapping, alone and
# with a window, with packing and padding
WINDOWED = [  # cp, layout, heads, kv_heads, dtype, packed, padded, window, softcap
    (2, "balanced", 4, 2, "float32", False, False, 3, None),
    (2, "balanced", 4, 2, "float32", True, True, 11, None),
    (2, "contiguous", 4, 2, "float32", False, True, 9, None),
    (4, "balanced", 4, 2, "float32", False, False, 6, None),
    (4, "balanced", 4, 1, "float32", True, True, 13, None),
    (4, "strided", 4, 2, "float32", False, False, 5, None),
    (2, "balanced", 4, 2, "float32", False, False, 40, None),
    (2, "balanced", 4, 2, "float32", False, False, None, 0.5),
    (2, "balanced", 4, 2, "float32", True, True, 7, 0.5),
    (4, "contiguous", 4, 2, "float32", False, True, None, 0.5),
    (2, "balanced", 4, 2, "bfloat16", True, True, 7, 0.5),
]
# gpt-oss's attention sinks: with a window, packed and padded (rows that see no key get zeros)
SINKS = [(2, "balanced", 4, 2, "float32", False, False, None), (2, "balanced", 4, 2, "float32", True, True, 7),
         (4, "contiguous", 4, 1, "float32", False, True, 5)]


@pytest.mark.parametrize(("cp", "layout", "heads", "kv_heads", "dtype", "packed", "padded", "force_mask", "window",
                          "softcap", "sinks"),
                         [(*c, None, None, False) for c in CASES] + [(*c[:7], False, *c[7:], False) for c in WINDOWED]
                         + [(*c[:7], False, c[7], None, True) for c in SINKS])
def test_ring_attention_equals_plain_attention(worlds, cp, layout, heads, kv_heads, dtype, packed, padded, force_mask,
                                               window, softcap, sinks):
    results = worlds.run(cp, ring_cases.ring_parity, layout=layout, heads=heads, kv_heads=kv_heads,
                         dtype=dtype, packed=packed, padded=padded, force_mask=force_mask, window=window,
                         softcap=softcap, sinks=sinks)
    tolerance = FLOAT32 if dtype == "float32" else BFLOAT16
    for rank, r in enumerate(results):
        for what in ("out", "q", "k", "v"):
            assert r[what] <= tolerance, (rank, what, r)
        assert r["unseen exactly zero"], (rank, r)
        assert (r["sinks"] is None) is not sinks and (not sinks or r["sinks"] <= tolerance), (rank, r)
    if padded:  # left padding: some queries see no key at all, and they were checked
        assert sum(r["unseen rows"] for r in results) > 0


def _visible(layout: PieceLayout, rank: int, owner: int, piece: int, window: int | None = None) -> set[tuple[int, int]]:
    """(local query, local key) pairs with the key at or before the query (and within the window),
    from global positions."""
    length = 2 * layout.size * piece
    at_q, at_k = layout.positions(rank, length).tolist(), layout.positions(owner, length).tolist()
    return {(i, j) for i, p in enumerate(at_q) for j, s in enumerate(at_k)
            if s <= p and (window is None or s > p - window)}


@pytest.mark.parametrize("window", [None, 1, 2, 3, 4, 7, 100])
@pytest.mark.parametrize("make", [lambda n: PieceLayout(size=n), lambda n: PieceLayout(size=n, balanced=False),
                                  lambda n: StridedLayout(size=n)], ids=["balanced", "contiguous", "strided"])
def test_ring_block_covers_exactly_the_causal_pairs(make, window):
    piece = 3
    for size in range(1, 6):
        layout = make(size)
        for rank in range(size):
            for owner in range(size):
                want = _visible(layout, rank, owner, piece, window)
                plan = ring_block(layout, rank=rank, owner=owner, piece=piece, window=window)
                if plan is None:
                    assert want == set(), (size, rank, owner)
                    continue
                assert want, (size, rank, owner, window)  # a block no query sees is skipped, no kernel call
                rows, cols = range(2 * piece)[plan.queries], range(2 * piece)[plan.keys]
                assert {(i, j) for i, j in want if i not in rows or j not in cols} == set()  # nothing left out
                rect = {(i, j) for i in rows for j in cols}
                if plan.full:
                    assert rect == want, (size, rank, owner)
                if plan.causal:  # the kernel's causal mask: key index (in the call) <= query index
                    assert {(i, j) for i, j in rect if j - cols.start <= i - rows.start} == want, (size, rank, owner)
        if window is not None:
            _check_window_calls(layout, size, piece, window)
            continue
        plans = [ring_block(layout, rank=r, owner=o, piece=piece) for r in range(size) for o in range(size)]
        explicit = [p for p in plans if p is not None and not (p.full or p.causal)]
        # the two real layouts never need a mask without documents or padding; the strided one does
        assert bool(explicit) == (isinstance(layout, StridedLayout) and size > 1), (size, explicit)


def test_needs_mask():
    for packed, padded in [(False, False), (True, False), (False, True), (True, True)]:
        documents, valid = batch_meta(batch=2, seq=16, packed=packed, padded=padded)
        assert needs_mask(documents=documents, valid=valid) == (packed or padded)
    # documents numbered per row from a value other than 0 are still one document
    assert not needs_mask(documents=torch.full((2, 8), 3), valid=torch.ones(2, 8))


@pytest.mark.parametrize(("dtype", "masked", "kernel"), [
    (torch.bfloat16, False, "_scaled_dot_product_flash_attention"),
    (torch.bfloat16, True, "_scaled_dot_product_efficient_attention"),
    (torch.float32, False, "_scaled_dot_product_efficient_attention"),
])
def test_cuda_kernels_take_their_arguments(dtype, masked, kernel):
    """The CUDA kernels cannot run here; on meta tensors torch checks their arguments and gives their
    shapes: a GQA block's gradients come back with the KV heads, the log-sum-exp with the query rows."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    b, heads, kv_heads, rows, cols, d = 2, 4, 2, 24, 40, 16
    q, grad = (torch.empty(b, heads, rows, d, dtype=dtype, device="meta") for _ in range(2))
    k, v = (torch.empty(b, kv_heads, cols, d, dtype=dtype, device="meta") for _ in range(2))
    mask = torch.empty(b, 1, rows, cols, dtype=dtype, device="meta") if masked else None
    with Seen() as seen:
        forward, backward = kernels_for_cuda(q, masked=masked)
        out, lse = forward(q, k, v, False, mask, 0.25)
        dq, dk, dv = backward(grad, q, k, v, out, lse, False, mask, 0.25)
    assert kernel in seen.ops, seen.ops
    assert out.shape == q.shape and lse.shape == (b, heads, rows) and lse.dtype == torch.float32
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


def kernels_for_cuda(q: torch.Tensor, *, masked: bool):
    """``kernels`` as it answers for a CUDA tensor of ``q``'s dtype (the choice reads only the device
    type and dtype)."""

    class OnCuda:
        device = torch.device("cuda")
        dtype = q.dtype

    return kernels(OnCuda, masked=masked)


def _check_window_calls(layout: PieceLayout, size: int, piece: int, window: int) -> None:
    """``ring_blocks`` with a window: one call per piece pair with a visible key, together exactly the
    visible pairs; no mask only where every pair in the call is visible, the causal flag only where
    it is the whole of them."""
    for rank in range(size):
        for owner in range(size):
            want = _visible(layout, rank, owner, piece, window)
            covered = set()
            for plan in ring_blocks(layout, rank=rank, owner=owner, piece=piece, window=window):
                rows, cols = range(2 * piece)[plan.queries], range(2 * piece)[plan.keys]
                rect = {(i, j) for i in rows for j in cols}
                assert rect & want, (size, rank, owner, window)  # no call for a pair no query sees
                covered |= rect & want
                if plan.full:
                    assert rect <= want, (size, rank, owner, window)
                if plan.causal:
                    assert {(i, j) for i, j in rect if j - cols.start <= i - rows.start} == rect & want
            assert covered == want, (size, rank, owner, window)
