"""ViT's body (ViTModel, under any head): the patch embedding stays replicated; the head is found
(policies/task.py)."""

from .model_policy import ModelPolicy

POLICY = ModelPolicy(
    model_type="vit",
    layers="layers",
    tp_plan={
        "layers.*.attention.q_proj": "colwise",
        "layers.*.attention.k_proj": "colwise",
        "layers.*.attention.v_proj": "colwise",
        "layers.*.attention.o_proj": "rowwise",
        "layers.*.mlp.fc1": "colwise",
        "layers.*.mlp.fc2": "rowwise",
    },
    # Their hidden_states feed only column layers: one input-gradient all-reduce per module.
    tp_entries=("layers.*.attention", "layers.*.mlp"),
    tp_rng_regions=("layers.*.attention",),
    # Pipeline: ViTModel reads the patch projection's dtype before calling the embeddings.
    pp_entry="embeddings",
    pp_entry_reads=("patch_embeddings.projection.weight",),
    pp_last={"layernorm": "identity", "pooler": "identity"},
)
