"""Executing one stage's action list with point-to-point sends and receives.

Sends are asynchronous (``isend``) and waited for at the end of the step, so a stage only ever
blocks on a receive; the schedule tests prove the lists cannot deadlock under exactly that rule.
Each rank talks to the rank with the same (dp, tp) coordinates on the neighbouring stage.
The shape of the activations is sent once per step (a small int64 header before microbatch 0):
every microbatch of a step has the same shape, and the gradient has the activation's shape.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .schedule import Action

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_HEADER = 8  # room for [dtype, ndim, *shape]


@dataclass(frozen=True)
class Peers:
    """Global ranks of the previous and next stage (None at the ends)."""

    prev: int | None
    next: int | None


def _tag(mb: int, kind: int) -> int:
    return 4 * mb + kind  # distinct per microbatch and direction (gloo matches on it; NCCL keeps order)


class StageExecutor:
    """Runs ``forward(mb, received) -> output`` and backward through the action list of one stage.

    On the last stage ``forward`` returns the (scaled) loss of the microbatch; elsewhere the
    activation to send. ``received`` is None on the first stage.
    """

    def __init__(self, *, peers: Peers, device: torch.device) -> None:
        self.peers = peers
        self.device = device

    def run(self, actions: list[Action], forward: Callable[[int, torch.Tensor | None], torch.Tensor]) -> None:
        inputs: dict[int, torch.Tensor] = {}
        outputs: dict[int, torch.Tensor] = {}
        grads: dict[int, torch.Tensor] = {}
        pending: list[dist.Work] = []
        keep_alive: list[torch.Tensor] = []
        shape: tuple[torch.Size, torch.dtype] | None = None
        for action in actions:
            mb = action.mb
            if action.op == "recv_fwd":
                if shape is None:
                    shape = self._recv_header()
                buf = torch.empty(shape[0], dtype=shape[1], device=self.device)
                dist.irecv(buf, src=self.peers.prev, tag=_tag(mb, 1)).wait()
                inputs[mb] = buf.requires_grad_(True)
            elif action.op == "fwd":
                # Without autograd (eval) nothing is kept for a backward: drop inputs as consumed.
                received = inputs.get(mb) if torch.is_grad_enabled() else inputs.pop(mb, None)
                outputs[mb] = forward(mb, received)
            elif action.op == "send_fwd":
                out = (outputs[mb] if torch.is_grad_enabled() else outputs.pop(mb)).detach().contiguous()
                if mb == 0:
                    pending.append(self._send_header(out))
                pending.append(dist.isend(out, dst=self.peers.next, tag=_tag(mb, 1)))
                keep_alive.append(out)
            elif action.op == "recv_bwd":
                buf = torch.empty_like(outputs[mb])
                dist.irecv(buf, src=self.peers.next, tag=_tag(mb, 2)).wait()
                grads[mb] = buf
            elif action.op == "bwd":
                out = outputs.pop(mb)
                torch.autograd.backward(out, grad_tensors=grads.pop(mb, None))
            elif action.op == "send_bwd":
                grad = inputs.pop(mb).grad
                pending.append(dist.isend(grad.contiguous(), dst=self.peers.prev, tag=_tag(mb, 2)))
                keep_alive.append(grad)
            else:
                raise ValueError(f"unknown pipeline action {action}")
        for work in pending:
            work.wait()

    def _send_header(self, out: torch.Tensor) -> dist.Work:
        header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        values = [_DTYPES.index(out.dtype), out.dim(), *out.shape]
        if len(values) > _HEADER:
            raise ValueError(f"activations of {out.dim()} dims are not supported")
        header[: len(values)] = torch.tensor(values)
        self._header = header  # kept alive until the send completes
        return dist.isend(header, dst=self.peers.next, tag=_tag(0, 0))

    def _recv_header(self) -> tuple[torch.Size, torch.dtype]:
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        dist.irecv(header, src=self.peers.prev, tag=_tag(0, 0)).wait()
        values = header.tolist()
        return torch.Size(values[2 : 2 + values[1]]), _DTYPES[values[0]]
