"""Executing one stage's action list with point-to-point sends and receives.

Sends are asynchronous and receives are posted ahead, but never ahead of a send: right after each action
the next receive in the list is posted if its buffer's shape is known and no send comes before it, so its
transfer overlaps the compute in between. A device-wide wait (the caching allocator's retry after an
out-of-memory, inductor's autotuning, ``empty_cache``) waits for every posted receive too, and a receive
posted ahead of a send may be one whose sender waits for that send, which the host would post only after
the wait: a gradient whose stage waits for this stage's next activation, or under interleaved 1F1B an
activation coming round the ring (``nccl_replay.device_waits`` finds these deadlocks). A receive the list
reaches after its preceding sends depends on nothing this rank sends later, which is what the schedule
checks prove for blocking receives.
Every message travels on the communicator of its own direction (``p2p.py``): under NCCL a posted
receive then holds up only later receives of the same direction, never a send. The schedule checks
prove the lists cannot deadlock when a stage blocks only on its receives, and that every directed
link carries its messages in the order the receiver expects them (NCCL ignores tags); the recorded
calls of real steps are also replayed through a model of NCCL's streams (``nccl_replay.py``). Each
rank talks to the ranks with the same (dp, cp, tp) coordinates on the neighbouring stages; with
virtual stages the last stage's next is the first (a ring).

Work is keyed by ``(chunk, microbatch)``. A rank announces the dtype and shape of its first
activation with a small int64 header before its first send of a batch shape; the receiver reads
it on the host (the one host synchronization of the pipeline) and keeps it under the caller's
``shape_key``, so later steps with batches of that shape exchange no header at all. The rows of
microbatch ``mb`` are ``rows[mb]``, which every rank computes from its own copy of the batch, so
microbatches of different sizes (``torch.tensor_split``) need no header of their own: an activation
whose first dimension is the first microbatch's rows has ``rows[mb]`` there. One whose batch sits
elsewhere (Gemma 3n's AltUp streams, ``[streams, rows, ...]``) has the announced shape for every
microbatch, which the sender checks, so microbatches must then be of one size. A gradient has its
activation's shape.

Memory: a sent tensor is held only until its transfer completes (checked at every action), not to
the end of the step, so 1F1B's bound on live activations holds for send buffers too.

An action that raises gets the step x stage grid of the whole schedule attached as a note, with the
failing cell marked, so a failure on one rank says where in the pipeline it happened.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch
import torch.distributed as dist

from .p2p import Link, Peers
from .schedule import Action, Op, chunk_of, final_actions, format_grid
from .wire import empty_header, header_of, read_header

__all__ = ["Peers", "StageEvent", "StageExecutor", "StageForward", "WeightGrads"]

# forward(chunk, mb, received) -> the activation to send, or on the last chunk the microbatch's loss
StageForward = Callable[[int, int, "torch.Tensor | None"], torch.Tensor]
Key = tuple[int, int]  # (chunk, microbatch)


class WeightGrads(Protocol):
    """The deferred weight-gradient work of split backward passes (``qn_hf.pipeline.weight_grad``)."""

    open: object

    def run(self, key: Key) -> None: ...

    def pending(self) -> list: ...

    def clear(self) -> None: ...


class StageEvent(NamedTuple):
    """One executed action and when it ran (``time.perf_counter`` seconds)."""

    op: Op
    chunk: int
    mb: int
    start: float
    stop: float


@dataclass
class _Step:
    """What one step holds between actions; entries leave as soon as they are used."""

    forward: StageForward
    rows: Sequence[int]
    inputs: dict[Key, torch.Tensor] = field(default_factory=dict)  # received activations (autograd leaves)
    outputs: dict[Key, torch.Tensor] = field(default_factory=dict)  # what backward starts from
    grads: dict[Key, torch.Tensor] = field(default_factory=dict)  # received output gradients
    sends: list[tuple[dist.Work, torch.Tensor]] = field(default_factory=list)  # buffer alive until sent
    posted: dict[Key, tuple[dist.Work, torch.Tensor]] = field(default_factory=dict)  # receives in flight
    announced: tuple[tuple[int, ...], torch.dtype] | None = None  # received activations: the first's shape, dtype
    header_sent: bool = False
    shape_key: Hashable | None = None
    deferred: frozenset[Key] = frozenset()  # backward passes whose weight gradients come in a WGT


def batch_shape_key(microbatch: Mapping[str, torch.Tensor], *, rows: Sequence[int]) -> Hashable:
    """What fixes the activations' shapes between stages (``StageExecutor.run``'s ``shape_key``): the
    first microbatch's inputs past their rows, and every microbatch's rows (the announced shape holds
    the first one's)."""
    return (tuple((k, tuple(v.shape[1:]), v.dtype) for k, v in sorted(microbatch.items())), tuple(rows))


def activation_shape(first: tuple[int, ...], *, rows: Sequence[int], mb: int) -> tuple[int, ...]:
    """Microbatch ``mb``'s activation shape from the first microbatch's: ``rows[mb]`` in place of the
    first dimension when that is the batch (it holds the first microbatch's rows), else the same."""
    return (rows[mb], *first[1:]) if first[0] == rows[0] else tuple(first)


_SENDS = frozenset((Op.SEND_FWD, Op.SEND_BWD))
_TRANSFERS = _SENDS | {Op.RECV_FWD, Op.RECV_BWD}


class StageExecutor:
    """Runs ``forward(chunk, mb, received) -> output`` and backward through the action list of one
    stage. ``received`` is None on chunk 0. ``chunks`` is the number of chunks of the whole model
    (pp x virtual stages), which makes every (chunk, microbatch, kind) its own message tag."""

    def __init__(self, *, stage: int, peers: Peers, device: torch.device, chunks: int = 1,
                 weights: WeightGrads | None = None) -> None:
        self.stage = stage
        self.peers = peers
        self.device = device
        self.chunks = max(chunks, 1)
        self.weights = weights
        # Set to a list to record a StageEvent for every action: the measured timeline of a step
        # (busy and idle time per stage).
        self.events: list[StageEvent] | None = None
        # shape_key -> the first received activation's shape and dtype, and the first sent one's shape
        # (the keys whose header this rank has sent): every rank sees the same sequence of batch
        # shapes, so both ends of a link agree on which steps carry a header
        self._received_shapes: dict[Hashable, tuple[tuple[int, ...], torch.dtype]] = {}
        self._announced: dict[Hashable, tuple[int, ...]] = {}
        self._sent_shape: tuple[int, ...] | None = None  # this step's first sent activation's shape
        # One handler per op, spelled out: what the executor can run is visible in one place.
        self._ops: dict[Op, Callable[[_Step, Key], None]] = {
            Op.RECV_FWD: self._recv_fwd,
            Op.FWD: self._fwd,
            Op.SEND_FWD: self._send_fwd,
            Op.RECV_BWD: self._recv_bwd,
            Op.BWD: self._bwd,
            Op.SEND_BWD: self._send_bwd,
            Op.WGT: self._wgt,
        }

    def _tag(self, key: Key, kind: int) -> int:
        # distinct per receiving chunk, microbatch and kind (0 header, 1 activation, 2 gradient):
        # gloo matches on it; NCCL keeps the order, which the schedule check proves is the
        # receiver's order
        chunk, mb = key
        return 4 * (mb * self.chunks + chunk) + kind

    def run(
        self,
        schedule: list[list[Action]],
        forward: StageForward,
        *,
        rows: Sequence[int],
        on_final: Callable[[int, str], None] | None = None,
        shape_key: Hashable | None = None,
    ) -> None:
        """Execute this stage's list, ``schedule[self.stage]`` (``schedule`` holds every stage's, for
        the grid a failure prints). ``rows[mb]`` is microbatch ``mb``'s size along dim 0.
        ``on_final(chunk, kind)`` runs just before the action after which a chunk's gradients are
        final: its last backward (``Op.BWD``) and, when weight gradients are deferred, its last
        weight pass (``Op.WGT``); the moment data-parallel buckets may start. ``shape_key`` (hashable)
        names the batch's shapes: with it, the activation header is exchanged once per key instead
        of once per step (every rank of the pipeline must pass the same key for the same shapes)."""
        actions = schedule[self.stage]
        keys = [(chunk_of(a, stage=self.stage), a.mb) for a in actions]
        if any(chunk >= self.chunks for chunk, _ in keys):
            raise ValueError(f"the schedule runs chunk {max(c for c, _ in keys)} but this executor was built for "
                             f"{self.chunks} chunks (message tags would collide)")
        step = _Step(forward=forward, rows=rows, shape_key=shape_key,
                     deferred=frozenset(key for a, key in zip(actions, keys) if a.op is Op.WGT))
        if shape_key is not None:
            step.announced = self._received_shapes.get(shape_key)
            step.header_sent = shape_key in self._announced
            self._sent_shape = self._announced.get(shape_key)
        if step.deferred and self.weights is None:
            raise ValueError("this schedule defers weight gradients, but the stage has no weight-gradient queue")
        finals = {i: key for key, i in final_actions(actions, stage=self.stage).items()}
        if self.weights is not None:
            self.weights.clear()  # nothing from an interrupted step may join this one's weight passes
        for i, (action, key) in enumerate(zip(actions, keys)):
            try:
                if on_final is not None and i in finals:
                    on_final(*finals[i])
                start = time.perf_counter()
                self._ops[action.op](step, key)
                if self.events is not None:
                    if self.device.type == "cuda":
                        # the compute stream only: torch.cuda.synchronize would also wait for the
                        # receives posted ahead on the NCCL streams (a round trip through later stages)
                        torch.cuda.current_stream(self.device).synchronize()
                    self.events.append(StageEvent(action.op, key[0], key[1], start, time.perf_counter()))
                self._post_next_receive(step, actions[i + 1 :], keys[i + 1 :])
                step.sends = [(work, buf) for work, buf in step.sends if not work.is_completed()]
            except BaseException as exc:  # KeyboardInterrupt too: the queue must not keep this step's work
                if self.weights is not None:
                    self.weights.clear()
                # Same type and message; the note shows where in the whole pipeline this rank was.
                exc.add_note(f"pipeline stage {self.stage} failed at step {i} ({action!r}) of this schedule:\n"
                             + format_grid(schedule, mark=(self.stage, i)))
                raise
        for work, _ in step.sends:
            work.wait()
        if self.weights is not None and self.weights.pending():
            stale = self.weights.pending()
            self.weights.clear()
            raise RuntimeError(f"deferred weight gradients of {stale} never ran: the schedule lacks their weight passes")

    def _post_next_receive(self, step: _Step, rest: list[Action], keys: list[Key]) -> None:
        """Post the next receive as soon as its buffer's shape is known, so the transfer overlaps the compute
        in between instead of starting when the schedule reaches it, unless a send comes first (module
        docstring). Only the next one: receives are posted in list order, the order the schedule check proves."""
        upcoming = next(((a, k) for a, k in zip(rest, keys) if a.op in _TRANSFERS), None)
        if upcoming is None or upcoming[0].op in _SENDS or upcoming[1] in step.posted:
            return
        action, key = upcoming
        if action.op == Op.RECV_FWD and step.announced is not None:
            step.posted[key] = self._post_activation(step, key)
        elif action.op == Op.RECV_BWD and key in step.outputs:
            step.posted[key] = self._post_gradient(step, key)

    def _post_activation(self, step: _Step, key: Key) -> tuple[dist.Work, torch.Tensor]:
        shape, dtype = step.announced
        buf = torch.empty(activation_shape(shape, rows=step.rows, mb=key[1]), dtype=dtype, device=self.device)
        return self._link("from_prev").recv(buf, tag=self._tag(key, 1)), buf

    def _post_gradient(self, step: _Step, key: Key) -> tuple[dist.Work, torch.Tensor]:
        # dense whatever the output's strides (FSMT's stack ends on a transpose): what was sent is contiguous
        buf = torch.empty_like(step.outputs[key], memory_format=torch.contiguous_format)
        return self._link("from_next").recv(buf, tag=self._tag(key, 2)), buf

    def _received(self, step: _Step, key: Key, post: Callable[[_Step, Key], tuple[dist.Work, torch.Tensor]]) -> torch.Tensor:
        work, buf = step.posted.pop(key, None) or post(step, key)
        work.wait()
        return buf

    def _recv_fwd(self, step: _Step, key: Key) -> None:
        if step.announced is None:
            step.announced = self._recv_header(step)
            shape = step.announced[0]
            if step.rows[key[1]] not in shape[:2]:  # every rank must cut the same batch the same way
                raise RuntimeError(f"the previous stage sent microbatch {key[1]} as {list(shape)}, this stage expects "
                                   f"{step.rows[key[1]]} rows: every stage of a replica must get the same batch")
        step.inputs[key] = self._received(step, key, self._post_activation).requires_grad_(torch.is_grad_enabled())

    def _fwd(self, step: _Step, key: Key) -> None:
        # Without autograd (eval) nothing is kept for a backward: inputs go as they are consumed.
        received = step.inputs.get(key) if torch.is_grad_enabled() else step.inputs.pop(key, None)
        step.outputs[key] = step.forward(key[0], key[1], received)

    def _send_fwd(self, step: _Step, key: Key) -> None:
        out = (step.outputs[key] if torch.is_grad_enabled() else step.outputs.pop(key)).detach().contiguous()
        if not step.header_sent:
            self._send_header(step, out)
        expected = activation_shape(self._sent_shape, rows=step.rows, mb=key[1])
        if tuple(out.shape) != expected:  # the receiver allocates this shape from the first one's
            raise RuntimeError(f"microbatch {key[1]}'s activation is {list(out.shape)}, the next stage allocates "
                               f"{list(expected)} from the first one's {list(self._sent_shape)}: its batch is not "
                               f"its first dimension, so microbatches must be of one size (rows {list(step.rows)})")
        # tagged with the receiving chunk's key, as its receive is
        step.sends.append((self._link("to_next").send(out, tag=self._tag((key[0] + 1, key[1]), 1)), out))

    def _recv_bwd(self, step: _Step, key: Key) -> None:
        step.grads[key] = self._received(step, key, self._post_gradient)

    def _bwd(self, step: _Step, key: Key) -> None:
        output, grad = step.outputs.pop(key), step.grads.pop(key, None)
        if not output.requires_grad:
            # Nothing before this point trains (a frozen embedding and frozen first blocks): no
            # graph to walk. The stage still sends an input gradient (zeros) if it has an input.
            return
        if key not in step.deferred:
            torch.autograd.backward(output, grad_tensors=grad)
            return
        self.weights.open = key  # the deferring layers queue their weight gradients under this key
        try:
            torch.autograd.backward(output, grad_tensors=grad)
        finally:
            self.weights.open = None

    def _wgt(self, step: _Step, key: Key) -> None:
        self.weights.run(key)

    def _send_bwd(self, step: _Step, key: Key) -> None:
        received = step.inputs.pop(key)
        # None when the output did not depend on the input through autograd; the previous stage
        # still waits for a gradient, and zeros are what it is.
        grad = (received.grad if received.grad is not None else torch.zeros_like(received)).contiguous()
        step.sends.append((self._link("to_prev").send(grad, tag=self._tag((key[0] - 1, key[1]), 2)), grad))

    def _send_header(self, step: _Step, out: torch.Tensor) -> None:
        header = header_of(out)  # once per link and batch shape (``shape_key``), else once per step
        step.sends.append((self._link("to_next").send(header, tag=0), header))
        step.header_sent = True
        self._sent_shape = tuple(out.shape)
        if step.shape_key is not None:
            self._announced[step.shape_key] = self._sent_shape

    def _recv_header(self, step: _Step) -> tuple[tuple[int, ...], torch.dtype]:
        """The first activation's shape, and the dtype of every activation."""
        header = empty_header(self.device)
        self._link("from_prev").recv(header, tag=0).wait()
        announced = read_header(header)  # reads on the host: waits for the header to arrive
        if step.shape_key is not None:
            self._received_shapes[step.shape_key] = announced
        return announced

    def _link(self, name: str) -> Link:
        link = getattr(self.peers, name)
        if link is None:
            raise RuntimeError(f"pipeline stage {self.stage} has no {name} link: the schedule sends or receives past "
                               f"an end of the pipeline")
        return link
