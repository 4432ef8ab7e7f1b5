"""Llama's body (LlamaModel, under any head): separate q/k/v with grouped-query attention."""

from .model_policy import ModelPolicy

POLICY = ModelPolicy(
    model_type="llama",
    layers="layers",
    tp_plan={
        "embed_tokens": "vocab_embedding",
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise_kv",
        "layers.*.self_attn.v_proj": "colwise_kv",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    },
    # repeat_kv expands local KV heads to local query heads; replication changes that ratio.
    attr_patches={"layers.*.self_attn.num_key_value_groups": "local_kv_groups"},
    # Their hidden_states feed only column layers: one input-gradient all-reduce per module.
    tp_entries=("layers.*.self_attn", "layers.*.mlp"),
    tp_rng_regions=("layers.*.self_attn",),
    forward_kwargs={"use_cache": False},
    num_kv_heads_key="num_key_value_heads",
    # Pipeline: the rotary embedding (buffers only) and the causal mask are rebuilt on every stage.
    pp_entry="embed_tokens",
    pp_last={"norm": "identity"},
)
