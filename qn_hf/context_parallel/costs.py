"""Context parallelism in the planner's meta trace: one cp rank's share of a microbatch, ring
attention stood in for, and the ring's traffic.

Under ``cp`` each rank runs the model on its ``sequence / cp`` tokens (two pieces, ``PieceLayout``)
with the inputs ``shard_microbatch`` prepares: the ids and global ``position_ids`` of those tokens and
the ``[b, 1, 2, sequence]`` document/padding tensor that travels as the ``attention_mask``. The trace
runs the unsharded model on exactly those meta inputs, so everything outside attention has one cp
rank's size, and selects a stand-in for ring attention through transformers' attention interface,
as ``apply_context_parallel`` selects the real one. The stand-in keeps what ``_RingAttention``
keeps for backward: this rank's q, k and v (model dtype), its output (the tensor the call returns,
in the model's dtype) and a float32 log-sum-exp per query row (the document/padding slices it also
keeps are views of the input). The ring's fused kernels run inside the autograd Function, without
grad mode, so selective recomputation caches none of their outputs, and neither does the stand-in.

Each call is reported (``RingCall``) with its keys' shape; ``ring_ops`` turns the calls into the
sends and receives ``CommMeter`` counts on ``"cp"``: per call, forward ``cp - 1`` key/value blocks
(``torch.stack([k, v])``, model dtype), backward ``cp - 1`` blocks and ``cp`` float32 gradient
accumulators of the same shape; one send and one receive each. A recomputed block runs its ring
forward again (``RingCall.rerun``, set by the trace as for tp's row layers).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface

from ..comm_meter import Collective

GRAD_ELEM = 4  # the backward's gradient accumulator travels in float32
_names = itertools.count()


@dataclass(frozen=True)
class RingCall:
    """One ring-attention call of one microbatch, as the unsharded model makes it."""

    module: str  # the attention module; its stage is this module's
    kv_heads: int  # of the unsharded model (tp splits or replicates them)
    block_numel: int  # elements of torch.stack([k, v]) with every KV head
    rerun: bool = False  # recomputation runs this call's forward again (set by the trace)

    def local_numel(self, tp: int) -> int:
        """Elements of one tp rank's block: its KV heads, one when tp replicates them (heads.py)."""
        return self.block_numel // self.kv_heads * max(1, self.kv_heads // tp)


def cp_inputs(*, micro_batch_size: int, seq_len: int, cp: int) -> dict[str, torch.Tensor]:
    """Meta tensors shaped like the inputs ``shard_microbatch`` gives one cp rank."""
    local = seq_len // cp
    return {"input_ids": torch.empty(micro_batch_size, local, dtype=torch.long, device="meta"),
            "position_ids": torch.empty(micro_batch_size, local, dtype=torch.long, device="meta"),
            "attention_mask": torch.empty(micro_batch_size, 1, 2, seq_len, dtype=torch.long, device="meta")}


class _RingStandIn(torch.autograd.Function):
    """Forward: what ring attention allocates and keeps, on meta tensors; no backward (not run)."""

    @staticmethod
    def forward(ctx, q, k, v, documents, valid):
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, documents, valid, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):  # pragma: no cover - the trace runs no backward
        raise NotImplementedError("the planner's ring-attention stand-in has no backward")


class RingStandIn:
    """While entered, ``model`` attends through the stand-in (registered in transformers' attention
    interface under a name of its own, as ``apply_context_parallel`` registers ring attention);
    ``note`` receives every call (its ``module`` left for the caller, which knows what is running)."""

    def __init__(self, model: nn.Module, *, cp: int, note: Callable[[RingCall], None]) -> None:
        self.model, self.note = model, note
        self._previous: str | None = None

    def _attention(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                   **kwargs):
        self.note(RingCall(module="", kv_heads=key.shape[1], block_numel=2 * key.numel()))
        out = _RingStandIn.apply(query, key, value, attention_mask[:, 0, 0], attention_mask[:, 0, -1])
        return out.transpose(1, 2).contiguous(), None

    def __enter__(self) -> RingStandIn:
        name = f"qn_hf_plan_ring_{next(_names)}"
        AttentionInterface.register(name, self._attention)
        self._previous = self.model.config._attn_implementation
        self.model.set_attn_implementation(name)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            self.model.set_attn_implementation(self._previous)


def ring_ops(calls: tuple[RingCall, ...], *, cp: int, tp: int, act_elem: int, recompute: str | None,
             on_stage: Callable[[str], bool]) -> dict[Collective, list[int]]:
    """One microbatch's ring traffic on a stage: op -> [calls, bytes], as ``CommMeter`` counts it."""
    ops = {Collective.SEND: [0, 0], Collective.RECV: [0, 0]}
    for call in calls:
        if not on_stage(call.module):
            continue
        numel = call.local_numel(tp)
        forwards = 2 if recompute is not None and call.rerun else 1
        transfers = [((cp - 1) * forwards, numel * act_elem), (cp - 1, numel * act_elem), (cp, numel * GRAD_ELEM)]
        for op in ops.values():
            op[0] += sum(n for n, _ in transfers)
            op[1] += sum(n * nbytes for n, nbytes in transfers)
    return ops if ops[Collective.SEND][0] else {}
