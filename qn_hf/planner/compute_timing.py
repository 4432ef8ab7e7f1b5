"""Single-rank timings of compute (``calibrate.py`` runs them on every rank at once): a matrix
product, attention, a chain of elementwise ops, and a stack of pre-norm MLP blocks timed whole, whose
time against the sum of its parts' (``block_prediction``) is the calibration's ``compute_scale``:
what composing kernels into a model's step costs beyond the kernels alone (caches evicted between
them, autograd's bookkeeping, allocation), which no single-kernel timing sees.

A timing is the median of samples after a warm-up; a sample repeats its call for ``SAMPLE_S`` so the
clock and Python's loop do not count; CUDA is synchronized before the clock is read.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .calibration import Fit, MatmulTable

CHAIN = 64  # elementwise ops per chain
SAMPLE_S = 0.01  # a compute sample repeats its call this long (3 ms samples varied 3x on a shared VM)
BLOCKS = 4  # pre-norm MLP blocks in the composed timing
OPS_PER_BLOCK = 3  # besides its two products: the norm, the activation, the residual add


def sync(device: torch.device) -> None:
    if device.type == "cuda":  # the clock is read after the device's work, not its launch
        torch.cuda.synchronize(device)


def seconds_per_call(fn: Callable[[], object], device: torch.device, *, repeats: int) -> float:
    """Median seconds of one call of ``fn`` on this rank: a warm-up, a timed call that sizes the
    samples, then ``repeats`` samples of as many calls as fill ``SAMPLE_S``."""
    fn()
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    calls = max(1, min(1000, int(SAMPLE_S / max(time.perf_counter() - start, 1e-9))))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync(device)
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def matmul_seconds(rows: int, width: int, dtype: torch.dtype, device: torch.device, repeats: int) -> float:
    x = torch.randn(rows, width, dtype=dtype, device=device, requires_grad=True)
    w = torch.randn(width, width, dtype=dtype, device=device).div_(width**0.5).requires_grad_()
    grad = torch.ones(rows, width, dtype=dtype, device=device)
    # autograd.grad returns the gradients rather than accumulating them: only the three products run
    return seconds_per_call(lambda: torch.autograd.grad(x @ w.T, (x, w), grad), device, repeats=repeats)


def attention_seconds(seq: int, *, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                      repeats: int) -> float:
    """Causal ``scaled_dot_product_attention``, forward and backward, one sequence of ``seq``."""
    q, k, v = (torch.randn(1, heads, seq, head_dim, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
    grad = torch.ones(1, heads, seq, head_dim, dtype=dtype, device=device)
    return seconds_per_call(lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True),
                                                        (q, k, v), grad), device, repeats=repeats)


def chain_seconds(numel: int, device: torch.device, repeats: int) -> float:
    """Seconds per elementwise op (forward and backward) of a chain of ``CHAIN``."""
    x = torch.randn(numel, device=device, requires_grad=True)
    grad = torch.ones(numel, device=device)

    def chain() -> None:
        y = x
        for i in range(CHAIN):
            y = y * 1.0001 if i % 2 == 0 else y + 0.5
        torch.autograd.grad(y, x, grad)

    return seconds_per_call(chain, device, repeats=repeats) / CHAIN


def attention_flops(seq: int, *, heads: int, head_dim: int) -> float:
    return 12.0 * heads * head_dim * seq * seq  # the planner's: 12 x hidden x seq per token


def _blocks(width: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
    layers = []
    for _ in range(BLOCKS):
        layers.append(nn.ModuleList([nn.LayerNorm(width), nn.Linear(width, 4 * width, bias=False),
                                     nn.Linear(4 * width, width, bias=False)]))
    return nn.ModuleList(layers).to(device=device, dtype=dtype)


def block_seconds(rows: int, width: int, *, dtype: torch.dtype, device: torch.device, repeats: int) -> float:
    """``BLOCKS`` blocks ``x + W2(gelu(W1(norm(x))))`` as modules, forward and backward, whole."""
    blocks = _blocks(width, dtype, device)
    x = torch.randn(rows, width, dtype=dtype, device=device, requires_grad=True)

    def step() -> None:
        y = x
        for norm, up, down in blocks:
            y = y + down(F.gelu(up(norm(y))))
        y.sum().backward()

    return seconds_per_call(step, device, repeats=repeats)


def block_prediction(rows: int, width: int, *, matmul: MatmulTable, op: Fit, element_size: int) -> float:
    """The same blocks priced as the time model prices a step (cost.py): each product at the table's
    rate for its shape (the width the model's), each other op at the op fit for the bytes it writes."""
    products = 2 * 6.0 * rows * width * 4 * width / matmul.rate(rows, width)
    written = rows * width * element_size * (1 + 4 + 1)  # the norm's output, the activation's, the sum's
    return BLOCKS * (products + op.seconds(written, calls=OPS_PER_BLOCK))
