"""Where transformers' own tp plan for an architecture is incomplete or wrong (data only; read by
``derive_policy``): rules added to it, and architectures whose plan cannot be made right with the
styles qn_hf has, which then refuse tp > 1 (data and pipeline parallelism still apply).

apertus (and Apertus 1.5's text model): the MLP's xIELU activation (``act_fn``) has learnable scalars
(``alpha_p``, ``alpha_n``) and runs on the column-parallel ``up_proj`` output, i.e. on this rank's share of
the intermediate features: its gradient is partial per rank and must be summed over tp. sarvam_moe: the
per-head query and key norms its plan leaves out, likewise.
"""

from ..compat import KV_REUSE, KV_SHARING_MODES, KV_STORE

# model_type -> the pipeline plan transformers does not declare (its ``base_model_pp_plan`` form):
# OLMoE's base model is Llama's (embedding, blocks, final norm) with MoE blocks.
PP_PLANS: dict[str, dict[str, tuple[list[str], list[str]]]] = {
    "olmoe": {"embed_tokens": (["input_ids"], ["inputs_embeds"]),
              "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
              "norm": (["hidden_states"], ["hidden_states"])},
}

AMENDMENTS: dict[str, dict[str, str]] = {
    "apertus": {"layers.*.mlp.act_fn": "replicated_with_grad_allreduce"},
    "apertus1p5_text": {"layers.*.mlp.act_fn": "replicated_with_grad_allreduce"},  # Apertus' xIELU, likewise
    # GLM-4-MoE's attention with use_qk_norm on (Sarvam's default): an RMSNorm over each head's width, which sees
    # only this rank's heads
    "sarvam_moe": {"layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
                   "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce"},
}

# model_type -> why tensor parallelism is refused
REFUSALS: dict[str, str] = {
    "doge": "it splits the attention's dt_proj rowwise, so every rank gets the dynamic mask of all "
            "KV heads while its attention holds only its own heads (the shapes no longer match); a correct "
            "split would need dt_proj's output and the per-head A sharded by head, which no style expresses",
    "neomme": "its value embeddings are looked up outside the attention for every KV head and added to the values "
              "inside it, and its plan leaves exclusive_self_attention.alpha (one value per head) whole: at tp each "
              "rank's attention holds a share of the heads and neither fits it",
    "gemma3n_text": "its MLP's activation sparsity (activation_sparsity_pattern) keeps the gate activations above "
                    "a threshold computed from their mean and standard deviation over the whole intermediate "
                    "dimension, which the plan splits across ranks (each rank would use its own slice's statistics)",
}

# model_type -> (n, why): the plan is right only at a tp that divides n, and refused at any other
TP_DIVIDES: dict[str, tuple[int, str]] = {
    "codegen": (4, "its qkv_proj holds the queries, values and keys in 4 blocks (mp_num: the 4 shards CodeGen was "
                   "trained on) that its forward cuts at a fixed width, so a rank's columns must be whole blocks"),
}

# model_type -> why context parallelism is refused, where the checks that read the config and the
# modules cannot see it
CP_REFUSALS: dict[str, str] = {
    "doge": "its attention adds a learned per-key dynamic mask (from dt_proj and A; past keep_window_size only the "
            "top-k keys) to the attention mask before "
            "the attention function, so ring attention would receive Doge's mask in place of the context-parallel "
            "batch's, and the ring has no per-key bias",
}

# config key -> the per-layer kind that reuses what the block before handed over (ModelPolicy.pp_carried):
# a DSA layer of kind "shared" takes the previous layer's top-k indices, a "full" one selects its own
CARRIED_REUSED_BY: dict[str, str] = {"indexer_types": "shared"}

# config key -> (the mode of a block that stores its keys and values, the mode of a later one that
# reuses those of the last storing block of its kind; ModelPolicy.pp_kv_sharing): Gemma 3n and 4
# (read with compat.per_layer: transformers before 5.23 derives the list where it is used)
KV_SHARED_BY: dict[str, tuple[str, str]] = {KV_SHARING_MODES: (KV_STORE, KV_REUSE)}
