"""The tensor-parallel styles a policy rule can name, what each does, and transformers' names for them.

A rule names a module (``layers.*.mlp.up_proj``) or, for the ``param_*`` styles, one parameter
(``layers.*.mlp.experts.gate_up_proj``). Three mechanisms carry them out, none replacing a forward:

* leaf swaps: an exact ``nn.Linear``/``Conv1D``/``nn.Embedding`` (or a subclass with an adapter that
  keeps its extra behaviour, ``qn_hf.policies.embedding_types``) becomes a parallel layer of ``qn_hf.tensor_parallel.layers``;
* parameter shards: a bare parameter is replaced by this rank's slice; its module is unchanged;
* hooks on a module: communication at its input or output, or on its parameters' gradients.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..arguments import Choice


class Mechanism(enum.Enum):
    """How a style is carried out (the three mechanisms above; ``REPLICATE`` does nothing)."""

    LINEAR = "leaf swap of a Linear or Conv1D"
    EMBEDDING = "leaf swap of an nn.Embedding"
    PARAM = "a bare parameter replaced by its slice"
    HOOK = "hooks on an unchanged module"
    REPLICATE = "nothing: the module stays whole on every rank"


class Split(enum.Enum):
    """Which side of a linear weight a style splits (``NONE`` for everything that is not a split linear)."""

    COLUMN = "outputs"
    ROW = "inputs"
    NONE = "neither"


class Style(Choice):
    """A tensor-parallel style. Its traits (mechanism, split side, fused parts) are data in ``TRAITS``;
    nothing parses them out of the name. Policies may give the plain string: ``ModelPolicy`` converts."""

    COLWISE = "colwise"
    COLWISE_KV = "colwise_kv"
    COLWISE_PACKED2 = "colwise_packed2"
    COLWISE_PACKED3 = "colwise_packed3"
    COLWISE_GATHER = "colwise_gather"
    COLWISE_SHARED_KV = "colwise_shared_kv"
    ROWWISE = "rowwise"
    ROWWISE_SPLIT = "rowwise_split"
    VOCAB_COLWISE = "vocab_colwise"
    VOCAB_EMBEDDING = "vocab_embedding"
    EMBEDDING_COLWISE = "embedding_colwise"
    PARAM_COLWISE = "param_colwise"
    PARAM_ROWWISE = "param_rowwise"
    PARAM_PACKED_COLWISE = "param_packed_colwise"
    PARAM_PACKED_ROWWISE = "param_packed_rowwise"
    EXPERTS = "experts"
    EXPERTS_IDENTITY = "experts_identity"
    ALL_REDUCE = "all_reduce"
    MLA_KV_A = "mla_kv_a"
    REPLICATE_GRAD_SUM = "replicate_grad_sum"
    REPLICATE_AFTER_ROW = "replicate_after_row"
    REPLICATE = "replicate"

    @property
    def mechanism(self) -> Mechanism:
        return TRAITS[self].mechanism

    @property
    def split(self) -> Split:
        return TRAITS[self].split

    @property
    def parts(self) -> int:
        """Number of fused outputs (or inputs) the style splits separately (``colwise_packed3``: 3)."""
        return TRAITS[self].parts

    @property
    def description(self) -> str:
        return TRAITS[self].description


@dataclass(frozen=True)
class Traits:
    mechanism: Mechanism
    description: str
    split: Split = Split.NONE
    parts: int = 1


_L, _E, _P, _H = Mechanism.LINEAR, Mechanism.EMBEDDING, Mechanism.PARAM, Mechanism.HOOK
_C, _R = Split.COLUMN, Split.ROW
TRAITS: dict[Style, Traits] = {
    Style.COLWISE: Traits(_L, "output features split; input enters the tp region (all-reduce of its gradient)", _C),
    Style.COLWISE_KV: Traits(_L, "colwise over KV heads, replicated on consecutive ranks when tp exceeds the KV heads",
                             _C),
    Style.COLWISE_PACKED2: Traits(_L, "two fused outputs (gate|up) each split; a rank holds gate_r|up_r", _C, 2),
    Style.COLWISE_PACKED3: Traits(_L, "three fused outputs (q|k|v) each split; a rank holds q_r|k_r|v_r", _C, 3),
    Style.COLWISE_GATHER: Traits(_L, "colwise, then the output all-gathered: the module's consumers see the full "
                                     "width", _C),
    # A multi-query fused q|k|v ([every head's queries | one key | one value]): no column split keeps a
    # rank's queries with the key and value every head shares, so the weight stays whole on every rank
    # and each rank computes the rows it needs; its gradients (each rank's part of the rows) are summed.
    Style.COLWISE_SHARED_KV: Traits(_L, "multi-query fused q|k|v, whole: this rank computes its heads' query rows and "
                                        "the shared key and value rows; gradients summed over tp", _C),
    Style.ROWWISE: Traits(_L, "input features split; output all-reduced; bias added once", _R),
    Style.ROWWISE_SPLIT: Traits(_L, "rowwise on a full (replicated) input: this rank's slice is taken first", _R),
    # The vocabulary head splits its outputs too, but as the head (padded, logits kept sharded for
    # the loss), not as one of the column styles a LoRA layer or the planner treats alike.
    Style.VOCAB_COLWISE: Traits(_L, "LM head: vocabulary columns split (padded); the logits stay sharded for the "
                                    "loss"),
    Style.VOCAB_EMBEDDING: Traits(_E, "rows of the vocabulary split (padded); lookups summed by an all-reduce"),
    Style.EMBEDDING_COLWISE: Traits(_E, "embedding dimension split; the lookups all-gathered"),
    # Parameter dims follow transformers: colwise = ndim-2 (dim 0 of a vector), rowwise = last.
    Style.PARAM_COLWISE: Traits(_P, "split along dim ndim-2 (dim 0 of a vector): the outputs of a [.., out, in] "
                                    "weight", _C),
    Style.PARAM_ROWWISE: Traits(_P, "split along the last dim: the inputs of a [.., out, in] weight", _R),
    Style.PARAM_PACKED_COLWISE: Traits(_P, "two fused parts along dim ndim-2 (gate|up of 3-D expert weights), each "
                                           "split", _C, 2),
    Style.PARAM_PACKED_ROWWISE: Traits(_P, "two fused parts along the last dim, each split", _R, 2),
    Style.EXPERTS: Traits(_H, "MoE experts holding a tp slice of every expert: hidden states and routing weights "
                              "enter the tp region, the partial outputs are summed"),
    Style.EXPERTS_IDENTITY: Traits(_H, "an identity expert inside 'experts': its output is counted on tp rank 0 "
                                       "only"),
    Style.ALL_REDUCE: Traits(_H, "a module whose bare parameters are sharded by other rules: as 'experts', its "
                                 "float inputs enter the tp region and its output (a partial sum) is all-reduced"),
    Style.MLA_KV_A: Traits(_H, "MLA kv_a_proj (replicated): its rotary tail bypasses kv_b_proj and is used on "
                               "local heads, so it enters the tp region (gradient all-reduced)"),
    Style.REPLICATE_GRAD_SUM: Traits(_H, "replicated parameters that see only this rank's heads (per-head norms): "
                                         "their gradients are summed over tp"),
    Style.REPLICATE_AFTER_ROW: Traits(_H, "a whole layer fed by a row layer's sum (LoRA's B under a row-split A): "
                                          "whole gradients, summed over tp only with sequence parallelism (each "
                                          "rank's slice)"),
    Style.REPLICATE: Traits(Mechanism.REPLICATE, "the module stays whole on every rank"),
}
assert set(TRAITS) == set(Style)


def styles(mechanism: Mechanism, split: Split | None = None) -> tuple[Style, ...]:
    return tuple(s for s in Style if s.mechanism is mechanism and (split is None or s.split is split))


LINEAR_STYLES = styles(Mechanism.LINEAR)
EMBEDDING_STYLES = styles(Mechanism.EMBEDDING)
PARAM_STYLES = styles(Mechanism.PARAM)
HOOK_STYLES = styles(Mechanism.HOOK)
# The linear layers that split a weight along its outputs / its inputs (the vocabulary head aside).
COLUMN_STYLES = styles(Mechanism.LINEAR, Split.COLUMN)
ROW_STYLES = styles(Mechanism.LINEAR, Split.ROW)
STYLES = Style.values()
# Styles that keep their parameters whole on every tp rank.
WHOLE_STYLES = (Style.REPLICATE, Style.REPLICATE_GRAD_SUM, Style.REPLICATE_AFTER_ROW)
# Styles that split a weight the same way: the padded vocabulary rows of an embedding and its head.
VOCAB_ROWS = (Style.VOCAB_EMBEDDING, Style.VOCAB_COLWISE)
# Styles whose gradients tp must sum because each rank's parameter sees only its part of the input.
REPLICATED_SUMMED = (Style.REPLICATE_GRAD_SUM, Style.REPLICATE_AFTER_ROW)
# Linear styles whose weight stays whole on every rank, its gradient summed over tp (each rank's part).
WHOLE_SUMMED_LINEAR = (Style.COLWISE_SHARED_KV,)

# transformers' style names (``base_model_tp_plan``) -> ours. A rule that names a parameter uses the
# ``param_*`` form of its style (``PARAM_FORM``). ``local_params`` only tells DTensor code to run
# the module on local tensors; qn_hf never wraps parameters, so it needs nothing (``None``).
HF_STYLES: dict[str, Style | None] = {
    "colwise": Style.COLWISE,
    "rowwise": Style.ROWWISE,
    "packed_colwise": Style.COLWISE_PACKED2,
    "packed_rowwise": Style.PARAM_PACKED_ROWWISE,
    "colwise_gather_output": Style.COLWISE_GATHER,
    "colwise_rep": Style.COLWISE_GATHER,
    "rowwise_split_input": Style.ROWWISE_SPLIT,
    "rowwise_rep": Style.ROWWISE_SPLIT,
    "embedding_rowwise": Style.VOCAB_EMBEDDING,
    "embedding_colwise": Style.EMBEDDING_COLWISE,
    "replicated_with_grad_allreduce": Style.REPLICATE_GRAD_SUM,
    "mla_kv_a_proj": Style.MLA_KV_A,
    "all_reduce": Style.ALL_REDUCE,
    "moe_tp_experts": Style.EXPERTS,
    "moe_identity_expert": Style.EXPERTS_IDENTITY,
    "replicate": Style.REPLICATE,
    "local_params": None,
}
PARAM_FORM: dict[Style, Style] = {
    Style.COLWISE: Style.PARAM_COLWISE,
    Style.ROWWISE: Style.PARAM_ROWWISE,
    Style.COLWISE_PACKED2: Style.PARAM_PACKED_COLWISE,
    Style.PARAM_PACKED_ROWWISE: Style.PARAM_PACKED_ROWWISE,
    Style.REPLICATE: Style.REPLICATE,
    Style.REPLICATE_GRAD_SUM: Style.REPLICATE_GRAD_SUM,
}


def packed_parts(style: Style) -> int:
    """Number of fused outputs a style splits separately (``colwise_packed3`` -> 3)."""
    return Style(style).parts


def param_shard_dim(style: Style, ndim: int) -> int | None:
    """The dim a ``param_*`` style splits (None: the parameter stays whole)."""
    style = Style(style)
    if style.mechanism is not Mechanism.PARAM:
        raise ValueError(f"{style!r} is not a parameter style")
    if style.split is Split.COLUMN:
        return max(ndim - 2, 0)
    return None if ndim == 1 and style.parts > 1 else ndim - 1
