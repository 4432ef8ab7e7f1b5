"""Mixture-of-experts layers in the planner's meta trace: expert parallelism's dispatch stood in
for, and its traffic. (The experts' grouped matmuls run on meta as ``planner/kernels.py`` runs them.)

Dispatch. ``ExpertsStandIn`` registers a function in transformers' experts registry and selects
it, as ``apply_expert_parallel`` selects the real dispatch (``expert_dispatch.py``). At ep=1 it
only reports each call and runs the implementation that ran before. At ep > 1 it runs, op for op,
what the real dispatch runs on one rank, with every collective replaced by a new tensor of the size
it returns under *uniform routing*: every rank's ``T_local * K`` (token, choice) pairs spread
evenly over the ep members, so each rank receives ``R = T_local * K`` rows and runs its
``E / ep`` experts on them (``num_experts`` is set to that around the call, as on a real rank).
With tp > 1 it keeps tp rank 0's ``row_split`` share (the largest) and allocates the gathered
``[T, H]`` output. Like the real collectives the stand-ins keep nothing for backward, so what
stays alive is what a rank keeps: the sort's indices, the local experts' saved tensors, the
returned rows and the routing weights for the weighted sum. A real run's routing is uneven: a rank
keeps more or less with the rows it receives; the estimate is the uniform figure (the tests force
uniform routing to check it exactly, see tests/planner_memory_cases.py).

Traffic (``expert_ops``), per MoE call of one microbatch on one rank, as ``CommMeter`` counts it:
on "ep", ``all_to_all_single`` forward of the int64 counts (E elements), of this rank's
``T_local * K`` token rows and of the ``R`` rows back, and backward the reverse of the two row
exchanges (``R`` and ``T_local * K`` rows of gradient); recomputation repeats the forward three
when the block saves something after them (``ExpertCall.rerun``). With tp > 1 on "tp":
``all_gather_into_tensor`` forward of the outputs (padded to the largest share, repeated when
recomputed), backward of the split's gradients (hidden states and routing weights, padded).
Per rank ``R`` follows the router; summed over an ep group it does not (every row sent in the group
is received in it), so ep times the estimate is the group's exact total.

``expert_dispatch="all_gather"`` (``gather``): the stand-in gathers ``ep * T_local`` rows, choices and
weights, runs the local experts on all of them with the other ranks' choices as sentinels (transformers'
sentinel path, as on a real rank) and returns ``T_local`` rows. Traffic, exact on every rank (shapes, not
the router, size it): forward ``all_gather_into_tensor`` of the rows, the int64 choices and the routing
weights and an ``all_to_all_single`` of the ``ep * T_local`` partial outputs (the sum back); backward an
all-to-all of the gathered rows' gradient (and of the weights', where they need one) and an all-gather of the
outputs' gradient. Recomputation reruns the gathers where the experts' call saves after them (``rerun``)
and the sum back where the block saves after the call (``gather_rerun``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..comm_meter import Collective
from ..compat import skip_expert_sentinels
from ..policies.tp_plan import TpPlan
from .apply import experts_modules
from .token_exchange import row_split

A2A, GATHER = Collective.ALL_TO_ALL_SINGLE, Collective.ALL_GATHER_INTO_TENSOR
COUNT_ELEM = 8  # the per-expert counts travel as int64
_names = itertools.count()


@dataclass(frozen=True)
class ExpertCall:
    """One call of a fused experts module in one microbatch, as the unsharded model makes it."""

    module: str  # the experts module; its stage is this module's
    tokens: int  # T: rows of hidden states the call receives (the same on every tp rank)
    top_k: int  # K: experts per token
    experts: int  # E: routed experts of the module
    hidden: int  # H
    hidden_elem: int  # bytes per element of the hidden states (and of their gradients)
    weights_elem: int  # of the routing weights; 0 when they need no gradient
    # of the routing weights, whether or not they need a gradient (the all-gather dispatch sends them); float32's
    # where a caller builds a call by hand
    routing_elem: int = 4
    # recomputation runs the dispatch's forward exchanges again: the all-to-alls, or the all-gather dispatch's
    # gathers (set by the trace)
    rerun: bool = False
    # and what ends the call: the tp gather of the outputs, and the all-gather dispatch's sum back (set by the trace)
    gather_rerun: bool = False

    def local_tokens(self, tp: int) -> int:
        """T_local: tp rank 0's share (the largest), which every tp rank's gathers are padded to."""
        return row_split(self.tokens, tp)[0]


class _Moved(torch.autograd.Function):
    """A collective's result: ``rows`` new rows shaped like ``x``'s; keeps nothing (no backward run)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, rows: int) -> torch.Tensor:
        return x.new_empty((rows, *x.shape[1:]))

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover - the trace runs no backward
        raise NotImplementedError("the planner's dispatch stand-in has no backward")


