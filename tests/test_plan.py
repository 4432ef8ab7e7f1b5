"""Policy resolution and validation, on one process: every bad configuration is a ValueError that
names the value and the fix, raised before any process group is touched."""

from __future__ import annotations

import dataclasses

import pytest
import torch.distributed as dist
from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import qn_hf
from qn_hf.policies import derive_policy, resolve_policy
from qn_hf.policies.heads import HeadLayout
from qn_hf.policies.model_policy import ModelPolicy
from qn_hf.tensor_parallel.plan import build_tp_plan
from tests.models import CONFIGS, auto_class


def tiny(kind: str):
    return auto_class(kind).from_config(CONFIGS[kind])


@pytest.fixture(autouse=True)
def no_process_group():
    yield
    assert not dist.is_initialized(), "validation must fail before any process group exists"


def test_world_size_mismatch_names_the_numbers(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"world size 4 != dp\*tp\*pp = 2\*1\*1 = 2"):
        qn_hf.parallelize(tiny("gpt2"), dp=2)


def test_tp_must_divide_heads():
    with pytest.raises(ValueError, match=r"tp=3 does not divide num_attention_heads=4; use a tp among \[1, 2, 4\]"):
        build_tp_plan(tiny("gpt2"), resolve_policy(tiny("gpt2"), None), tp=3)


@pytest.mark.parametrize(
    ("heads", "kv", "tp", "message"),
    [
        (12, 6, 4, r"tp=4 does not divide num_key_value_heads=6"),
        (12, 4, 6, r"tp=6 exceeds num_key_value_heads=4 but is not a multiple of it"),
    ],
)
def test_kv_heads_must_split_or_replicate_evenly(heads, kv, tp, message):
    with pytest.raises(ValueError, match=message):
        HeadLayout(heads=heads, kv_heads=kv, head_dim=4, tp=tp)


def test_kv_replication_layout():
    layout = HeadLayout(heads=8, kv_heads=2, head_dim=4, tp=4)
    assert layout.kv_replicas == 2
    assert [layout.value(v) for v in ("local_heads", "local_kv_heads", "local_kv_groups")] == [2, 1, 2]


def test_a_model_without_a_tp_plan_gets_its_body_and_a_derived_plan(monkeypatch):
    """No "unsupported architecture": a type with neither a policy nor a transformers plan gets its body
    found (policies/body.py) and a tp plan derived from its structure (policies/structure.py); what the
    derivation cannot read refuses tp alone, naming the dimension and the layer."""
    model = BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64))
    policy = resolve_policy(model, None)
    assert policy.layers == "encoder.layer" and policy.tp_refusal is None
    assert policy.tp_plan["encoder.layer.*.attention.self.query"] == "colwise"
    assert policy.tp_plan["encoder.layer.*.attention.output.dense"] == "rowwise"
    assert policy.tp_plan["encoder.layer.*.intermediate.dense"] == "colwise"
    assert policy.tp_plan["embeddings.word_embeddings"] == "vocab_embedding"
    from transformers import CONFIG_MAPPING, JetMoeModel

    from qn_hf.check.shrink import shrink_config

    # JetMoE's mixtures of attention and of MLP experts: neither an attention nor an MLP qn_hf can read
    jetmoe = JetMoeModel(shrink_config(CONFIG_MAPPING["jetmoe"]()))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"^tp=2: transformers declares no tp plan for 'jetmoe'.*layers\.0: no attention qn_hf can read.*use tp=1"):
        qn_hf.parallelize(jetmoe, tp=2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(tp=0), r"tp=0 must be a positive integer"),
        (dict(microbatches=0), r"microbatches=0 must be a positive integer"),
        (dict(schedule="zigzag"), r"schedule='zigzag' is unknown"),
        (dict(pp=6), r"pp=6 is larger than the number of blocks \(5\); use pp <= 5"),
        (dict(pp=2, layers_per_stage=[3, 3]), r"layers_per_stage=\[3, 3\] must give each of the pp=2 stages at least one block and sum to the 5 blocks"),
        (dict(pp=2, layers_per_stage=[5, 0]), r"layers_per_stage=\[5, 0\]"),
    ],
)
def test_bad_arguments(kwargs, message, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(kwargs.get("pp", 1) * kwargs.get("tp", 1)))
    with pytest.raises(ValueError, match=message):
        qn_hf.parallelize(tiny("gpt2"), **kwargs)


def test_rule_matching_nothing_is_an_error():
    policy = resolve_policy(tiny("gpt2"), None)
    broken = dataclasses.replace(policy, tp_plan={**policy.tp_plan, "h.*.attn.q_proj": "colwise"})
    with pytest.raises(ValueError, match=r"rule 'h.\*.attn.q_proj' matches no module"):
        build_tp_plan(tiny("gpt2"), broken, tp=2)


def test_linear_without_rule_inside_a_block_is_an_error():
    policy = resolve_policy(tiny("llama"), None)
    plan = {k: v for k, v in policy.tp_plan.items() if not k.endswith("up_proj")}
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.up_proj \(Linear\) inside a sharded block has no rule"):
        build_tp_plan(tiny("llama"), dataclasses.replace(policy, tp_plan=plan), tp=2)


def test_patched_attribute_must_exist():
    policy = resolve_policy(tiny("gpt2"), None)
    broken = dataclasses.replace(policy, attr_patches={"h.*.attn.num_groups": "local_heads"})
    with pytest.raises(ValueError, match=r"transformer.h.0.attn has no attribute 'num_groups'"):
        build_tp_plan(tiny("gpt2"), broken, tp=2)


def test_unknown_style_is_rejected_when_the_policy_is_written():
    with pytest.raises(ValueError, match=r"unknown style 'diagonal'"):
        ModelPolicy(model_type="x", layers="h", tp_plan={"h.*.fc": "diagonal"})


