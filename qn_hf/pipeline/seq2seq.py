"""Pipelines of encoder-decoder models (T5, BART, Whisper): encoder stages, then decoder stages.

Stages ``[0, E)`` run the encoder's blocks and send its hidden states; stages ``[E, P)`` run the
decoder's. Every decoder block attends to the encoder's output, so it travels with the decoder's
hidden states: the first decoder stage receives the encoder's output ``[rows, source, hidden]``, and
every decoder stage after it receives ``[decoder hidden states | encoder output]`` joined along the
sequence (one tensor: one message per link, one shape per link). Each decoder stage passes the encoder
output on as it received it, so in backward its gradient sums what every later stage's cross-attention
gave it, and the last encoder stage receives the whole of it.

What each stage runs is the model's own code: an encoder stage calls the encoder (``get_encoder()``)
with the encoder's inputs; a decoder stage calls the task model with ``encoder_outputs`` given, which
transformers' encoder-decoder forwards take in place of running the encoder, and on the last stage
that forward's logits give the loss. A stage keeps only its own stack's blocks; the other stack is an
``Absent`` stand-in, which the forwards never call. Within a stack, a later stage receives in the
entry's place or at its first block, as a decoder-only model does (``policies/stack_cut.py``); a
stack that cannot be cut runs on one stage. The input embedding both stacks share (and a head tied to
it) is real on every stage, its gradient summed over the pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutput

from ..policies.cuts import Seq2SeqCut, StackCut
from ..policies.model_policy import StandIn as StandInKind
from ..policies.patterns import join


@dataclass(frozen=True)
class Seq2SeqStages:
    """The stacks of an encoder-decoder pipeline, paths from the top model: chunks ``[0,
    encoder_chunks)`` run the encoder, the rest the decoder; each chunk's blocks are its own stack's
    (``StagePlan.layer_ranges`` indexes that stack). A stack's cut is None when it runs on one stage."""

    encoder: str
    decoder: str
    encoder_layers: str
    decoder_layers: str
    encoder_chunks: int
    encoder_cut: StackCut | None
    decoder_cut: StackCut | None
    heads: tuple[str, ...]  # what follows the decoder (the LM head): the last chunk's
    shared: tuple[str, ...]  # the embedding both stacks use: every stage's

    def stack_of(self, chunk: int) -> tuple[str, str, StackCut | None]:
        """(stack module, its list of blocks, its cut) of ``chunk``."""
        if chunk < self.encoder_chunks:
            return self.encoder, self.encoder_layers, self.encoder_cut
        return self.decoder, self.decoder_layers, self.decoder_cut

    def first_chunk(self, chunk: int) -> int:
        """The first chunk of ``chunk``'s stack."""
        return 0 if chunk < self.encoder_chunks else self.encoder_chunks


