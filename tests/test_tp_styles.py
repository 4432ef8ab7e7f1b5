"""Pieces of the tp styles that the model zoo exercises only as a whole: which embedding subclasses
are reproduced, a user's policy patching a value inside the shared config, and the first step's
refusal of a replicated parameter whose gradient is partial."""

from __future__ import annotations

import pytest
from torch import nn
from transformers import CONFIG_MAPPING

from qn_hf.check.shrink import shrink_config
from qn_hf.policies.embedding_types import adapter_for
from qn_hf.policies.model_policy import ModelPolicy
from tests import zoo_cases


class _Doubled(nn.Embedding):
    def forward(self, input_ids):
        return super().forward(input_ids) * 2  # not a behaviour qn_hf knows: must be refused


class _Renamed(nn.Embedding):
    """A subclass that changes nothing the lookup does."""

    def extra_repr(self) -> str:
        return "renamed"


def _embedding_of(model_type: str) -> nn.Module:
    from qn_hf.check.run import build

    return build(shrink_config(CONFIG_MAPPING[model_type]()), seed=0).get_input_embeddings()


def test_embedding_adapters():
    assert adapter_for(nn.Embedding(5, 3)).behaviour == "plain"
    assert adapter_for(_Renamed(5, 3)).behaviour == "plain"
    assert adapter_for(_Doubled(5, 3)) is None
    assert adapter_for(nn.Linear(3, 5)) is None
    for model_type in ("gemma", "gemma2", "gemma3_text", "vaultgemma"):
        assert adapter_for(_embedding_of(model_type)).behaviour == "scaled", model_type
    # Inkling's embedding normalizes its rows itself from transformers 5.18 on (InklingNormedEmbedding);
    # 5.17 looks the rows up in a plain embedding and normalizes them in the model's forward
    import transformers.models.inkling.modeling_inkling as inkling

    normed = hasattr(inkling, "InklingNormedEmbedding")
    assert adapter_for(_embedding_of("inkling_text")).behaviour == ("normed" if normed else "plain")


def _phi3_policy(**overrides) -> ModelPolicy:
    """Phi-3 written by hand: fused q|k|v split per part, and the attention's own copy of the config
    told its local head count (its forward reads ``self.config.num_attention_heads``)."""
    fields = dict(
        model_type="phi3", layers="layers",
        tp_plan={"embed_tokens": "vocab_embedding", "layers.*.self_attn.qkv_proj": "colwise_packed3",
                 "layers.*.self_attn.o_proj": "rowwise", "layers.*.mlp.gate_up_proj": "colwise_packed2",
                 "layers.*.mlp.down_proj": "rowwise"},
        head_plan={"lm_head": "vocab_colwise"},
        attr_patches={"layers.*.self_attn.config.num_attention_heads": "local_heads",
                      "layers.*.self_attn.num_key_value_heads": "local_kv_heads"},
        tp_entries=("layers.*.self_attn", "layers.*.mlp"),
        loss="causal_lm", forward_kwargs={"use_cache": False}, num_kv_heads_key="num_key_value_heads",
        pp_entry="embed_tokens", pp_last={"norm": "identity"},
    )
    return ModelPolicy(**{**fields, **overrides})


def _phi3_config() -> dict:
    config = shrink_config(CONFIG_MAPPING["phi3"]())
    config.num_key_value_heads = config.num_attention_heads  # equal q/k/v parts for colwise_packed3
    return config.to_dict()


def test_policy_patches_the_shared_config_per_module(worlds, tmp_path):
    verdict = worlds.run(2, zoo_cases.custom_policy_step, config=_phi3_config(), policy=_phi3_policy(), tp=2,
                         out_dir=str(tmp_path))[0]
    assert verdict["verdict"] == "equal", verdict["reason"]
    assert verdict["exported_config"]["num_attention_heads"] == 4  # the saved config keeps the full count


