"""The tensor-parallel styles a policy rule can name, what each does, and transformers' names for them.

A rule names a module (``layers.*.mlp.up_proj``) or, for the ``param_*`` styles, one parameter
(``layers.*.mlp.experts.gate_up_proj``). Three mechanisms carry them out, none replacing a forward:

* leaf swaps: an exact ``nn.Linear``/``Conv1D``/``nn.Embedding`` (or a subclass with an adapter that
  keeps its extra behaviour, ``qn_hf.tensor_parallel.embedding_types``) becomes a parallel layer of ``qn_hf.tensor_parallel.layers``;
* parameter shards: a bare parameter is replaced by this rank's slice; its module is unchanged;
* hooks on a module: communication at its input or output, or on its parameters' gradients.
"""

from __future__ import annotations

# Leaf swaps of a Linear or Conv1D.
LINEAR_STYLES = {
    "colwise": "output features split; input enters the tp region (all-reduce of its gradient)",
    "colwise_kv": "colwise over KV heads, replicated on consecutive ranks when tp exceeds the KV heads",
    "colwise_packed2": "two fused outputs (gate|up) each split; a rank holds gate_r|up_r",
    "colwise_packed3": "three fused outputs (q|k|v) each split; a rank holds q_r|k_r|v_r",
    "colwise_gather": "colwise, then the output all-gathered: the module's consumers see the full width",
    "rowwise": "input features split; output all-reduced; bias added once",
    "rowwise_split": "rowwise on a full (replicated) input: this rank's slice is taken first",
    "vocab_colwise": "LM head: vocabulary columns split (padded); the logits stay sharded for the loss",
}
# The linear styles that split a weight along its outputs / its inputs (the vocabulary head aside).
COLUMN_STYLES = ("colwise", "colwise_kv", "colwise_packed2", "colwise_packed3", "colwise_gather")
ROW_STYLES = ("rowwise", "rowwise_split")
# Leaf swaps of an nn.Embedding.
EMBEDDING_STYLES = {
    "vocab_embedding": "rows of the vocabulary split (padded); lookups summed by an all-reduce",
    "embedding_colwise": "embedding dimension split; the lookups all-gathered",
}
# A bare parameter replaced by its slice (the dims follow transformers: colwise = ndim-2, rowwise = last).
PARAM_STYLES = {
    "param_colwise": "split along dim ndim-2 (dim 0 of a vector): the outputs of a [.., out, in] weight",
    "param_rowwise": "split along the last dim: the inputs of a [.., out, in] weight",
    "param_packed_colwise": "two fused parts along dim ndim-2 (gate|up of 3-D expert weights), each split",
    "param_packed_rowwise": "two fused parts along the last dim, each split",
}
# Hooks on a module; its parameters stay whole unless another rule shards them.
HOOK_STYLES = {
    "experts": "MoE experts holding a tp slice of every expert: hidden states and routing weights enter "
               "the tp region, the partial outputs are summed",
    "experts_identity": "an identity expert inside 'experts': its output is counted on tp rank 0 only",
    "all_reduce": "a module whose bare parameters are sharded by other rules: as 'experts', its float inputs "
                  "enter the tp region and its output (a partial sum) is all-reduced",
    "mla_kv_a": "MLA kv_a_proj (replicated): its rotary tail bypasses kv_b_proj and is used on local heads, "
                "so it enters the tp region (gradient all-reduced)",
    "replicate_grad_sum": "replicated parameters that see only this rank's heads (per-head norms): "
                          "their gradients are summed over tp",
    "replicate_after_row": "a whole layer fed by a row layer's sum (LoRA's B under a row-split A): whole "
                           "gradients, summed over tp only with sequence parallelism (each rank's slice)",
}
STYLES = (*LINEAR_STYLES, *EMBEDDING_STYLES, *PARAM_STYLES, *HOOK_STYLES, "replicate")

# transformers' style names (``base_model_tp_plan``) -> ours. A rule that names a parameter uses the
# ``param_*`` form of its style (``PARAM_FORM``). ``local_params`` only tells DTensor code to run
# the module on local tensors; qn_hf never wraps parameters, so it needs nothing (``None``).
HF_STYLES: dict[str, str | None] = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "packed_colwise": "colwise_packed2",
    "packed_rowwise": "param_packed_rowwise",
    "colwise_gather_output": "colwise_gather",
    "colwise_rep": "colwise_gather",
    "rowwise_split_input": "rowwise_split",
    "rowwise_rep": "rowwise_split",
    "embedding_rowwise": "vocab_embedding",
    "embedding_colwise": "embedding_colwise",
    "replicated_with_grad_allreduce": "replicate_grad_sum",
    "mla_kv_a_proj": "mla_kv_a",
    "all_reduce": "all_reduce",
    "moe_tp_experts": "experts",
    "moe_identity_expert": "experts_identity",
    "replicate": "replicate",
    "local_params": None,
}
PARAM_FORM = {
    "colwise": "param_colwise",
    "rowwise": "param_rowwise",
    "colwise_packed2": "param_packed_colwise",
    "param_packed_rowwise": "param_packed_rowwise",
    "replicate": "replicate",
    "replicate_grad_sum": "replicate_grad_sum",
}


def packed_parts(style: str) -> int:
    """Number of fused outputs a column style splits separately (``colwise_packed3`` -> 3)."""
    if style.startswith("colwise_packed"):
        return int(style.removeprefix("colwise_packed"))
    return 2 if style in ("param_packed_colwise", "param_packed_rowwise") else 1


def param_shard_dim(style: str, ndim: int) -> int | None:
    """The dim a ``param_*`` style splits (None: the parameter stays whole)."""
    if style in ("param_colwise", "param_packed_colwise"):
        return max(ndim - 2, 0)
    if style in ("param_rowwise", "param_packed_rowwise"):
        return None if ndim == 1 and style == "param_packed_rowwise" else ndim - 1
    raise ValueError(f"{style!r} is not a parameter style")