def split_stacks(cut: Seq2SeqCut, *, prefix: str, encoder_blocks: int, decoder_blocks: int, stages: int,
                 layers_per_stage, virtual: int, heads: tuple[str, ...]) -> tuple[Seq2SeqStages, tuple]:
    """The stacks over ``stages`` stages and each chunk's blocks, or a ValueError naming why not."""
    if virtual > 1:
        raise ValueError(f"pp={stages} with virtual_stages={virtual}: an encoder-decoder pipeline runs encoder stages "
                         f"then decoder stages, one chunk each; use virtual_stages=1")
    if layers_per_stage is not None:
        sizes = list(layers_per_stage)
        sums = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        if len(sizes) != stages or encoder_blocks not in sums[1:-1] or sums[-1] != encoder_blocks + decoder_blocks \
                or any(n < 1 for n in sizes):
            raise ValueError(f"layers_per_stage={sizes} must give each of the pp={stages} stages at least one block, the "
                             f"first stages the encoder's {encoder_blocks} and the rest the decoder's {decoder_blocks}")
        encoder_stages = sums.index(encoder_blocks)
    else:  # as even as the blocks allow, each stack at least one stage, one that cannot be cut exactly one
        total = encoder_blocks + decoder_blocks
        encoder_stages = min(max(1, round(stages * encoder_blocks / total)), stages - 1)
        if cut.encoder_why or cut.decoder_why:
            encoder_stages = 1 if cut.encoder_why else stages - 1
        sizes = (_even(encoder_blocks, encoder_stages) if encoder_stages <= encoder_blocks else None,
                 _even(decoder_blocks, stages - encoder_stages) if stages - encoder_stages <= decoder_blocks else None)
        if None in sizes:
            raise ValueError(f"pp={stages} is more stages than the encoder's {encoder_blocks} and the decoder's "
                             f"{decoder_blocks} blocks fill; use a smaller pp")
        sizes = [*sizes[0], *sizes[1]]
    for stack, count, why in (("encoder", encoder_stages, cut.encoder_why),
                              ("decoder", stages - encoder_stages, cut.decoder_why)):
        if count > 1 and why:
            raise ValueError(f"pp={stages} would cut the {stack} over {count} stages, but {why}; use pp=2 (the encoder "
                             f"on one stage, the decoder on the other)")
    ranges, start = [], 0
    for i, n in enumerate(sizes):
        start = 0 if i == encoder_stages else start
        ranges.append((start, start + n))
        start += n
    stages_plan = Seq2SeqStages(
        encoder=join(prefix, cut.encoder), decoder=join(prefix, cut.decoder),
        encoder_layers=join(prefix, cut.encoder_layers), decoder_layers=join(prefix, cut.decoder_layers),
        encoder_chunks=encoder_stages,
        encoder_cut=cut.encoder_cut.under(prefix) if encoder_stages > 1 and cut.encoder_cut else None,
        decoder_cut=cut.decoder_cut.under(prefix) if stages - encoder_stages > 1 and cut.decoder_cut else None,
        heads=heads, shared=tuple(join(prefix, n) for n in cut.shared))
    return stages_plan, tuple(ranges)


def check_seq2seq_pipeline(stacks: Seq2SeqStages, *, dp_shard: int, compile: bool, sequence_parallel: bool,
                           stages: int) -> None:
    """What an encoder-decoder pipeline does not compose with yet, each refused with its reason."""
    refused = [(dp_shard > 1, f"dp_shard={dp_shard}: FSDP's hooks under a pipeline enter through the task model, "
                              f"which an encoder stage does not run", "dp_shard=1"),
               (compile, "compile=True: the stacks' blocks are compiled for decoder-only stages only", "compile=False"),
               (sequence_parallel, "sequence_parallel=True: the decoder stages send the decoder's and the encoder's "
                                   "sequences joined, which no tp rank splits", "sequence_parallel=False")]
    for on, why, fix in refused:
        if on:
            raise ValueError(f"pp={stages} over an encoder-decoder with {why}; use {fix} or pp=1")


