"""Single-rank timings of compute (``calibrate.py`` runs them on every rank at once): a matrix
product, attention, a chain of a layer's elementwise ops, the optimizer's step, and a stack of pre-norm MLP
blocks timed whole, whose time against the sum of its parts' (``block_prediction``) is the
calibration's ``compute_scale``:
what composing kernels into a model's step costs beyond the kernels alone (caches evicted between
them, autograd's bookkeeping, allocation), which no single-kernel timing sees.

A timing is the median of samples after a warm-up; a sample repeats its call for ``SAMPLE_S`` so the
clock and Python's loop do not count; CUDA is synchronized before the clock is read.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..memory.offload import ActivationOffload
from .allocations import count_ops
from .calibration import Fit

CHAIN = 8  # rounds of a layer's elementwise ops in the op timing
SAMPLE_S = 0.01  # a compute sample repeats its call this long (3 ms samples varied 3x on a shared VM)
BLOCKS = 4  # pre-norm MLP blocks in the composed timing


def sync(device: torch.device) -> None:
    if device.type == "cuda":  # the clock is read after the device's work, not its launch
        torch.cuda.synchronize(device)


def _calls_per_sample(fn: Callable[[], object], device: torch.device) -> int:
    """A warm-up call, then a timed one that sizes the samples to ``SAMPLE_S``."""
    fn()
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return max(1, min(1000, int(SAMPLE_S / max(time.perf_counter() - start, 1e-9))))


def seconds_in_turn(fns: Sequence[Callable[[], object]], device: torch.device, *, repeats: int) -> list[float]:
    """Median seconds of one call of each of ``fns`` on this rank: ``repeats`` samples each (a
    sample: as many calls as fill ``SAMPLE_S``), the functions' samples taken in turn. Taken one
    function after another, a slow minute of this shared VM fell on a few neighbouring points of
    the matmul grid and halved their rates (44 against 89 GFLOP/s, an hour apart); in turn, it
    falls on one sample of each, and the median drops it."""
    calls = [_calls_per_sample(fn, device) for fn in fns]
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, n, taken in zip(fns, calls, samples):
            start = time.perf_counter()
            for _ in range(n):
                fn()
            sync(device)
            taken.append((time.perf_counter() - start) / n)
    return [statistics.median(taken) for taken in samples]


def seconds_per_call(fn: Callable[[], object], device: torch.device, *, repeats: int) -> float:
    """Median seconds of one call of ``fn`` (``seconds_in_turn`` of one function)."""
    return seconds_in_turn([fn], device, repeats=repeats)[0]


def matmul_call(rows: int, width: int, dtype: torch.dtype, device: torch.device) -> Callable[[], object]:
    """``x @ w.T`` forward and both backward products (6 x rows x width^2 FLOPs)."""
    x = torch.randn(rows, width, dtype=dtype, device=device, requires_grad=True)
    w = torch.randn(width, width, dtype=dtype, device=device).div_(width**0.5).requires_grad_()
    grad = torch.ones(rows, width, dtype=dtype, device=device)
    # autograd.grad returns the gradients rather than accumulating them: only the three products run
    return lambda: torch.autograd.grad(x @ w.T, (x, w), grad)


def matmul_seconds(rows: int, width: int, dtype: torch.dtype, device: torch.device, repeats: int) -> float:
    return seconds_per_call(matmul_call(rows, width, dtype, device), device, repeats=repeats)


GROUPS = 8  # experts in the grouped-product timing


def grouped_call(rows: int, width: int, dtype: torch.dtype, device: torch.device) -> Callable[[], object]:
    """A routed experts' product as transformers' ``grouped_mm`` experts run it
    (``torch._grouped_mm`` of the tokens by each expert's transposed ``[out, in]`` weight), forward
    and both backward products, ``GROUPS`` experts of ``width x width`` receiving ``rows`` tokens
    each on average (6 x GROUPS x rows x width^2 FLOPs). The counts are drawn as uniform routing
    draws them, unequal (a seeded multinomial), as a step's are: at 32 rows an expert, equal counts
    ran 57 GFLOP/s and a step's experts about 40 on this CPU."""
    counts = torch.multinomial(torch.ones(GROUPS), GROUPS * rows, replacement=True,
                               generator=torch.Generator().manual_seed(0)).bincount(minlength=GROUPS)
    offs = counts.cumsum(0).to(device=device, dtype=torch.int32)
    x = torch.randn(GROUPS * rows, width, dtype=dtype, device=device, requires_grad=True)
    w = torch.randn(GROUPS, width, width, dtype=dtype, device=device).div_(width**0.5).requires_grad_()
    grad = torch.ones(GROUPS * rows, width, dtype=dtype, device=device)
    return lambda: torch.autograd.grad(torch._grouped_mm(x, w.transpose(-2, -1), offs=offs), (x, w), grad)


def attention_call(seq: int, *, heads: int, head_dim: int, dtype: torch.dtype,
                   device: torch.device) -> Callable[[], object]:
    """Causal ``scaled_dot_product_attention``, forward and backward, one sequence of ``seq``."""
    q, k, v = (torch.randn(1, heads, seq, head_dim, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
    grad = torch.ones(1, heads, seq, head_dim, dtype=dtype, device=device)
    return lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), grad)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """As Hugging Face's models write it (Llama's, Qwen's): ops autograd differentiates one by one."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _elementwise(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``CHAIN`` rounds of what a transformer's layer runs besides its products, written as Hugging
    Face writes it: the norm, rotary embedding, a gated activation, the residual add."""
    for _ in range(CHAIN):
        h = _rms_norm(x, weight)
        r = h * cos + _rotate_half(h) * sin
        x = x + F.silu(r) * h
    return x


def elementwise_call(rows: int, width: int, device: torch.device) -> tuple[int, int, Callable[[], object]]:
    """``_elementwise`` forward and backward on ``rows x width`` float32, with the ops it runs and the
    bytes they write as the planner's trace counts a forward's (``trace.count_ops``). A chain of
    plain multiplies and adds (whose backward is one op or none) ran twice as fast per byte as
    this, and priced a model's other ops at half their time."""
    x = torch.randn(rows, width, device=device, requires_grad=True)
    weight = torch.ones(width, device=device, requires_grad=True)
    cos, sin = torch.randn(rows, width, device=device), torch.randn(rows, width, device=device)
    grad = torch.ones(rows, width, device=device)
    ops, nbytes = count_ops(lambda: _elementwise(x, weight, cos, sin))
    return ops, nbytes, lambda: torch.autograd.grad(_elementwise(x, weight, cos, sin), (x, weight), grad)


def attention_flops(seq: int, *, heads: int, head_dim: int) -> float:
    return 12.0 * heads * head_dim * seq * seq  # the planner's: 12 x hidden x seq per token


class _Block(nn.Module):
    """A pre-norm gated MLP block as Hugging Face's Llama writes one: ``x + down(silu(gate(n)) * up(n))``,
    ``n`` the norm of ``x``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.Parameter(torch.ones(width))
        self.gate, self.up = nn.Linear(width, 2 * width, bias=False), nn.Linear(width, 2 * width, bias=False)
        self.down = nn.Linear(2 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = _rms_norm(x, self.norm)
        return x + self.down(F.silu(self.gate(n)) * self.up(n))


def _blocks(rows: int, width: int, dtype: torch.dtype, device: torch.device) -> Callable[[], torch.Tensor]:
    """A forward through ``BLOCKS`` blocks (its products' weights: 6 x width^2 each)."""
    blocks = nn.Sequential(*(_Block(width) for _ in range(BLOCKS))).to(device=device, dtype=dtype)
    x = torch.randn(rows, width, dtype=dtype, device=device, requires_grad=True)
    return lambda: blocks(x)


def block_seconds(rows: int, width: int, *, dtype: torch.dtype, device: torch.device, repeats: int) -> float:
    """The blocks forward and backward, whole."""
    forward = _blocks(rows, width, dtype, device)
    return seconds_per_call(lambda: forward().sum().backward(), device, repeats=repeats)


def block_prediction(rows: int, width: int, *, rate: float, op: Fit, ops: int, nbytes: int) -> float:
    """The same blocks priced as the time model prices a step (cost.py): the products' FLOPs
    (forward and backward) at ``rate`` (the table's for the model's width), and the forward's
    ``ops`` writing ``nbytes`` (``trace.count_ops``) at the op fit."""
    products = BLOCKS * 6.0 * rows * 6 * width * width / rate
    return products + op.seconds(nbytes, calls=ops)


def composed_ratios(rows: int, width: int, *, dtype: torch.dtype, device: torch.device, op: Fit,
                    pairs: int) -> list[float]:
    """The composed blocks' time over their prediction, once per pair of timings taken back to back:
    the blocks whole, then the product at their shape. Measured minutes apart (the blocks against the
    table), the ratio followed the machine's speed in between: two calibrations of this shared VM an
    hour apart gave 0.98 and 1.71, where steps timed alone matched 1.0 within 5%."""
    ops, nbytes = count_ops(_blocks(rows, width, dtype, device))
    ratios = []
    for _ in range(pairs):
        whole = block_seconds(rows, width, dtype=dtype, device=device, repeats=1)
        product = matmul_seconds(rows, width, dtype, device, repeats=1)
        rate = 6.0 * rows * width * width / product
        ratios.append(whole / block_prediction(rows, width, rate=rate, op=op, ops=ops, nbytes=nbytes))
    return ratios


def optimizer_call(tensors: int, numel: int, *, device: torch.device) -> Callable[[], object]:
    """One ``torch.optim.AdamW`` step (torch's default implementation for the device) over
    ``tensors`` float32 parameters of ``numel`` elements, each with a gradient."""
    params = [torch.randn(numel, device=device).requires_grad_() for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    return torch.optim.AdamW(params, lr=1e-6).step


def offload_call(numel: int, *, device: torch.device) -> Callable[[], object]:
    """A block input of ``numel`` float32 elements to the host and back as ``offload="activations"`` moves it
    (``ActivationOffload.round_trip``: its own copies, streams and events)."""
    offload, saved = ActivationOffload(), torch.randn(numel, device=device).requires_grad_() * 1.0  # autograd's
    return lambda: offload.round_trip(saved)