def test_policy_of_another_architecture_is_rejected():
    with pytest.raises(ValueError, match=r"policy for 'gpt2' given a 'llama' model"):
        build_tp_plan(tiny("llama"), resolve_policy(tiny("gpt2"), None), tp=1)


def test_wrong_kv_width_is_caught():
    config = LlamaConfig(**{**CONFIGS["llama"].to_dict(), "num_key_value_heads": 8})
    policy = resolve_policy(tiny("llama"), None)
    plan = build_tp_plan(LlamaForCausalLM(config), policy, tp=2)
    assert plan.layout.kv_replicas == 1


def test_builtin_policies_cover_task_and_base_models():
    for kind in ("gpt2", "llama", "vit"):
        model = tiny(kind)
        plan = build_tp_plan(model, resolve_policy(model, None), tp=2)
        assert plan.loss in ("causal_lm", "classification")
        base_plan = build_tp_plan(model.base_model, resolve_policy(model.base_model, None), tp=2)
        assert base_plan.loss is None and base_plan.base_prefix == ""


def test_derived_policy_from_transformers_plan():
    policy = derive_policy(tiny("mistral"))
    assert policy.tp_plan["layers.*.self_attn.k_proj"] == "colwise_kv"
    assert policy.tp_plan["layers.*.self_attn.q_proj"] == "colwise"
    assert policy.tp_plan["embed_tokens"] == "vocab_embedding"
    assert policy.head_plan == {}  # the head is found from the model (policies/task.py), never named
    assert policy.attr_patches == {"layers.*.self_attn.num_key_value_groups": "local_kv_groups"}
    plan = build_tp_plan(tiny("mistral"), policy, tp=4)  # 2 KV heads replicated on pairs of ranks
    assert dict(plan.rules)["lm_head"] == "vocab_colwise" and plan.loss == "causal_lm"


def test_derived_pipeline_entry_takes_in_what_extends_the_embedding():
    """Phi-4-multimodal's base forward runs ``embed_tokens_extend`` (image and audio) on the token
    embedding before the blocks, a child transformers' pp plan does not place: it becomes the entry
    (later stages receive its output) and the token embedding a first-stage module (zeros elsewhere)."""
    import torch
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    from qn_hf.check.shrink import shrink_config
    from qn_hf.pipeline.split import build_stage_plan

    def meta(model_type):
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(shrink_config(CONFIG_MAPPING[model_type]()))

    phi4 = derive_policy(meta("phi4_multimodal"))
    assert phi4.pp_entry == "embed_tokens_extend" and dict(phi4.pp_first) == {"embed_tokens": "zeros"}
    assert derive_policy(meta("llama")).pp_entry == "embed_tokens"
    assert build_stage_plan(meta("phi4_multimodal"), phi4, stages=2).entry == "model.embed_tokens_extend"


def test_gpt2_tied_head_is_planned_once_per_module():
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=50257, n_positions=8))
    plan = build_tp_plan(model, resolve_policy(model, None), tp=4)
    styles = dict(plan.rules)
    assert styles["transformer.wte"] == "vocab_embedding" and styles["lm_head"] == "vocab_colwise"


def test_stage_plan_for_each_architecture():
    from qn_hf.pipeline.split import PipelineTie, build_stage_plan

    gpt2 = tiny("gpt2")
    plan = build_stage_plan(gpt2, resolve_policy(gpt2, None), stages=2)
    assert plan.layer_ranges == ((0, 3), (3, 5))  # 5 blocks: the remainder goes to earlier stages
    assert plan.entry == "transformer.wte" and plan.heads == ("lm_head",)
    assert plan.ties == (PipelineTie(owner="transformer.wte.weight", follower="lm_head.weight"),)
    llama = tiny("llama")
    plan = build_stage_plan(llama, resolve_policy(llama, None), stages=4)
    assert plan.layer_ranges == ((0, 1), (1, 2), (2, 3), (3, 4)) and plan.ties == ()
    vit = tiny("vit")
    plan = build_stage_plan(vit, resolve_policy(vit, None), stages=2, layers_per_stage=[1, 3])
    assert plan.layer_ranges == ((0, 1), (1, 4)) and plan.last_only == (("vit.layernorm", "identity"),)


def test_parameter_outside_every_stage_is_an_error():
    from qn_hf.pipeline.split import build_stage_plan

    llama = tiny("llama")
    policy = dataclasses.replace(resolve_policy(llama, None), pp_last={})
    with pytest.raises(ValueError, match=r"parameter model.norm.weight belongs to no pipeline stage"):
        build_stage_plan(llama, policy, stages=2)


def test_loss_kind_is_an_enum_and_policies_keep_accepting_strings():
    """``ModelPolicy(loss="causal_lm")`` stores ``LossKind.CAUSAL_LM`` (a member equals its string); the
    kind knows whether its targets are the labels shifted by one; an unknown kind is refused by name."""
    from qn_hf.config.options import LossKind
    from qn_hf.policies.model_policy import ModelPolicy

    policy = ModelPolicy(model_type="x", layers="layers", tp_plan={}, loss="causal_lm")
    assert policy.loss is LossKind.CAUSAL_LM and policy.loss == "causal_lm" and f"{policy.loss!r}" == "'causal_lm'"
    assert LossKind.values() == ("causal_lm", "tokens", "classification", "spans", "own")
    assert [k.shifted for k in LossKind] == [True, False, False, False, False]
    assert ModelPolicy(model_type="x", layers="layers", tp_plan={}).loss is None
    with pytest.raises(ValueError, match="unknown loss 'mse'"):
        ModelPolicy(model_type="x", layers="layers", tp_plan={}, loss="mse")
