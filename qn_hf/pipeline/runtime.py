"""Executing one stage's action list with point-to-point sends and receives.

Sends are asynchronous (``isend``) and waited for at the end of the step, so a stage only ever
blocks on a receive; the schedule tests prove the lists cannot deadlock under exactly that rule.
Each rank talks to the rank with the same (dp, tp) coordinates on the neighbouring stage.
The shape of the activations is sent once per step (a small int64 header before microbatch 0):
every microbatch of a step has the same shape, and the gradient has the activation's shape.
An action that raises gets the step x stage grid of the whole schedule attached as a note, with
the failing cell marked, so a failure on one rank says where in the pipeline it happened.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .schedule import Action, Op, format_grid

# The activation header's dtype codes (a dtype's position is its code on the wire; not a file format).
_WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
HEADER_INTS = 8  # int64 values sent once per step: room for [dtype, ndim, *shape]

StageForward = Callable[[int, "torch.Tensor | None"], torch.Tensor]


@dataclass(frozen=True)
class Peers:
    """Global ranks of the previous and next stage (None at the ends)."""

    prev: int | None
    next: int | None


def _tag(mb: int, kind: int) -> int:
    return 4 * mb + kind  # distinct per microbatch and direction (gloo matches on it; NCCL keeps order)


@dataclass
class _Step:
    """What one step holds between actions; entries leave as soon as they are used."""

    forward: StageForward
    inputs: dict[int, torch.Tensor] = field(default_factory=dict)  # received activations (autograd leaves)
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)  # what backward starts from
    grads: dict[int, torch.Tensor] = field(default_factory=dict)  # received output gradients
    sends: list[tuple[dist.Work, torch.Tensor]] = field(default_factory=list)  # buffer alive until sent
    posted: dict[Action, tuple[dist.Work, torch.Tensor]] = field(default_factory=dict)  # receives in flight
    shape: tuple[torch.Size, torch.dtype] | None = None


class StageExecutor:
    """Runs ``forward(mb, received) -> output`` and backward through the action list of one stage.

    On the last stage ``forward`` returns the (scaled) loss of the microbatch; elsewhere the
    activation to send. ``received`` is None on the first stage.
    """

    def __init__(self, *, stage: int, peers: Peers, device: torch.device) -> None:
        self.stage = stage
        self.peers = peers
        self.device = device
        # Set to a list to record (op, mb, start, stop) in perf_counter seconds for every action:
        # the measured timeline of a step (busy and idle time per stage).
        self.events: list[tuple[Op, int, float, float]] | None = None
        # One handler per op, spelled out: what the executor can run is visible in one place.
        self._ops: dict[Op, Callable[[_Step, int], None]] = {
            Op.RECV_FWD: self._recv_fwd,
            Op.FWD: self._fwd,
            Op.SEND_FWD: self._send_fwd,
            Op.RECV_BWD: self._recv_bwd,
            Op.BWD: self._bwd,
            Op.SEND_BWD: self._send_bwd,
        }

    def run(
        self,
        schedule: list[list[Action]],
        forward: StageForward,
        *,
        before_last_backward: Callable[[], None] | None = None,
    ) -> None:
        """Execute this stage's list, ``schedule[self.stage]`` (``schedule`` holds every stage's, for
        the grid a failure prints); ``before_last_backward`` runs just before the stage's last
        backward (when its gradients become final: the moment data-parallel buckets may start)."""
        actions = schedule[self.stage]
        step = _Step(forward=forward)
        last_bwd = max((i for i, a in enumerate(actions) if a.op == Op.BWD), default=None)
        for i, action in enumerate(actions):
            if i == last_bwd and before_last_backward is not None:
                before_last_backward()
            try:
                start = time.perf_counter()
                self._ops[action.op](step, action.mb)
                if self.events is not None:
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    self.events.append((action.op, action.mb, start, time.perf_counter()))
                self._post_next_receive(step, actions[i + 1 :])
            except Exception as exc:
                # Same type and message; the note shows where in the whole pipeline this rank was.
                exc.add_note(f"pipeline stage {self.stage} failed at step {i} ({action!r}) of this schedule:\n"
                             + format_grid(schedule, mark=(self.stage, i)))
                raise
        for work, _ in step.sends:
            work.wait()

    def _post_next_receive(self, step: _Step, rest: list[Action]) -> None:
        """Post the next receive as soon as its buffer's shape is known, so the transfer overlaps
        the compute in between instead of starting when the schedule reaches it."""
        upcoming = next((a for a in rest if a.op in (Op.RECV_FWD, Op.RECV_BWD)), None)
        if upcoming is None or upcoming in step.posted:
            return
        if upcoming.op == Op.RECV_FWD and step.shape is not None:
            buf = torch.empty(step.shape[0], dtype=step.shape[1], device=self.device)
            step.posted[upcoming] = (dist.irecv(buf, src=self.peers.prev, tag=_tag(upcoming.mb, 1)), buf)
        elif upcoming.op == Op.RECV_BWD and upcoming.mb in step.outputs:
            buf = torch.empty_like(step.outputs[upcoming.mb])
            step.posted[upcoming] = (dist.irecv(buf, src=self.peers.next, tag=_tag(upcoming.mb, 2)), buf)

    def _received(self, step: _Step, action: Action, make: Callable[[], tuple[dist.Work, torch.Tensor]]) -> torch.Tensor:
        work, buf = step.posted.pop(action, None) or make()
        work.wait()
        return buf

    def _recv_fwd(self, step: _Step, mb: int) -> None:
        if step.shape is None:
            step.shape = self._recv_header()

        def post():
            buf = torch.empty(step.shape[0], dtype=step.shape[1], device=self.device)
            return dist.irecv(buf, src=self.peers.prev, tag=_tag(mb, 1)), buf

        step.inputs[mb] = self._received(step, Action(Op.RECV_FWD, mb), post).requires_grad_(torch.is_grad_enabled())

    def _fwd(self, step: _Step, mb: int) -> None:
        # Without autograd (eval) nothing is kept for a backward: inputs go as they are consumed.
        received = step.inputs.get(mb) if torch.is_grad_enabled() else step.inputs.pop(mb, None)
        step.outputs[mb] = step.forward(mb, received)

    def _send_fwd(self, step: _Step, mb: int) -> None:
        out = (step.outputs[mb] if torch.is_grad_enabled() else step.outputs.pop(mb)).detach().contiguous()
        if mb == 0:
            self._send_header(step, out)
        step.sends.append((dist.isend(out, dst=self.peers.next, tag=_tag(mb, 1)), out))

    def _recv_bwd(self, step: _Step, mb: int) -> None:
        def post():
            buf = torch.empty_like(step.outputs[mb])
            return dist.irecv(buf, src=self.peers.next, tag=_tag(mb, 2)), buf

        step.grads[mb] = self._received(step, Action(Op.RECV_BWD, mb), post)

    def _bwd(self, step: _Step, mb: int) -> None:
        torch.autograd.backward(step.outputs.pop(mb), grad_tensors=step.grads.pop(mb, None))

    def _send_bwd(self, step: _Step, mb: int) -> None:
        grad = step.inputs.pop(mb).grad.contiguous()
        step.sends.append((dist.isend(grad, dst=self.peers.prev, tag=_tag(mb, 2)), grad))

    def _send_header(self, step: _Step, out: torch.Tensor) -> None:
        values = [_WIRE_DTYPES.index(out.dtype), out.dim(), *out.shape]
        if len(values) > HEADER_INTS:
            raise ValueError(f"activations of {out.dim()} dims are not supported")
        header = torch.zeros(HEADER_INTS, dtype=torch.int64, device=self.device)
        header[: len(values)] = torch.tensor(values)
        step.sends.append((dist.isend(header, dst=self.peers.next, tag=_tag(0, 0)), header))

    def _recv_header(self) -> tuple[torch.Size, torch.dtype]:
        header = torch.empty(HEADER_INTS, dtype=torch.int64, device=self.device)
        dist.irecv(header, src=self.peers.prev, tag=_tag(0, 0)).wait()
        values = header.tolist()
        return torch.Size(values[2 : 2 + values[1]]), _WIRE_DTYPES[values[0]]
