"""A causal LM's loss in chunks of positions, so that the whole logits never exist at once.

At a long sequence the logits are the largest activation of a causal LM (``tokens x vocabulary`` in
float32 for the loss: 16 GiB at 32k tokens and a 128k vocabulary), and the loss keeps their softmax
until the backward. With ``loss_chunk_tokens`` the loss of a microbatch is computed a chunk of
positions at a time, forward and backward:

* the task model's forward runs as always, but the base model's output reaches its head with no
  position (a forward hook hands the head a slice of length 0 and records the whole output), so the
  head and whatever follows it run on nothing;
* each chunk then runs the *task model's own forward* on its positions, its base model stood in for
  by one that returns the recorded output with that chunk's hidden states: whatever transformers
  does between the base model and the loss (Gemma's soft-capping, Cohere's scale, Granite's divisor,
  a LoRA head, tp's vocabulary-parallel head) is the model's own code, not a
  copy of it, so the logits of a chunk are the plain model's logits of those positions;
* each chunk's loss sum runs under torch's non-reentrant checkpoint: its logits and softmax are
  freed once its sum is taken and made again, one chunk at a time, in the backward. The cost: the
  head's product once more in the backward, and, at tp, one all-reduce of each chunk's input
  gradient (the same bytes as one for the whole).

Equal to the loss over the whole logits up to the order of float32 sums. The task model's forward
is called as ``.forward`` for the chunks, not through its hooks: FSDP's root hooks (dp_shard) have
gathered the head's weights for the step's forward and keep them until the backward ends.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.fsdp import FSDPModule
from torch.utils.checkpoint import checkpoint
from transformers.utils import ModelOutput

from ..config.options import LossKind
from ..pipeline.stage import first_output
from ..policies.patterns import base_model_and_prefix
from ..policies.task import TaskHead
from ..tensor_parallel.apply import VocabShard
from .loss import position_targets, token_loss_sum


@dataclass
class _Recorded:
    """What one microbatch's task forward gave its base model and got from it."""

    args: tuple = ()  # the task model's call, as it was made
    kwargs: dict = field(default_factory=dict)
    output: object = None  # the base model's whole output


class _BaseStandIn(nn.Module):
    """Stands in for the base model while a chunk runs: returns ``output`` whatever it is called
    with; any other attribute the task forward reads is the real base model's."""

    def __init__(self, real: nn.Module, output) -> None:
        super().__init__()
        object.__setattr__(self, "_real", real)  # not a submodule: named_modules must not see it twice
        self._output = output

    def forward(self, *_args, **_kwargs):
        return self._output

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_real"), name)


def _with_hidden(output, hidden: torch.Tensor):
    """``output`` (a model output, a tuple or list, or a tensor: ``first_output``'s forms) with ``hidden`` as
    its hidden states."""
    if isinstance(output, ModelOutput):
        return type(output)(**{**output, next(iter(output.keys())): hidden})
    if isinstance(output, (tuple, list)):
        return type(output)((hidden, *output[1:]))
    return hidden