def _even(blocks: int, parts: int) -> list[int]:
    return [blocks // parts + (1 if i < blocks % parts else 0) for i in range(parts)]


def chunk_of(stacks: Seq2SeqStages, name: str, *, chunks: int, layer_ranges) -> int | None:
    """The chunk a module of an encoder-decoder pipeline belongs to (None: every chunk, or none of it
    is placed)."""
    def under(root: str | None) -> bool:
        return root is not None and (name == root or name.startswith(root + "."))

    if any(under(n) for n in stacks.shared):
        return None
    for first, stack, layers, cut, last in ((0, stacks.encoder, stacks.encoder_layers, stacks.encoder_cut,
                                             stacks.encoder_chunks - 1),
                                            (stacks.encoder_chunks, stacks.decoder, stacks.decoder_layers,
                                             stacks.decoder_cut, chunks - 1)):
        if under(layers) and name != layers:
            index = int(name[len(layers) + 1:].split(".")[0])
            return next(c for c in range(first, last + 1) if layer_ranges[c][0] <= index < layer_ranges[c][1])
        if cut is not None and any(under(n) for n in cut.last):
            return last
        if under(stack):
            return first  # the entry, what runs before the blocks, and a stack on one stage
    if any(under(h) for h in stacks.heads):
        return chunks - 1
    return None


class Absent(nn.Module):
    """A stack that runs on other stages: parameter-free; its forward is never called here. It keeps the
    stack's config, which the model's forward may read (EncoderDecoderModel compares its encoder's and
    decoder's widths before running either)."""

    def __init__(self, stands_for: nn.Module) -> None:
        super().__init__()
        if getattr(stands_for, "config", None) is not None:
            self.config = stands_for.config

    def forward(self, *args, **kwargs):
        raise RuntimeError("this pipeline stage runs the other stack of the encoder-decoder")


def stage_modules(model: nn.Module, stacks: Seq2SeqStages, *, chunk: int, layer_ranges, replace, injector_for):
    """Cut one stage's model (in place): its stack's blocks, the other stack ``Absent``, and within its
    stack the entry and what runs before and after the blocks as the stack's cut says for ``chunk``.
    Returns the injector of a stage that receives in its stack (None on a stack's first stage).
    ``replace(path, module)`` sets a module; ``injector_for(cut, module)`` makes the entry's stand-in."""
    stack, layers, cut = stacks.stack_of(chunk)
    other = stacks.decoder if stack == stacks.encoder else stacks.encoder
    if stack == stacks.encoder:
        for head in stacks.heads:
            replace(head, Absent(model.get_submodule(head)))
    replace(other, Absent(model.get_submodule(other)))
    blocks = model.get_submodule(layers)
    kept = nn.ModuleList()
    for i in range(*layer_ranges[chunk]):
        kept.add_module(str(i), blocks[i])  # the original index: parameter names stay Hugging Face's
    replace(layers, kept)
    first_chunk = stacks.first_chunk(chunk)
    last_chunk = stacks.encoder_chunks - 1 if stack == stacks.encoder else len(layer_ranges) - 1
    if cut is None:
        return None
    if chunk != last_chunk:
        for path in cut.last:
            replace(path, _standin(StandInKind.IDENTITY, model.get_submodule(path)))
        if stack == stacks.decoder:
            for head in stacks.heads:
                replace(head, _standin(StandInKind.IDENTITY, model.get_submodule(head)))
    if chunk == first_chunk:
        return None
    for path, kind in cut.first.items():
        replace(path, _standin(kind, model.get_submodule(path)))
    return injector_for(cut, model.get_submodule(cut.entry))


def _standin(kind, module: nn.Module) -> nn.Module:
    from .standins import standin_for

    return standin_for(kind, module)


def run_chunk(stage, stacks: Seq2SeqStages, *, chunk: int, inputs, received: torch.Tensor | None, kwargs: dict):
    """One microbatch through ``chunk`` of an encoder-decoder pipeline (module docstring): the tensor to
    send, or on the last chunk the task model's outputs. A stage short of the last calls its stack as
    the task model's forward calls it (the encoder on the source; the decoder on the decoder's inputs
    and the encoder's output with the source's mask)."""
    model = stage.model
    if chunk < stacks.encoder_chunks:
        if chunk > 0:  # the encoder's later stages receive in its entry's place, or at their first block
            stage.injector.pending = received
        encoder = model.get_submodule(stacks.encoder)
        return encoder(**_accepted(encoder, {**inputs, **kwargs})).last_hidden_state
    if chunk == stacks.encoder_chunks:
        encoded, hidden = received, None
    else:  # the decoder's inputs are in the batch here (step/batch.py refuses a batch without them)
        decoder_length = next(inputs[k].shape[1] for k in ("decoder_input_ids", "decoder_inputs_embeds") if k in inputs)
        hidden, encoded = received.split([decoder_length, received.shape[1] - decoder_length], dim=1)
        stage.injector.pending = hidden
    if chunk == len(stage.plan.layer_ranges) - 1:
        return model(**inputs, **kwargs, encoder_outputs=BaseModelOutput(last_hidden_state=encoded))
    decoder = model.get_submodule(stacks.decoder)
    given = {"input_ids": inputs.get("decoder_input_ids"), "inputs_embeds": inputs.get("decoder_inputs_embeds"),
             "attention_mask": inputs.get("decoder_attention_mask"), "encoder_hidden_states": encoded,
             "encoder_attention_mask": inputs.get("attention_mask"), **kwargs}
    decoded = decoder(**_accepted(decoder, {k: v for k, v in given.items() if v is not None}, decoder=True))
    return torch.cat([decoded.last_hidden_state, encoded], dim=1)


def _accepted(module: nn.Module, inputs: dict, *, decoder: bool = False) -> dict:
    """The inputs a stack's forward takes (an encoder takes the source, not the decoder's inputs)."""
    import inspect

    params = inspect.signature(module.forward).parameters
    return {k: v for k, v in inputs.items() if k in params and (decoder or not k.startswith("decoder_"))}
