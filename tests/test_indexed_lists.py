"""A loop body written out over parallel lists indexed by the loop's position (XLM's and Flaubert's
``attentions[i]``, ``layer_norm1[i]``, ``ffns[i]``, ``layer_norm2[i]``; policies/indexed_lists.py): every stage
keeps the lists whole, its own positions real, and the activation enters as what ``layer_norm2[start - 1]``
returns. Equal to the plain model at 2 and 4 stages, with dp (zb_h1), tp and dp_shard, and through a checkpoint
moved between meshes; a body with no module whose result becomes the carried value (Flaubert's pre-norm) and
interleaved chunks are refused."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import CONFIG_MAPPING

from qn_hf.check.shrink import shrink_config
from qn_hf.pipeline.split import build_stage_plan, chunk_of_module
from qn_hf.pipeline.stage import apply_stage
from qn_hf.pipeline.standins import BodyInjector, PassThrough
from qn_hf.policies import resolve_policy
from tests import any_model_cases

SIBLINGS = ("attentions", "ffns", "layer_norm1")


def _model(model_type: str, cls: str, **overrides) -> torch.nn.Module:
    config = shrink_config(CONFIG_MAPPING[model_type]())
    for key, value in overrides.items():
        setattr(config, key, value)
    return getattr(transformers, cls)(config)


@pytest.mark.parametrize(("model_type", "cls"), [("xlm", "XLMWithLMHeadModel"),
                                                 ("flaubert", "FlaubertWithLMHeadModel")])
def test_the_written_out_body_is_cut_at_the_module_that_replaces_the_carried_value(model_type, cls):
    with torch.device("meta"):
        model = _model(model_type, cls)
    policy = resolve_policy(model, None)
    assert policy.pp_refusal is None and policy.layers == "layer_norm2" and policy.pp_siblings == SIBLINGS
    assert policy.pp_receive_at_blocks
    plan = build_stage_plan(model, policy, stages=2)
    assert plan.siblings == tuple(f"transformer.{n}" for n in SIBLINGS)
    assert chunk_of_module(plan, "transformer.ffns.3") == 1 and chunk_of_module(plan, "transformer.attentions.1") == 0
    with pytest.raises(ValueError, match=r"virtual_stages=2 \(" + model_type + r"\): its forward writes the blocks' body"):
        build_stage_plan(model, policy, stages=2, virtual=2)


def test_a_stage_keeps_the_lists_whole_and_receives_at_the_module_before_its_first_position():
    torch.manual_seed(0)
    model = _model("xlm", "XLMWithLMHeadModel")
    policy = resolve_policy(model, None)
    plan = build_stage_plan(model, policy, stages=2)
    stage = apply_stage(model, plan, stage=1)
    base = model.transformer
    for name in ("layer_norm2", *SIBLINGS):
        kept = getattr(base, name)
        assert len(kept) == 4 and not any(isinstance(kept[i], PassThrough) for i in (2, 3))
    assert all(isinstance(getattr(base, name)[0], PassThrough) for name in SIBLINGS)
    assert isinstance(base.layer_norm2[1], BodyInjector) and stage.injector is base.layer_norm2[1]
    # what the stage runs before its first position never reaches it: the received activation does
    received = torch.randn(2, 6, model.config.emb_dim)
    stage.injector.pending = received
    hidden = {}
    base.layer_norm1[2].register_forward_pre_hook(lambda m, args: hidden.setdefault("in", args[0]))
    model(input_ids=torch.randint(3, 20, (2, 6)))
    attn = base.attentions[2](received, torch.ones(2, 6, dtype=torch.bool))[0]
    assert torch.allclose(hidden["in"], received + attn, atol=1e-6)


def test_a_body_whose_every_module_is_added_is_refused_for_pp_only():
    with torch.device("meta"):
        model = _model("flaubert", "FlaubertWithLMHeadModel", pre_norm=True)
    policy = resolve_policy(model, None)
    assert "does not loop once over ffns" in policy.pp_refusal
    assert build_stage_plan(model, policy, stages=1).stages == 1


def _step(worlds, size: int, **mesh) -> dict:
    return worlds.run(size, any_model_cases.head_step, model_type="xlm", cls="XLMWithLMHeadModel", **mesh)[0]


MESHES = [  # size, mesh
    pytest.param(2, dict(pp=2), marks=pytest.mark.core),
    pytest.param(4, dict(pp=4), marks=pytest.mark.long),  # two pass-through positions before a stage's first
    pytest.param(4, dict(tp=2, pp=2), marks=pytest.mark.long),
    pytest.param(4, dict(dp=2, pp=2, schedule="zb_h1", microbatches=4), marks=pytest.mark.long),
    pytest.param(4, dict(dp=2, dp_shard=2, pp=2), marks=pytest.mark.long),
]


@pytest.mark.parametrize(("size", "mesh"), MESHES)
def test_equal_to_the_plain_model(worlds, size, mesh):
    verdict = _step(worlds, size, **mesh)
    assert verdict["verdict"] == "equal", verdict


@pytest.mark.long
def test_checkpoint_moves_between_meshes(worlds, tmp_path):
    case = dict(model_type="flaubert", cls="FlaubertForSequenceClassification", ckpt=str(tmp_path / "ckpt"))
    straight = worlds.run(2, any_model_cases.resume_step, save=True, dp=1, pp=2, **case)[0]
    for mesh in (dict(dp=2, pp=1), dict(dp=1, pp=2)):
        resumed = worlds.run(2, any_model_cases.resume_step, save=False, **mesh, **case)[0]
        assert abs(straight - resumed) <= 1e-5 * abs(straight), (mesh, straight, resumed)


def test_sequence_parallelism_over_a_written_out_body_is_refused():
    from qn_hf.validation.checks import check_parallel_config

    with torch.device("meta"):
        model = _model("xlm", "XLMWithLMHeadModel")
    with pytest.raises(ValueError, match=r"sequence_parallel=True \(xlm\): its forward writes the blocks' body out"):
        check_parallel_config(model, tp=2, pp=2, sequence_parallel=True, microbatches=2)


def test_the_planner_says_it_cannot_trace_a_forward_that_reads_a_value(tmp_path, capsys):
    """XLM's forward asserts on ``lengths.max().item()``, which the planner's meta tensors cannot answer: a
    refusal naming why, never a traceback."""
    from qn_hf.planner.cli import main

    shrink_config(CONFIG_MAPPING["xlm"]()).save_pretrained(tmp_path)
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--dp", "1", "--tp", "1", "--pp", "1", "--seq-len", "16"])
    assert "the planner cannot trace XLMModel: its forward reads a tensor's value" in capsys.readouterr().err