def chunk_sizes(*, rows: int, positions: int, tokens: int) -> list[int]:
    """The positions of each chunk of a microbatch of ``rows`` x ``positions``, in order: ``tokens`` tokens of
    every row at a time, at least one position (the planner counts the chunks' collectives too)."""
    step = max(1, tokens // max(1, rows))
    return [min(step, positions - start) for start in range(0, positions, step)]


def chunk_count(chunk_tokens: int | None, *, rows: int, tokens: int) -> int:
    """How many chunks the loss of ``rows`` sequences of ``tokens`` tokens in all takes (``chunk_tokens`` a
    chunk, ``loss_chunk_tokens``); 0 where it is computed at once (``chunk_tokens`` None)."""
    if chunk_tokens is None:
        return 0
    return len(chunk_sizes(rows=rows, positions=tokens // max(1, rows), tokens=chunk_tokens))


def check_loss_chunks(model: nn.Module, *, tokens: int | None, loss: LossKind | None, seq2seq: bool) -> None:
    """``loss_chunk_tokens`` applies to ``model``: its built-in loss is a causal LM's, computed after a base
    model whose hidden states a stand-in can hand the head (raised before any collective)."""
    if tokens is None:
        return
    fix = "parallelize without loss_chunk_tokens (the loss then takes the whole logits at once)"
    if loss is not LossKind.CAUSAL_LM:
        raise ValueError(f"loss_chunk_tokens={tokens}: {type(model).__name__}'s loss is "
                         f"{'none qn_hf computes' if loss is None else repr(loss.value)}, not a causal LM's "
                         f"next-token loss, the one computed in chunks; {fix}")
    if seq2seq:
        raise ValueError(f"loss_chunk_tokens={tokens}: {type(model).__name__} is an encoder-decoder model, whose "
                         f"decoder's loss is not computed in chunks; {fix}")
    if base_model_and_prefix(model)[0] is model:
        raise ValueError(f"loss_chunk_tokens={tokens}: {type(model).__name__} holds no base model apart from its "
                         f"head, which the chunks need to stand in for; {fix}")


class LossChunks:
    """The chunked causal-LM loss of one stage's task model (``model``), ``tokens`` positions x rows at a
    time (at least one position per chunk)."""

    def __init__(self, model: nn.Module, *, tokens: int) -> None:
        self.model, self.tokens = model, tokens
        self.base, prefix = base_model_and_prefix(model)
        holder, _, self.name = prefix.rpartition(".")
        self.holder = model.get_submodule(holder) if holder else model

    @contextlib.contextmanager
    def recording(self) -> Iterator[_Recorded]:
        """Inside: the task model's call and its base model's whole output are recorded, and the head gets
        none of the positions."""
        recorded = _Recorded()

        def call(_module, args, kwargs):
            recorded.args, recorded.kwargs = tuple(args), dict(kwargs)

        def returned(_module, _args, output):
            hidden = first_output(output)
            if hidden.dim() != 3:
                raise ValueError(f"loss_chunk_tokens: {type(self.base).__name__} returned hidden states of shape "
                                 f"{tuple(hidden.shape)}, not (rows, positions, hidden); parallelize without "
                                 f"loss_chunk_tokens")
            recorded.output = output
            return _with_hidden(output, hidden.narrow(1, 0, 0))

        handles = [self.model.register_forward_pre_hook(call, with_kwargs=True),
                   self.base.register_forward_hook(returned)]
        try:
            yield recorded
        finally:
            for handle in handles:
                handle.remove()

    def check_builtin(self, builtin: bool) -> None:
        """A step's loss is the built-in one: a ``loss_fn`` takes the whole logits, which are never made."""
        if not builtin:
            raise ValueError(f"a loss_fn with loss_chunk_tokens={self.tokens}: a loss_fn takes the whole logits, "
                             f"which loss_chunk_tokens is there never to make; leave loss_fn out (the built-in "
                             f"causal-LM loss is computed in chunks) or parallelize without loss_chunk_tokens")

    def summed(self, recorded: _Recorded, outputs, batch: Mapping[str, torch.Tensor], *, head: TaskHead,
               vocab: VocabShard | None, group: ProcessGroup) -> torch.Tensor:
        """The loss sum (float32, ``[1]``) over the recorded microbatch's positions against their targets in
        ``batch`` (``step.loss.position_targets``), a chunk at a time (``step.loss.token_loss_sum`` of each).
        ``outputs``: what the task forward returned (its logits of no position), kept in the graph."""
        if recorded.output is None:
            raise RuntimeError("the task model's forward never called its base model: nothing to take the loss of")
        targets = position_targets(batch, kind=LossKind.CAUSAL_LM, head=head)
        hidden = first_output(recorded.output)
        run = functools.partial(self._chunk_sum, recorded=recorded, vocab=vocab, group=group)
        sizes = chunk_sizes(rows=hidden.shape[0], positions=hidden.shape[1], tokens=self.tokens)
        # split, not sliced: the backward of a slice makes a whole-size gradient per chunk, split's one for all
        # FSDP's root (dp_shard) prepares its backward from a hook on the task forward's outputs: their empty
        # logits stay in the graph there (a sum of nothing, 0), or a step whose blocks need no gradient (a frozen
        # base) would never reduce the head's; elsewhere they are left out (their backward would be an empty
        # all-reduce at tp)
        total = outputs.logits.sum().float() if isinstance(self.model, FSDPModule) else None
        for part_hidden, part_targets in zip(hidden.split(sizes, dim=1), targets.split(sizes, dim=1)):
            part = checkpoint(run, part_hidden, part_targets, use_reentrant=False, preserve_rng_state=True)
            total = part if total is None else total + part
        return total.reshape(1)

    def _chunk_sum(self, hidden: torch.Tensor, targets: torch.Tensor, *, recorded: _Recorded,
                   vocab: VocabShard | None, group: ProcessGroup) -> torch.Tensor:
        stand_in = _BaseStandIn(self.base, _with_hidden(recorded.output, hidden))
        setattr(self.holder, self.name, stand_in)
        try:
            logits = self.model.forward(*recorded.args, **recorded.kwargs).logits
        finally:
            setattr(self.holder, self.name, self.base)
        if logits.shape[:-1] != targets.shape:  # the head did not score this chunk's positions one by one
            raise ValueError(f"loss_chunk_tokens: {type(self.model).__name__}'s forward gave logits of shape "
                             f"{tuple(logits.shape)} for a chunk of {tuple(targets.shape)} positions; parallelize "
                             f"without loss_chunk_tokens")
        return token_loss_sum(logits, targets, vocab=vocab, group=group)
