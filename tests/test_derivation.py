"""The rules that derive a model's body where transformers declares no plan (policies/body.py,
structure.py, stack_cut.py, fused.py), each read off a shrunk meta-device model: no process, no weights.
Whether each derived plan trains equal to the plain model is tests/test_any_model.py's and the zoo's."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import CONFIG_MAPPING

from qn_hf.check.config_part import config_taken_by
from qn_hf.check.shrink import shrink_config
from qn_hf.policies import resolve_policy
from qn_hf.policies.body import body_policy
from qn_hf.policies.structure import Role, role_of
from tests.releases import needs_model_type


def _model(model_type: str, cls: str, **overrides):
    model_class = getattr(transformers, cls)
    with torch.device("meta"):
        return model_class(config_taken_by(shrink_config(CONFIG_MAPPING[model_type](**overrides), builds=model_class),
                                           model_class))


def _policy(model_type: str, cls: str, **overrides):
    return resolve_policy(_model(model_type, cls, **overrides), None)


@pytest.mark.parametrize(("path", "role"), [
    ("attention.self.query", Role.QUERY), ("self_attn.k_proj", Role.KEY), ("layer.0.SelfAttention.v", Role.VALUE),
    ("attention.output.dense", Role.OUTPUT), ("output.dense", Role.DOWN), ("intermediate.dense", Role.UP),
    ("attn.c_proj", Role.OUTPUT), ("mlp.c_proj", Role.DOWN), ("DenseReluDense.wi_0", Role.UP), ("mixer.x_proj", None),
])
def test_projection_roles_are_read_from_their_names(path, role):
    assert role_of(path) == role


@pytest.mark.parametrize(("model_type", "cls", "overrides", "rules", "patches"), [
    ("bert", "BertModel", {}, {"encoder.layer.*.attention.self.query": "colwise",
                               "encoder.layer.*.attention.output.dense": "rowwise",
                               "encoder.layer.*.output.dense": "rowwise"}, {}),
    ("t5", "T5ForConditionalGeneration", {},
     {"encoder.block.*.layer.0.SelfAttention.relative_attention_bias.weight": "param_rowwise",
      "decoder.block.*.layer.1.EncDecAttention.o": "rowwise"},
     {"encoder.block.*.layer.0.SelfAttention.n_heads": "local_heads"}),
    ("deberta-v2", "DebertaV2Model", {}, {}, {"encoder.layer.*.attention.self.num_attention_heads": "local_heads"}),
    ("xglm", "XGLMModel", {}, {}, {"layers.*.self_attn.embed_dim": "local_q_width"}),
    ("bloom", "BloomModel", {}, {"h.*.self_attention.query_key_value": "colwise"},
     {"h.*.self_attention.num_heads": "local_heads"}),
    ("falcon", "FalconModel", {}, {"h.*.self_attention.query_key_value": "colwise_shared_kv"}, {}),
    ("falcon", "FalconModel", {"new_decoder_architecture": True, "num_kv_heads": 2},
     {"h.*.self_attention.query_key_value": "colwise"}, {"h.*.self_attention.num_kv_heads": "local_kv_heads"}),
    ("mpt", "MptModel", {}, {"blocks.*.attn.Wqkv": "colwise_packed3"}, {"blocks.*.attn.n_heads": "local_heads"}),
    ("persimmon", "PersimmonModel", {}, {"layers.*.self_attn.q_layernorm": "replicate_grad_sum"}, {}),
    ("gpt_oss", "GptOssModel", {}, {"layers.*.self_attn.sinks": "param_colwise"}, {}),
    # projections named project_q ... attention_out, a gated MLP of w_in.w_0 and w_in.w_1, the head width as dim_head
    ("cpmant", "CpmAntModel", {}, {"encoder.layers.*.self_att.self_attention.project_k": "colwise",
                                   "encoder.layers.*.self_att.self_attention.attention_out": "rowwise",
                                   "encoder.layers.*.ffn.ffn.w_in.w_1": "colwise", "encoder.layers.*.ffn.ffn.w_out": "rowwise"},
     {"encoder.layers.*.self_att.self_attention.num_heads": "local_heads"}),
    # differential attention pairs head i of each half with head i of the other: each half split alike; its lambda
    # vectors (a head's width) used by every head, their gradients summed
    ("diffllama", "DiffLlamaModel", {}, {"layers.*.self_attn.q_proj": "colwise_packed2",
                                         "layers.*.self_attn.v_proj": "colwise_packed2",
                                         "layers.*.self_attn.o_proj": "rowwise",
                                         "layers.*.self_attn.lambda_k2": "replicate_grad_sum"}, {}),
    # an MLP as Sequential(Linear, ReLU, Linear), the head width kept as `depth`
    ("ctrl", "CTRLModel", {}, {"h.*.ffn.0": "colwise", "h.*.ffn.2": "rowwise", "h.*.multi_head_attention.Wq": "colwise",
                               "h.*.multi_head_attention.dense": "rowwise"}, {}),
    # a fused Conv1D q|k|v in blocks, a module keeping no head width (the config's heads)
    ("openai-gpt", "OpenAIGPTModel", {}, {"h.*.attn.c_attn": "colwise_packed3", "h.*.mlp.c_fc": "colwise"},
     {"h.*.attn.n_head": "local_heads", "h.*.attn.split_size": "local_q_width"}),
    # a gate and value side by side in one up projection (chunk(2)), and Wqkv in blocks
    ("modernbert", "ModernBertModel", {}, {"layers.*.attn.Wqkv": "colwise_packed3", "layers.*.mlp.Wi": "colwise_packed2",
                                           "layers.*.mlp.Wo": "rowwise", "layers.*.attn.Wo": "rowwise"}, {}),
    ("gpt_neox_japanese", "GPTNeoXJapaneseModel", {}, {"layers.*.attention.query_key_value": "colwise"},
     {"layers.*.attention.num_attention_heads": "local_heads"}),
    # Fuyu's language model is a Persimmon: the fused layout of its text config's type
    ("fuyu", "FuyuForCausalLM", {}, {"language_model.layers.*.self_attn.query_key_value": "colwise"}, {}),
    # X-MOD's per-language bottleneck adapters (hidden -> r -> hidden) after the MLP's row-parallel output: whole
    # a list of blocks of two classes (self- and cross-attention layers), each kind read apart
    ("mllama", "MllamaForCausalLM", {}, {"layers.*.self_attn.q_proj": "colwise", "layers.*.cross_attn.k_proj": "colwise_kv",
                                         "layers.*.cross_attn.o_proj": "rowwise", "layers.*.mlp.down_proj": "rowwise"},
     {"layers.*.cross_attn.num_heads": "local_heads", "layers.*.self_attn.num_key_value_heads": "local_kv_heads"}),
    ("xmod", "XmodForCausalLM", {"is_decoder": True},
     {"encoder.layer.*.output.dense": "rowwise", "encoder.layer.*.output.adapter_modules.en_XX.dense1": "replicate",
      "encoder.layer.*.output.adapter_modules.en_XX.dense2": "replicate"}, {}),
])
def test_tensor_parallel_rules_derived_from_the_structure(model_type, cls, overrides, rules, patches):
    policy = _policy(model_type, cls, **overrides)
    assert policy.tp_refusal is None
    for pattern, style in rules.items():
        assert policy.tp_plan[pattern] == style, (pattern, policy.tp_plan)
    for pattern, value in patches.items():
        assert policy.attr_patches[pattern] == value, (pattern, policy.attr_patches)


@pytest.mark.parametrize(("model_type", "cls", "parameter", "style"), [
    ("gpt_oss", "GptOssModel", "sinks", "param_colwise"),  # sized by config.num_attention_heads
    ("diffllama", "DiffLlamaModel", "lambda_q1", "replicate_grad_sum"),  # sized by self.head_dim
])
def test_a_vector_as_long_as_the_heads_and_a_heads_width_is_read_by_what_sizes_it(model_type, cls, parameter, style):
    # 8 heads of 8: the shape cannot tell one value per head from one per feature of a head (real gpt-oss: 64 of 64)
    sizes = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=8, head_dim=8, num_hidden_layers=1,
                 intermediate_size=32, vocab_size=128)
    with torch.device("meta"):
        model = getattr(transformers, cls)(CONFIG_MAPPING[model_type](**sizes))
    policy = resolve_policy(model, None)
    assert policy.tp_plan[f"layers.*.self_attn.{parameter}"] == style, policy.tp_plan


def test_a_width_read_as_a_slice_bound_is_no_head_count():
    # StableLM's rotary_ndims (a quarter of the head width) equals its head count shrunk; patched, tp=2 crashed
    patches = _policy("stablelm", "StableLmModel").attr_patches
    assert "layers.*.self_attn.num_heads" in patches and "layers.*.self_attn.rotary_ndims" not in patches


def test_a_norm_over_the_split_width_refuses_tp():
    from qn_hf.tensor_parallel.plan import build_tp_plan

    model = transformers.BitNetForCausalLM(shrink_config(CONFIG_MAPPING["bitnet"]()))
    with pytest.raises(ValueError, match=r"attn_sub_norm .* normalizes over the 64 features .*o_proj"):
        build_tp_plan(model, resolve_policy(model, None), tp=2)
    bert = transformers.BertForMaskedLM(shrink_config(CONFIG_MAPPING["bert"]()))  # its LayerNorm follows the row layer
    build_tp_plan(bert, resolve_policy(bert, None), tp=2)


@pytest.mark.parametrize(("model_type", "cls", "split", "whole"), [
    # LFM3: convolution blocks and attention blocks of one class; a gate per head beside the queries
    ("lfm3", "Lfm3Model", {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.g_proj": "colwise",
                           "layers.*.feed_forward.w2": "rowwise"}, ("layers.*.conv.in_proj", "layers.*.conv.out_proj")),
    # RecurrentGemma: temporal_block is an attention in some blocks, a recurrence in the others
    ("recurrent_gemma", "RecurrentGemmaModel", {"layers.*.temporal_block.q_proj": "colwise",
                                                "layers.*.temporal_block.o_proj": "rowwise"},
     ("layers.*.temporal_block.linear_x", "layers.*.temporal_block.linear_out")),
    # no attention it reads: the MLP splits, the rest stays whole (Bamba's defaults: Mamba mixers in every block)
    ("bamba", "BambaModel", {"layers.*.feed_forward.up_proj": "colwise", "layers.*.feed_forward.down_proj": "rowwise"},
     ("layers.*.mamba.in_proj", "layers.*.mamba.out_proj")),
    # CodeGen's fused qkv_proj holds its heads in an order of its own: the attention stays whole
    ("codegen", "CodeGenModel", {"h.*.mlp.fc_in": "colwise", "h.*.mlp.fc_out": "rowwise"},
     ("h.*.attn.qkv_proj", "h.*.attn.out_proj")),
])
def test_a_hybrid_stack_splits_its_attention_and_keeps_its_other_mixers_whole(model_type, cls, split, whole):
    needs_model_type(model_type)  # LFM3 is newer than transformers 5.17
    # the structure's reading (transformers 5.24 declares a plan for CodeGen: test_a_plan_held_at_some_tp_only...)
    policy = body_policy(_model(model_type, cls))
    assert policy.tp_refusal is None
    assert {k: policy.tp_plan[k] for k in split} == split
    assert all(policy.tp_plan[k] == "replicate" for k in whole)


def test_beside_no_attention_an_up_and_down_among_other_projections_are_no_mlp():
    from qn_hf.policies.structure import derive_block

    class Mixer(torch.nn.Module):  # an up, a recurrence's input projection and a down, side by side
        def __init__(self):
            super().__init__()
            self.in_proj, self.up_proj, self.down_proj = (torch.nn.Linear(64, 32), torch.nn.Linear(64, 128),
                                                          torch.nn.Linear(128, 64))

    derived = derive_block(Mixer(), heads_expected=4, hidden=64)
    assert derived.refusal is not None and "nor an MLP module of its own" in derived.refusal


@pytest.mark.parametrize(("model_type", "cls", "table", "attention"), [
    # a relative position bias looked up once, before the blocks, with a column per head, handed to every
    # attention as position_bias: MPNet's embedding, CpmAnt's parameter
    ("mpnet", "MPNetForMaskedLM", "encoder.relative_attention_bias", "encoder.layer.*.attention.attn"),
    ("cpmant", "CpmAntForCausalLM", "position_bias.relative_attention_bias", "encoder.layers.*.self_att.self_attention"),
])
def test_a_bias_per_head_made_outside_the_blocks_is_taken_per_head(model_type, cls, table, attention):
    policy = _policy(model_type, cls)
    assert policy.tp_plan[table] == "replicate_grad_sum", policy.tp_plan  # whole: each rank's heads' columns
    assert dict(policy.head_inputs) == {attention: {"position_bias": "batch, heads"}}


def test_a_bias_per_head_is_cut_where_its_heads_are_or_refused():
    from qn_hf.policies.fused import HeadAxis
    from qn_hf.tensor_parallel.hooks import head_input_hooks

    class Attention(torch.nn.Module):
        def forward(self, hidden_states, position_bias=None):
            return position_bias

    attention = Attention()
    head_input_hooks(attention, inputs={"position_bias": HeadAxis.AFTER_BATCH}, heads=4, tp=2, tp_rank=1)
    bias = torch.randn(2, 4, 3, 3)
    assert torch.equal(attention(None, position_bias=bias), bias[:, 2:])  # rank 1's heads, batch first
    with pytest.raises(ValueError, match=r"takes position_bias of shape \(4, 3, 3\), which does not hold the 4 heads"):
        attention(None, bias[0])  # (heads, q, k): its dim 1 is the queries, not the heads


def test_a_table_per_head_outside_the_attention_refuses_tp():
    import dataclasses

    from qn_hf.tensor_parallel.plan import build_tp_plan

    # the same table where no attention takes its rows per head (no head_inputs): the whole bias fits no rank
    model = transformers.MPNetForMaskedLM(shrink_config(CONFIG_MAPPING["mpnet"]()))
    policy = resolve_policy(model, None)
    policy = dataclasses.replace(policy, head_inputs={}, tp_plan={p: s for p, s in policy.tp_plan.items()
                                                                  if p != "encoder.relative_attention_bias"})
    with pytest.raises(ValueError, match=r"mpnet.encoder.relative_attention_bias .* a value per attention head"):
        build_tp_plan(model, policy, tp=2)
    t5 = transformers.T5ForConditionalGeneration(shrink_config(CONFIG_MAPPING["t5"]()))  # inside the attention
    build_tp_plan(t5, resolve_policy(t5, None), tp=2)


def test_an_entry_takes_every_column_layer_input():
    # CTRL's attention takes v, k and q apart: an entry's one all-reduce would miss q's and k's gradients
    assert not any("multi_head_attention" in e for e in _policy("ctrl", "CTRLModel").tp_entries)


def test_per_head_inputs_of_fused_architectures():
    assert dict(_policy("bloom", "BloomModel").head_inputs) == {"h.*.self_attention": {"alibi": "batch x heads"}}
    assert dict(_policy("mpt", "MptModel").head_inputs) == {"blocks.*.attn": {"position_bias": "heads"}}


@pytest.mark.parametrize(("model_type", "cls", "why"), [
    ("jetmoe", "JetMoeModel", r"no attention qn_hf can read .*, nor an MLP"),  # mixtures of attention and of MLPs
    ("falcon", "FalconModel", r"folds the ALiBi slopes"),
    ("neomme", "NeoMMEModel", r"value embeddings are looked up outside the attention"),  # amendments.py: data
    ("nystromformer", "NystromformerModel", r"attention.self.conv \(Conv2d\) holds weights over the 4 heads"),
    ("trocr", "TrOCRForCausalLM", r"reshapes its output by embed_dim"),  # a width read off the input's size()
    ("pegasus_x", "PegasusXModel", r"reshapes its output by dim.hidden_dim"),  # ... into a record of sizes
])
def test_what_the_derivation_cannot_read_refuses_tp_naming_it(model_type, cls, why):
    import re

    policy = _policy(model_type, cls, **({"alibi": True} if model_type == "falcon" else {}))
    assert policy.tp_refusal is not None and re.search(why, policy.tp_refusal), policy.tp_refusal


@pytest.mark.parametrize(("model_type", "cls", "entry", "first", "last", "receive"), [
    ("bert", "BertForSequenceClassification", "embeddings", {}, {"pooler": "identity"}, False),
    ("bloom", "BloomForCausalLM", "word_embeddings", {"word_embeddings_layernorm": "identity"},
     {"ln_f": "identity"}, False),
    ("gpt_neo", "GPTNeoForCausalLM", "wte", {"wpe": "zeros"}, {"ln_f": "identity"}, True),
    ("electra", "ElectraForMaskedLM", "embeddings", {"embeddings_project": "identity"}, {}, False),
    ("opt", "OPTForCausalLM", "decoder.embed_tokens", {"decoder.embed_positions": "zeros",
                                                       "decoder.project_in": "identity"},
     {"decoder.final_layer_norm": "identity", "decoder.project_out": "identity"}, False),
    # a head the forward never reaches, through the model's own methods either (predict_contacts runs it): held
    # by the last stage, run by none
    ("esm", "EsmForMaskedLM", "embeddings", {}, {"contact_head": "identity", "encoder.emb_layer_norm_after": "identity"},
     False),
    # the stack is the encoder's blocks, not the larger list of 50 XPath tables in the embeddings
    ("markuplm", "MarkupLMForSequenceClassification", "embeddings", {}, {"pooler": "identity"}, False),
])
def test_pipeline_cut_points_read_from_the_forwards(model_type, cls, entry, first, last, receive):
    policy = _policy(model_type, cls)
    assert policy.pp_refusal is None, policy.pp_refusal
    assert (policy.pp_entry, dict(policy.pp_first), dict(policy.pp_last), policy.pp_receive_at_blocks) == \
        (entry, first, last, receive)


@pytest.mark.parametrize(("model_type", "cls", "every_stage"), [
    # a table every block reads besides the hidden states, at the encoder's level (RoFormer's sinusoidal
    # positions, frozen; MPNet's relative position bias, made in a method of the encoder's forward)
    ("roformer", "RoFormerForMaskedLM", ("embeddings", "embeddings_project", "encoder.embed_positions")),
    ("mpnet", "MPNetForMaskedLM", ("embeddings", "encoder.relative_attention_bias")),
    ("ibert", "IBertForMaskedLM", ("embeddings",)),  # an embedding that is no nn.Embedding, changed before the blocks
    # a vision tower whose features the forward splices into the embeddings, in a method (get_image_features)
    ("modernvbert", "ModernVBertForMaskedLM", ("text_model.embeddings", "vision_model", "connector")),
    ("gemma3", "Gemma3ForSequenceClassification", ("language_model.embed_tokens", "vision_tower",
                                                   "multi_modal_projector")),
    # its loop makes each block's layer_type afresh from the config by position: nothing handed on
    ("ultravbert", "UltraVBertForMaskedLM", ("text_model.embed_tokens", "vision_model", "connector")),
])
def test_what_no_later_stage_can_stand_in_for_runs_on_every_stage(model_type, cls, every_stage):
    """Where what comes before the blocks is not the entry's output with modules applied in turn, every stage
    holds it and runs it, and its first block takes the received activation."""
    needs_model_type(model_type)
    policy = _policy(model_type, cls)
    assert policy.pp_refusal is None, policy.pp_refusal
    assert (policy.pp_every_stage, dict(policy.pp_first), policy.pp_receive_at_blocks) == (every_stage, {}, True)


def test_a_module_the_forward_never_names_where_it_hands_self_on_refuses_pp():
    """A module the forward never names is not taken as unused where the forward hands ``self`` on."""
    from torch import nn

    from qn_hf.policies.stack_cut import stack_cut

    def run_side(model, x):
        return model.side(x)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x):
            return self.linear(x)

    class Body(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(8, 4)
            self.layers = nn.ModuleList(Block() for _ in range(2))
            self.side = nn.Linear(4, 4)

        def forward(self, ids):
            x = self.embed(ids)
            for layer in self.layers:
                x = layer(x)
            return run_side(self, x)

    refusal = stack_cut(Body(), layers="layers", embeddings="embed")
    assert isinstance(refusal, str) and "side holds parameters Body's forward never names, and it hands self on" in refusal


def test_an_encoder_decoder_reading_more_of_its_encoders_output_than_its_last_state_refuses_pp():
    # Switch Transformers' loss adds its encoder's router losses, read off encoder_outputs.router_logits, which only
    # the encoder's stages have; LED rebuilds what it is given as its own output class: cut as any
    policy = _policy("switch_transformers", "SwitchTransformersForConditionalGeneration")
    assert policy.pp_refusal is not None and "encoder_outputs.router_logits" in policy.pp_refusal, policy.pp_refusal
    assert _policy("led", "LEDForConditionalGeneration").pp_refusal is None


def test_a_stack_whose_forward_reshapes_the_embedding_refuses_pp():
    policy = _policy("swin", "SwinForImageClassification")
    assert "changes the embedding (embeddings, a SwinEmbeddings)" in policy.pp_refusal
    # every stage could compute the embedding, but each of Swin's stages hands the next its output size
    assert "blocks hand each other input_dimensions besides the hidden states" in policy.pp_refusal
    # LUKE's entity stream runs beside the words' through every block (none in a text-only batch: the check's
    # step would not tell)
    assert "hand each other entity_hidden_states" in _policy("luke", "LukeForMaskedLM").pp_refusal


def test_a_plan_naming_another_models_blocks_leaves_the_body_to_the_structure():
    # Llama 4's config carries its text model's plan ("layers.*"), whose blocks sit under language_model in the
    # multimodal model: dp=2 was refused for it; the body is found from the structure instead
    policy = _policy("llama4", "Llama4ForConditionalGeneration")
    assert policy.layers == "language_model.model.layers", policy.layers


@pytest.mark.parametrize(("model_type", "cls", "attention"), [
    ("qwen2", "Qwen2Model", "layers.*.self_attn"), ("gpt_oss", "GptOssModel", "layers.*.self_attn")])
def test_a_plan_of_the_embedding_alone_leaves_the_blocks_to_the_structure(model_type, cls, attention):
    # transformers 5.24 declares {"embed_tokens": "embedding_rowwise"} alone for GPT-OSS, Bamba, LFM2...: the blocks
    # are split as the structure reads them, not left whole, and the embedding vocabulary-parallel as that plan says
    model = _model(model_type, cls)
    model.config.base_model_tp_plan = {"embed_tokens": "embedding_rowwise"}
    policy = resolve_policy(model, None)
    assert policy.tp_refusal is None
    assert policy.tp_plan[f"{attention}.q_proj"] == "colwise" and policy.tp_plan[f"{attention}.o_proj"] == "rowwise"
    assert policy.tp_plan["embed_tokens"] == "vocab_embedding"


def test_a_plan_held_at_some_tp_only_is_refused_at_the_others():
    from qn_hf.tensor_parallel.plan import build_tp_plan

    # CodeGen's fused q|v|k in 4 blocks: transformers 5.24's colwise plan (declared here for the older releases)
    # is right where tp divides 4
    model = _model("codegen", "CodeGenForCausalLM", n_head=8)
    model.config.base_model_tp_plan = {"h.*.attn.qkv_proj": "colwise", "h.*.attn.out_proj": "rowwise",
                                       "h.*.mlp.fc_in": "colwise", "h.*.mlp.fc_out": "rowwise"}
    policy = resolve_policy(model, None)
    assert policy.transformers_plan and policy.tp_divides[0] == 4
    for tp in (2, 4):
        assert build_tp_plan(model, policy, tp=tp).tp == tp
    with pytest.raises(ValueError, match=r"^tp=8 does not divide 4 for codegen: its qkv_proj .* use a tp among \[1, 2, 4\]"):
        build_tp_plan(model, policy, tp=8)


def test_an_init_a_decorator_wraps_without_naming_it_is_read_as_written():
    # transformers 5.25's use_kernelized_func replaces an attention's __init__ by a new_init that calls it, with no
    # functools.wraps: what sizes a parameter is still read from the class's own __init__
    from qn_hf.policies.forward_reads import sized_by

    def kernelized(cls):
        orig_init = cls.__init__

        def new_init(self, *args, **kwargs):
            orig_init(self, *args, **kwargs)

        cls.__init__ = new_init
        return cls

    @kernelized
    class Attention(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.sinks = torch.nn.Parameter(torch.empty(config.num_attention_heads))

    module = Attention(transformers.LlamaConfig(num_attention_heads=4))
    assert {"config", "num_attention_heads"} <= sized_by(module, "sinks")
