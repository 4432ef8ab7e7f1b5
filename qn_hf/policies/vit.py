"""ViT (ViTModel, ViTForImageClassification): patch embedding and classifier stay replicated."""

from ..config.options import LossKind
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
    head_plan={"classifier": "replicate"},
    # Their hidden_states feed only column layers: one input-gradient all-reduce per module.
    tp_entries=("layers.*.attention", "layers.*.mlp"),
    tp_rng_regions=("layers.*.attention",),
    loss=LossKind.CLASSIFICATION,
    # Pipeline: ViTModel reads the patch projection's dtype before calling the embeddings.
    pp_entry="embeddings",
    pp_entry_reads=("patch_embeddings.projection.weight",),
    pp_last={"layernorm": "identity", "pooler": "identity"},
)
