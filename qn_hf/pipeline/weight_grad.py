"""Split backward for linear layers (ZB-H1): the input gradient in B, the weight gradient in a later W.

In ZB-H1 a microbatch's backward B is on the pipeline's critical path and computes only what the
previous stage waits for; the weight gradients of the linear layers (``dW = g^T x``, half of a
linear's backward FLOPs) run later, in a W action, filling the bubble. Every other parameter (norms,
embeddings, heads passed in ``skip``, tied weights) gets its gradient in B as usual. A linear's tp
collectives act on its input and output only, never on the weight gradient, so W communicates nothing.

How one deferrable projection ``y = x @ W (+ b)`` is built (``project`` with a queue):

* ``x`` passes through ``_SaveInput`` (identity both ways), whose node saves ``x`` for W: it is saved
  *before* the product, like the input autograd's own ``mm`` saves, so full recomputation can still
  stop before a block's last product;
* the product runs on ``W.detach()`` (and ``b.detach()``) in grad mode: autograd computes the input
  gradient exactly as for the plain layer and nothing for the weight, and selective recomputation
  sees (and keeps) the product as it does the plain layer's;
* a pre-hook on the product's own autograd node receives the output gradient ``g``. With
  ``queue.open`` set it queues ``(x, g)`` under that key; with ``queue.open`` None it computes the
  weight gradients at once (a nested backward from inside the running one, as reentrant checkpointing
  does). Either way they are handed to autograd as gradients of the leaf Parameters
  (``torch.autograd.backward(params, grads)``): AccumulateGrad runs, so ``.grad``
  accumulation, ``grad_dtype`` (float32 gradients of bfloat16 weights) and post-accumulate-grad hooks
  (the dp buckets) behave exactly as in a plain backward, once per parameter per ``run``.

The weights are deliberately *not* inputs of any node of the graph: an input whose gradient a node
returns as None still gets its AccumulateGrad run, and its post-accumulate-grad hooks fire with
``.grad`` None (torch 2.13), which would tell the dp buckets a gradient is ready in B.

The queue is an object the layers hold, read in backward, not thread-local state: on CUDA autograd
runs backward functions on a device thread.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D


@dataclass(frozen=True)
class _Deferred:
    """One projection's deferred weight gradient: its input and output gradient, both 2-D."""

    weight: nn.Parameter
    bias: nn.Parameter | None
    x: torch.Tensor
    grad: torch.Tensor
    conv1d_layout: bool

    def gradients(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        # The same products autograd's mm backward takes for each layout (so the results are bit-equal):
        # nn.Linear's W [out, in] is the transposed operand (g^T x); Conv1D's W [in, out] is not (x^T g).
        out = []
        if self.weight.requires_grad:
            dw = self.x.t().mm(self.grad) if self.conv1d_layout else self.grad.t().mm(self.x)
            out.append((self.weight, dw))
        if self.bias is not None and self.bias.requires_grad:
            out.append((self.bias, self.grad.sum(0)))
        return out


def _accumulate(entries: list[_Deferred]) -> None:
    """Sum ``entries``' gradients per parameter and accumulate them through autograd, one call for all
    (so each parameter's post-accumulate-grad hook fires once)."""
    summed: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}
    with torch.no_grad():
        for entry in entries:
            for param, grad in entry.gradients():
                seen = summed.get(id(param))
                summed[id(param)] = (param, grad if seen is None else seen[1] + grad)
    if summed:
        params, grads = zip(*summed.values())
        torch.autograd.backward(list(params), grad_tensors=list(grads))


class WeightGradQueue:
    """Deferred weight-gradient work, keyed by the executor's (chunk, microbatch).

    The executor sets ``open`` to a key around a backward whose W is scheduled (None otherwise: the
    deferrable layers then produce their weight gradients in the backward, as plain layers do) and
    calls ``run(key)`` for the W action.
    """

    def __init__(self) -> None:
        self.open: Hashable | None = None
        self._work: dict[Hashable, list[_Deferred]] = {}

    def defer(self, key: Hashable, entry: _Deferred) -> None:
        self._work.setdefault(key, []).append(entry)

    def run(self, key: Hashable) -> None:
        """Compute and accumulate every weight gradient queued under ``key``. A key with nothing
        queued is fine: a chunk may hold no deferrable layer."""
        _accumulate(self._work.pop(key, []))

    def pending(self) -> list[Hashable]:
        """Keys with queued work (empty at the end of a step)."""
        return list(self._work)

    def clear(self) -> None:
        """Drop queued work and the inputs it keeps alive (after a failed step)."""
        self._work.clear()
        self.open = None


class _SaveInput(torch.autograd.Function):
    """Identity forward, identity backward; its node saves the input for the deferred weight gradient.
    ``anchor`` (an empty tensor needing a gradient) puts the node in the graph when ``x`` needs none."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, anchor: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (grad if ctx.needs_input_grad[0] else None), None


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, conv1d_layout: bool,
            queue: WeightGradQueue | None = None) -> torch.Tensor:
    """``x @ W (+ b)`` in nn.Linear's (``[out, in]``) or Conv1D's (``[in, out]``) layout. With a
    ``queue`` the weight gradients go through it (see the module docstring); forward and input gradient
    stay bit-equal to ``F.linear`` / Conv1D's ``addmm`` (on inputs whose leading dims flatten in place)."""
    needs = weight.requires_grad or (bias is not None and bias.requires_grad)
    if queue is None or not (torch.is_grad_enabled() and needs):
        return _plain_project(x, weight, bias, conv1d_layout=conv1d_layout)
    return _deferred_project(x, weight, bias, conv1d_layout=conv1d_layout, queue=queue)