def moe_regions(model: nn.Module, plan: TpPlan) -> frozenset[str]:
    """The tp entries and regions that hold a fused experts module. Under ep nothing in them is
    split over tp (the router runs on every token of every tp rank, the experts are ep's) except
    in the tp-sharded modules inside them, which are entries or regions of their own."""
    experts = tuple(experts_modules(model))
    return frozenset(r for r in (*plan.tp_entries, *plan.tp_rng_regions)
                     if any(e.startswith(r + ".") for e in experts))


class ExpertsStandIn:
    """While entered, ``model``'s fused experts run through the stand-in (see the module
    docstring). ``note(call, gather)`` receives every call (its ``module`` left for the caller,
    which knows what is running) once its all-to-alls (the all-gather dispatch's gathers) ran (``gather``
    False; at ep=1, when it starts) and again when the call ends (``gather`` True): with tp > 1 after the
    tp gather of its outputs, with the all-gather dispatch after the sum back, so that
    the trace can tell which of them a recomputation repeats. ``inside``: whether the stand-in is
    allocating (tensors of one tp rank's size)."""

    def __init__(self, model: nn.Module, *, ep: int, tp: int, note: Callable[[ExpertCall, bool], None],
                 gather: bool = False) -> None:
        self.model, self.ep, self.tp, self.note = model, ep, tp, note
        self.gather = gather  # expert_dispatch="all_gather" (dispatch.py's _gather_exchange)
        self.inside = False
        self._previous: str | None = None
        self._name = ""
        self._local: Callable | None = None

    def _forward(self, module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        call = ExpertCall(module="", tokens=hidden_states.shape[0], top_k=top_k_index.shape[-1],
                          experts=module.num_experts, hidden=hidden_states.shape[-1],
                          hidden_elem=hidden_states.element_size(),
                          weights_elem=top_k_weights.element_size() if top_k_weights.requires_grad else 0,
                          routing_elem=top_k_weights.element_size())
        if self.ep == 1:
            self.note(call, False)
            return self._local(module, hidden_states, top_k_index, top_k_weights)
        self.inside = True
        try:
            sizes = row_split(hidden_states.shape[0], self.tp)
            # split_rows: tp rank 0's rows, a view (its backward all-gathers the gradient)
            hidden, index, weights = (t.split(sizes)[0].contiguous() if self.tp > 1 else t
                                      for t in (hidden_states, top_k_index, top_k_weights))
            exchange = self._gathered if self.gather else self._exchange
            out = exchange(module, hidden, index, weights, exchanged=lambda: self.note(call, False))
            if self.gather and self.tp == 1:  # the sum back ends the call: a recomputation reruns it if saves follow
                self.note(call, True)
            if self.tp > 1:  # gather_rows: the whole [T, H] on every tp rank
                out = _Moved.apply(out, hidden_states.shape[0])
                self.note(call, True)
            return out
        finally:
            self.inside = False

    def _exchange(self, module: nn.Module, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                  exchanged: Callable[[], None]) -> torch.Tensor:
        # expert_dispatch's exchange, op for op; the counts (bincount, their all-to-all) die at once
        # and the received rows' local expert ids are not kept either: both are left out.
        tokens, k = index.shape
        order = torch.argsort(index.reshape(-1), stable=True)
        rows = _Moved.apply(hidden[order // k], tokens * k)  # uniform routing: R = T_local * K received
        local_ids = torch.zeros((rows.shape[0], 1), dtype=torch.long, device=rows.device)
        unit = torch.ones((rows.shape[0], 1), dtype=hidden.dtype, device=hidden.device)
        experts = module.num_experts
        module.num_experts = experts // self.ep  # as apply_expert_parallel leaves it on a real rank
        try:
            done = self._local(module, rows, local_ids, unit)
        finally:
            module.num_experts = experts
        back = _Moved.apply(done, tokens * k)
        exchanged()  # before the weighted sum's save: a recomputation that reaches it reruns the three
        in_pair_order = back.index_select(0, torch.argsort(order))
        weighted = in_pair_order.view(tokens, k, -1) * weights[..., None]
        return weighted.sum(1).to(hidden.dtype)

    def _gathered(self, module: nn.Module, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                  exchanged: Callable[[], None]) -> torch.Tensor:
        # the all-gather dispatch's exchange, op for op: every member's rows, choices and weights gathered
        # (tp rank 0's share is the largest: no padding), the choices held elsewhere made sentinels, this
        # rank's experts on all of them (transformers' sentinel path), the partial outputs summed back
        tokens, local = hidden.shape[0], module.num_experts // self.ep
        every = _Moved.apply(hidden, self.ep * tokens)
        choices = _Moved.apply(index, self.ep * tokens) - 0  # less this rank's first expert
        elsewhere = (choices < 0) | (choices >= local)
        local_ids = choices.masked_fill(elsewhere, local)
        local_weights = _Moved.apply(weights, self.ep * tokens).masked_fill(elsewhere, 0.0)
        exchanged()  # the gathers: a recomputation reruns them where the experts' call saves after them
        experts, marked = module.num_experts, getattr(module, "_is_expert_parallel", None)
        module.num_experts = local  # as apply_expert_parallel leaves it on a real rank
        skip_expert_sentinels(module)
        try:
            partial = self._local(module, every, local_ids, local_weights)
        finally:
            module.num_experts = experts
            if marked is not None:
                module._is_expert_parallel = marked
        return _Moved.apply(partial, tokens)

    def __enter__(self) -> ExpertsStandIn:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        first = next(iter(experts_modules(self.model).values()))
        self._previous = first.config._experts_implementation
        self._local = ALL_EXPERTS_FUNCTIONS.get_interface(self._previous, type(first).forward.__wrapped__)
        # In the registry instance's own mapping, which ``__exit__`` can empty again (``register``
        # writes the class-wide one, for good).
        self._name = f"qn_hf_plan_experts_{next(_names)}"
        ALL_EXPERTS_FUNCTIONS[self._name] = self._forward
        self.model.set_experts_implementation(self._name)
        return self

    def __exit__(self, *exc: object) -> None:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        if self._previous is not None:
            self.model.set_experts_implementation(self._previous)
            del ALL_EXPERTS_FUNCTIONS[self._name]


def expert_ops(calls: tuple[ExpertCall, ...], *, ep: int, tp: int, recompute: str | None,
               on_stage: Callable[[str], bool], gather: bool = False) -> dict[str, dict[Collective, list[int]]]:
    """One microbatch's dispatch traffic on a stage: group -> op -> [calls, bytes] (none at ep=1);
    ``gather``: expert_dispatch="all_gather"'s (module docstring)."""
    out: dict[str, dict[Collective, list[int]]] = {}

    def add(group: str, op: Collective, count: int, nbytes: int) -> None:
        acc = out.setdefault(group, {}).setdefault(op, [0, 0])
        acc[0] += count
        acc[1] += nbytes

    for call in calls if ep > 1 else ():
        if not on_stage(call.module):
            continue
        forwards = 2 if recompute is not None and call.rerun else 1
        if gather:  # the gathers rerun as ``rerun`` says, the sum back (the call's end) as ``gather_rerun``
            shares, sums = call.local_tokens(tp), 2 if recompute is not None and call.gather_rerun else 1
            rows, pairs = shares * call.hidden * call.hidden_elem, shares * call.top_k
            add("ep", GATHER, 3 * forwards + 1, forwards * (rows + pairs * (COUNT_ELEM + call.routing_elem)) + rows)
            add("ep", A2A, sums + 1 + bool(call.weights_elem), (sums + 1) * ep * rows + ep * pairs * call.weights_elem)
        else:
            rows = call.local_tokens(tp) * call.top_k  # sent, and received under uniform routing
            row_bytes = rows * call.hidden * call.hidden_elem
            add("ep", A2A, 3 * forwards + 2, forwards * (call.experts * COUNT_ELEM + 2 * row_bytes) + 2 * row_bytes)
        if tp > 1:
            padded = call.local_tokens(tp) * call.hidden * call.hidden_elem
            gathers = 2 if recompute is not None and call.gather_rerun else 1
            add("tp", GATHER, gathers + 1, gathers * padded + padded)  # outputs; the hidden states' gradient
            if call.weights_elem:  # the routing weights' gradient
                add("tp", GATHER, 1, call.local_tokens(tp) * call.top_k * call.weights_elem)
    return out
