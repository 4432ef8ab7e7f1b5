"""The vocabulary of pipeline cuts (data only): what a module of the first or last stage becomes on
the others, and how a stack of blocks, or an encoder-decoder's two, is cut (found by stack_cut.py)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..arguments import Choice


class StandIn(Choice):
    """What a module of the first or last stage only becomes on the other stages."""

    ZEROS = "zeros"  # an embedding whose output is added to the received activation (GPT-2's wpe)
    IDENTITY = "identity"  # passes the activation through (dropout after the embedding, the final norm)


@dataclass(frozen=True)
class StackCut:
    """The pipeline's cut points of a base model, as ``ModelPolicy`` names them (paths from the base)."""

    entry: str
    first: dict[str, StandIn] = field(default_factory=dict)
    last: dict[str, StandIn] = field(default_factory=dict)
    entry_reads: tuple[str, ...] = ()
    receive_at_blocks: bool = False
    # real on every stage, the entry first (``ModelPolicy.pp_every_stage``): each stage computes what comes
    # before the blocks from the batch, and its first block takes the received activation instead
    every_stage: tuple[str, ...] = ()
    # the blocks are one shared module the loop calls this config key's count of times (looped.py): a stage
    # cuts the iterations, and the module is among ``every_stage``
    loop_count: str | None = None
    # a loop body written out over parallel lists (indexed_lists.py): the list the stages cut by and send the
    # output of (not the one the policy names), and the others, each kept at full length on every stage
    blocks: str | None = None
    siblings: tuple[str, ...] = ()

    def under(self, prefix: str) -> StackCut:
        """This cut with every path under ``prefix`` (a stack's path in the base model, or the base's in the
        top model)."""
        def at(path: str) -> str:
            return f"{prefix}.{path}" if prefix and path else prefix or path

        return replace(self, entry=at(self.entry), first={at(k): v for k, v in self.first.items()},
                       last={at(k): v for k, v in self.last.items()}, every_stage=tuple(map(at, self.every_stage)),
                       blocks=at(self.blocks) if self.blocks else None, siblings=tuple(map(at, self.siblings)))


@dataclass(frozen=True)
class Seq2SeqCut:
    """An encoder-decoder's two stacks for a pipeline of encoder stages, then decoder stages (paths
    from the base model). Each stack's ``cut`` says how a later stage of it receives (None: the stack
    cannot be split, ``why``; it then runs whole on one stage). ``carried``: what a stack's blocks
    hand each other besides the hidden states (T5's position biases, made by its first block), which
    no boundary carries, so such a stack is never split. ``shared``: the modules holding the input
    embedding's weight that both stacks (and a tied head) use: real on every stage, their gradients
    summed over the pipeline."""

    encoder: str
    decoder: str
    encoder_layers: str
    decoder_layers: str
    encoder_cut: StackCut | None
    decoder_cut: StackCut | None
    encoder_why: str = ""
    decoder_why: str = ""
    shared: tuple[str, ...] = ()
