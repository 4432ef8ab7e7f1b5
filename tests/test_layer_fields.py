"""Config fields a layer holds a value of its own (transformers' per-layer configs, Gemma 4's
full-attention layers with their own head_dim and KV heads): read per layer wherever qn_hf reads
them, so every dimension trains equal to the plain model, or refuses naming the layer."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from qn_hf.policies.heads import head_layout
from qn_hf.policies.layer_fields import is_per_layer, layer_value, layer_values
from tests.cases import mesh_for

pytestmark = pytest.mark.skipif(not hasattr(AutoConfig.for_model("llama"), "per_layer_config"),
                                reason="this transformers has no per-layer configs")


def gemma4(**overrides):
    """Gemma 4 with full-attention layers (1 and 3) twice as wide per head as the sliding ones."""
    kw = dict(head_dim=16, global_head_dim=32, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=64, num_hidden_layers=4, vocab_size=128, hidden_size_per_layer_input=8,
              vocab_size_per_layer_input=128, max_position_embeddings=64, sliding_window=8,
              layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])
    return AutoConfig.for_model("gemma4_text", **{**kw, **overrides})


def test_fields_read_per_layer():
    config = gemma4()
    assert is_per_layer(config, "head_dim") and not is_per_layer(config, "num_attention_heads")
    assert layer_values(config, "head_dim") == (16, 32, 16, 32)
    assert layer_value(config, "head_dim", 3) == 32 and layer_value(config, "num_attention_heads", 3) == 4
    plain = layer_values(AutoConfig.for_model("llama", num_hidden_layers=3), "num_attention_heads")
    assert len(plain) == 3 and len(set(plain)) == 1  # a config without per-layer values: the model's, per layer
    assert head_layout(config, tp=2, num_kv_heads_key="num_key_value_heads").head_dim == 16


def test_every_layers_heads_checked():
    """tp must split the heads of every layer, not only the first's."""
    config = gemma4(attention_k_eq_v=True, num_global_key_value_heads=3, num_attention_heads=6)
    with pytest.raises(ValueError, match="tp=2 does not divide num_key_value_heads=3"):
        head_layout(config, tp=2, num_kv_heads_key="num_key_value_heads")


def _step(*, config: dict, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1, **keywords) -> dict:
    from qn_hf.check.run import one_step_parity

    return one_step_parity(config=config, mesh=mesh_for(dp, tp, pp, cp), dp=dp, tp=tp, pp=pp, cp=cp, **keywords)


MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)


@pytest.mark.parametrize(("mesh", "overrides", "expected"), [
    (dict(pp=2), {}, "equal"),
    (dict(tp=2), {}, "equal"),
    (dict(tp=2, sequence_parallel=True), {}, "equal"),
    (dict(cp=2), {}, "equal"),
    (dict(dp=2, dp_shard=2), {}, "equal"),
    (dict(dp=2, ep=2), MOE, "equal"),
    (dict(pp=2), MOE, "equal"),
    pytest.param(dict(tp=2, ep=2), MOE, "equal", marks=pytest.mark.long),
    # the full-attention layers' single KV head (keys are values): tp=2 cannot split it
    (dict(pp=2), dict(attention_k_eq_v=True, num_global_key_value_heads=1), "equal"),
    (dict(tp=2), dict(attention_k_eq_v=True, num_global_key_value_heads=1),
     "refused: tp=2 exceeds the 1 KV heads of model.layers.1.self_attn"),
])
def test_per_layer_heads_at_every_dimension(worlds, mesh, overrides, expected):
    world = mesh.get("dp", 1) * mesh.get("tp", 1) * mesh.get("pp", 1) * mesh.get("cp", 1)
    verdict = worlds.run(world, _step, config=gemma4(**overrides).to_dict(), **mesh)[0]
    assert f"{verdict['verdict']}: {verdict['reason']}".startswith(expected), verdict