def test_without_the_config_patch_the_forward_fails_clearly(worlds, tmp_path):
    policy = _phi3_policy(attr_patches={"layers.*.self_attn.num_key_value_heads": "local_kv_heads"})
    with pytest.raises(AssertionError, match="size|shape"):
        worlds.run(2, zoo_cases.custom_policy_step, config=_phi3_config(), policy=policy, tp=2,
                   out_dir=str(tmp_path))


def test_partial_gradient_of_a_replicated_parameter_is_refused(worlds, tmp_path):
    """Qwen3's plan without its replicated_with_grad_allreduce rules: the per-head norms see only
    this rank's heads. The first step refuses, on every rank, naming them."""
    from qn_hf.check.run import build
    from qn_hf.policies import derive_policy

    config = shrink_config(CONFIG_MAPPING["qwen3"]())
    derived = derive_policy(build(config, seed=0))
    plan = {k: v for k, v in derived.tp_plan.items() if v != "replicate_grad_sum"}
    assert len(plan) < len(derived.tp_plan)
    policy = ModelPolicy(**{**derived.__dict__, "tp_plan": plan})
    verdicts = worlds.run(2, zoo_cases.custom_policy_step, config=config.to_dict(), policy=policy, tp=2,
                          out_dir=str(tmp_path))
    for verdict in verdicts:
        assert verdict["verdict"] == "refused", verdict
        assert "get a different gradient on each tp rank" in verdict["reason"] and "q_norm" in verdict["reason"]


def test_router_aux_loss_is_refused_with_microbatches(worlds):
    config = shrink_config(CONFIG_MAPPING["mixtral"]()).to_dict()
    for message in worlds.run(2, zoo_cases.router_logits_refusal, config=config):
        assert message.startswith("config.output_router_logits=True with microbatches=2"), message


def test_the_parity_check_catches_a_wrong_split(worlds, tmp_path):
    """The zoo's verdicts mean something: a fused gate|up split as one block (rank 0 would hold both
    halves of the gate) trains differently, and one_step_parity says so."""
    plan = {**_phi3_policy().tp_plan, "layers.*.mlp.gate_up_proj": "colwise"}
    verdict = worlds.run(2, zoo_cases.custom_policy_step, config=_phi3_config(), policy=_phi3_policy(tp_plan=plan),
                         tp=2, out_dir=str(tmp_path))[0]
    assert verdict["verdict"] == "different", verdict


def test_partial_gradient_on_one_stage_is_refused_on_every_rank(worlds):
    """Only the second pipeline stage holds the un-summed per-head norms: the ranks of the first
    stage must refuse with it, not wait for it until a timeout."""
    from qn_hf.check.run import build
    from qn_hf.policies import derive_policy

    config = shrink_config(CONFIG_MAPPING["qwen3"]())
    derived = derive_policy(build(config, seed=0))
    plan = {k: v for k, v in derived.tp_plan.items() if v != "replicate_grad_sum"}
    plan.update({f"layers.{i}.self_attn.{norm}": "replicate_grad_sum" for i in (0, 1) for norm in ("q_norm", "k_norm")})
    policy = ModelPolicy(**{**derived.__dict__, "tp_plan": plan})
    verdicts = worlds.run(4, zoo_cases.custom_policy_mesh_step, config=config.to_dict(), policy=policy, tp=2, pp=2)
    for verdict in verdicts:
        assert verdict["verdict"] == "refused" and "layers.2.self_attn.q_norm" in verdict["reason"], verdict


def test_tied_weights_split_differently_are_refused():
    from qn_hf.check.run import build
    from qn_hf.policies import derive_policy
    from qn_hf.tensor_parallel.plan import build_tp_plan

    model = build(shrink_config(CONFIG_MAPPING["gemma"]()), seed=0)  # lm_head is tied to embed_tokens
    assert model.lm_head.weight is model.model.embed_tokens.weight
    derived = derive_policy(model)
    policy = ModelPolicy(**{**derived.__dict__, "head_plan": {"lm_head": "replicate"}})
    with pytest.raises(ValueError, match=r"tied parameters .*lm_head.weight.* would be split differently"):
        build_tp_plan(model, policy, tp=2)
    build_tp_plan(model, derived, tp=2)  # the derived policy splits both over the vocabulary
