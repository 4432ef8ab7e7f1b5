"""torchtitan's Llama 3 checkpoints as a ``KeyMap`` onto transformers' ``LlamaForCausalLM``.

torchtitan saves its model's own names at the top level of its DCP (``tok_embeddings.weight``,
``layers.<i>.attention.wq.weight``, since mid-2026 ``layers.<i>.attention.qkv_linear.wq.weight``, ``output.weight``,
later ``lm_head.weight``) beside ``optimizer.*`` (flattened per parameter), ``lr_scheduler``, ``dataloader`` and
``train_state``, which are not the model's. Its attention applies rotary embeddings to interleaved pairs of a head's
rows where transformers rotates its two halves, so its conversion to Hugging Face permutes the rows of ``wq`` and
``wk`` within each head (``torchtitan/models/llama3/state_dict_adapter.py``, ``_permute``): row ``2i + j`` of a head
becomes row ``j * head_dim / 2 + i``. The same reordering applies to the optimizer's moments of those weights.
"""

from __future__ import annotations

import re

import transformers

from .names import KeyMap, RowOrder

_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.qkv_linear.wq.weight": "self_attn.q_proj.weight",
    "attention.qkv_linear.wk.weight": "self_attn.k_proj.weight",
    "attention.qkv_linear.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight", "lm_head.weight": "lm_head.weight"}
# What torchtitan saves beside the model: its trainer's state, not tensors of the model (freqs_cis: a buffer
# older releases saved, recomputed by transformers)
NOT_MODEL = ("lr_scheduler", "dataloader", "train_state", "freqs_cis")
_LAYER_KEY = re.compile(r"layers\.(\d+)\.(.+)")
_ROTATED = re.compile(r"model\.layers\.\d+\.self_attn\.[qk]_proj\.weight")


def _rename(fqn: str) -> str | None:
    if fqn.split(".")[0] in NOT_MODEL:
        return None
    match = _LAYER_KEY.fullmatch(fqn)
    if match is not None and match[2] in _LAYER:
        return f"model.layers.{match[1]}.{_LAYER[match[2]]}"
    return _TOP.get(fqn, fqn)  # anything else keeps its name: unknown to the model, it is refused by name


def torchtitan_llama(config: transformers.PretrainedConfig) -> KeyMap:
    """The ``key_map`` that loads a torchtitan Llama 3 checkpoint into the ``LlamaForCausalLM`` of ``config``:
    ``pm.load_checkpoint(path, optimizer=opt, key_map=torchtitan_llama(model.config))``."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    half = head_dim // 2
    order = RowOrder(block=head_dim, order=tuple(2 * (r % half) + r // half for r in range(head_dim)))
    return KeyMap(rename=_rename, rows=lambda name: order if _ROTATED.fullmatch(name) else None)


# The mappings qn-hf-convert's --key-map names, each built from the model's config.
KEY_MAPS = {"torchtitan-llama": torchtitan_llama}
