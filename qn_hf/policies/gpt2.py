"""GPT-2's body (GPT2Model, under any head): Conv1D projections, fused q|k|v, wte (tied to an LM head,
which is found: policies/task.py)."""

from .model_policy import ModelPolicy

POLICY = ModelPolicy(
    model_type="gpt2",
    layers="h",
    tp_plan={
        "wte": "vocab_embedding",
        "h.*.attn.c_attn": "colwise_packed3",
        "h.*.attn.c_proj": "rowwise",
        "h.*.mlp.c_fc": "colwise",
        "h.*.mlp.c_proj": "rowwise",
    },
    # GPT2Attention splits the fused output with split_size; on a rank it is this rank's q width.
    attr_patches={"h.*.attn.split_size": "local_q_width"},
    # Attention dropout acts on this rank's heads; the residual dropout inside attn is replicated.
    # Their hidden_states feed only column layers: one input-gradient all-reduce per module.
    tp_entries=("h.*.attn", "h.*.mlp"),
    tp_rng_regions=("h.*.attn",),
    shared_rng_regions=("h.*.attn.resid_dropout",),
    forward_kwargs={"use_cache": False},
    # Pipeline: wte starts the first stage; GPT-2 always adds wpe(position_ids), so later stages
    # get zeros there, and the embedding dropout runs once, on the first stage.
    pp_entry="wte",
    pp_first={"wpe": "zeros", "drop": "identity"},
    pp_last={"ln_f": "identity"},
)