# Eager under torch.compile (a graph break around each deferring projection of a compiled block): dynamo
# cannot trace a hook registered on an autograd node, nor AOTAutograd a backward that queues its inputs
# for a later nested one. The rest of the block compiles; the projection's own kernels are the plain ones.
@torch.compiler.disable
def _deferred_project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, conv1d_layout: bool,
                      queue: WeightGradQueue) -> torch.Tensor:
    anchor = None if x.requires_grad else x.new_empty(0).requires_grad_()
    saved = _SaveInput.apply(x, anchor)
    # The product is taken on 2-D operands so that the hooked node is the product itself, not a view
    # of it: an in-place op on the output rebases a view's node out of the graph, not the product's.
    y2 = _product(saved.reshape(-1, x.shape[-1]), weight.detach(), None if bias is None else bias.detach(),
                  conv1d_layout=conv1d_layout)
    source = saved.grad_fn

    def on_grad(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        grad = grad_outputs[0]
        if grad is None:  # the output got no gradient: neither would the weights
            return
        (x_saved,) = source.saved_tensors
        entry = _Deferred(weight=weight, bias=bias, x=x_saved.detach().reshape(-1, x_saved.shape[-1]),
                          grad=grad.detach(), conv1d_layout=conv1d_layout)
        key = queue.open
        if key is None:
            _accumulate([entry])
        else:
            queue.defer(key, entry)

    y2.grad_fn.register_prehook(on_grad)
    return y2 if x.dim() == 2 else y2.view(*x.shape[:-1], y2.shape[-1])


def _product(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, conv1d_layout: bool) -> torch.Tensor:
    """The one matrix product of a 2-D input (an addmm or mm, never a view)."""
    if not conv1d_layout:
        return F.linear(x2, weight, bias)
    return torch.addmm(bias, x2, weight) if bias is not None else x2 @ weight


def _plain_project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *,
                   conv1d_layout: bool) -> torch.Tensor:
    """nn.Linear's and Conv1D's own forward."""
    if not conv1d_layout:
        return F.linear(x, weight, bias)
    out = _product(x.reshape(-1, x.shape[-1]), weight, bias, conv1d_layout=True)
    return out.view(*x.shape[:-1], weight.shape[1])


class DefersWeightGrad:
    """A projection module that can defer its weight gradient: it holds the queue (None: it does not)
    and names the parameters its projection covers."""

    weight_grad_queue: WeightGradQueue | None = None

    def deferrable_parameters(self) -> list[str]:
        return ["weight"] + (["bias"] if getattr(self, "bias", None) is not None else [])


class DeferrableLinear(DefersWeightGrad, nn.Linear):
    """``nn.Linear`` whose weight gradient can be deferred; an exact nn.Linear becomes one in place
    (same Parameters, names, hooks), so only ``forward`` differs, and only when a queue is held."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_grad_queue is None:
            return super().forward(x)
        return project(x, self.weight, self.bias, conv1d_layout=False, queue=self.weight_grad_queue)


class DeferrableConv1D(DefersWeightGrad, Conv1D):
    """transformers' ``Conv1D`` (``x @ W + b``, W ``[in, out]``) whose weight gradient can be deferred."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_grad_queue is None:
            return super().forward(x)
        return project(x, self.weight, self.bias, conv1d_layout=True, queue=self.weight_grad_queue)


_SWAPS: dict[type, type] = {nn.Linear: DeferrableLinear, Conv1D: DeferrableConv1D}


def make_deferrable(model: nn.Module, *, queue: WeightGradQueue, skip: Collection[str] = ()) -> list[str]:
    """Make ``model``'s linear layers defer their weight gradients to ``queue``; return the names of the
    deferred parameters.

    qn_hf's parallel layers get the queue; exact ``nn.Linear`` and transformers ``Conv1D`` modules have
    their class set to the deferring subclass (subclasses are left alone: their forward may do more).
    Not deferred: modules under a name in ``skip`` (vocab-sized heads, whose output gradient the queue
    would keep for every pending microbatch), modules with a frozen weight, and modules with a parameter
    used by another module too (tied: its gradient must arrive whole, in one pass). A row-parallel layer
    adds its bias after the tp sum, outside the product: that bias keeps its gradient in B.
    """
    users: dict[int, int] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            users[id(param)] = users.get(id(param), 0) + 1
    deferred = []
    for name, module in model.named_modules():
        if any(name == s or name.startswith(s + ".") for s in skip):
            continue
        if not isinstance(module, DefersWeightGrad) and type(module) not in _SWAPS:
            continue
        if not module.weight.requires_grad:
            continue
        params = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if any(users[id(p)] > 1 for p in params):
            continue
        if not isinstance(module, DefersWeightGrad):
            module.__class__ = _SWAPS[type(module)]
        module.weight_grad_queue = queue
        prefix = f"{name}." if name else ""
        deferred += [prefix + n for n in module.deferrable_parameters() if getattr(module, n).requires_grad]
    return deferred
