"""How an encoder-decoder is cut into pipeline stages: its encoder's stack and its decoder's, each cut
as stack_cut.py cuts a decoder-only model's, or run whole on one stage where it cannot be."""

from __future__ import annotations

from torch import nn

from .cuts import Seq2SeqCut
from .forward_reads import encoder_output_reads
from .patterns import join
from .stack_cut import stack_cut


def seq2seq_cut(model: nn.Module, base: nn.Module, *, lists, embeddings, carried) -> Seq2SeqCut | str:
    """The two stacks of an encoder-decoder (``config.is_encoder_decoder``, ``get_encoder``/``get_decoder``)
    and how each may be split (``stack_cut`` on each), or why it cannot be cut into stages at all.
    ``lists``, ``embeddings`` and ``carried`` are body.py's finders: a module's lists of blocks, its input
    embedding's path, and what its blocks carry over."""
    try:
        encoder, decoder = model.get_encoder(), model.get_decoder()
    except (AttributeError, NotImplementedError, TypeError):
        return "it names no encoder and decoder (get_encoder, get_decoder)"
    beyond = encoder_output_reads(model, base)
    if beyond:
        return (f"its forward reads {', '.join(f'encoder_outputs.{a}' for a in beyond)}, which the encoder's stages "
                f"hold: the decoder's stages receive the encoder's last hidden state only")
    paths = {id(m): n for n, m in base.named_modules()}
    if id(encoder) not in paths or id(decoder) not in paths or encoder is decoder:
        return "its encoder and decoder are not two modules of its base model"
    stacks = []
    for module in (encoder, decoder):
        found = lists(module)
        if not found:
            return f"its {type(module).__name__} holds no list of blocks"
        layers = found[0]
        why = ""
        if carried(module, layers):
            why = (f"its blocks hand each other {', '.join(carried(module, layers))} besides the hidden states (made by "
                   f"the first block), which no stage boundary carries")
            cut = None
        else:
            cut = stack_cut(module, layers=layers, embeddings=embeddings(module))
            if isinstance(cut, str):
                cut, why = None, cut
            elif cut.every_stage:  # seq2seq.py places a stack's modules on its own stages only
                cut, why = None, (f"{', '.join(cut.every_stage[1:])} would be real on each of its stages, which "
                                  f"an encoder-decoder's stages do not hold")
        stacks.append((paths[id(module)], layers, cut, why))
    (enc, enc_layers, enc_cut, enc_why), (dec, dec_layers, dec_cut, dec_why) = stacks
    weight = getattr(model.get_input_embeddings(), "weight", None) if hasattr(model, "get_input_embeddings") else None
    shared = tuple(n for n, m in base.named_modules() if weight is not None and getattr(m, "weight", None) is weight
                   and not n.startswith((enc + ".", dec + ".")))
    return Seq2SeqCut(encoder=enc, decoder=dec, encoder_layers=join(enc, enc_layers), decoder_layers=join(dec, dec_layers),
                      encoder_cut=enc_cut.under(enc) if enc_cut else None,
                      decoder_cut=dec_cut.under(dec) if dec_cut else None,
                      encoder_why=enc_why, decoder_why=dec_why, shared=shared)
