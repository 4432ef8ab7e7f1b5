"""A stack whose loop calls one shared module once per layer (ALBERT's layer group, policies/looped.py): a
pipeline cuts the iterations, every stage holds the module, its gradient is summed over the stages, and
each stage's copy of the loop's config counts its own iterations. Equal to the plain model at every
schedule, with dp, dp_shard and tp, interleaved, 4 stages, and checkpoints moved between meshes; a loop
that picks one of several modules by the layer count, and sequence parallelism, are refused."""

from __future__ import annotations

import ast
import textwrap

import pytest
import torch
from transformers import AlbertConfig, AlbertForMaskedLM

from qn_hf.check.shrink import shrink_config
from qn_hf.pipeline.split import build_stage_plan
from qn_hf.pipeline.stage_config import cut_layer_lists
from qn_hf.policies import resolve_policy
from qn_hf.policies.looped import looped_call
from tests import any_model_cases

GROUPS = "encoder.albert_layer_groups"


def _albert(**overrides) -> torch.nn.Module:
    config = shrink_config(AlbertConfig())
    for key, value in overrides.items():
        setattr(config, key, value)
    with torch.device("meta"):
        return AlbertForMaskedLM(config)


def _tree(source: str) -> ast.FunctionDef:
    return ast.parse(textwrap.dedent(source)).body[0]


def test_the_loop_over_a_config_count_is_found():
    found = looped_call(_tree("""
        def forward(self, h):
            for i in range(self.config.num_hidden_layers):
                h = self.groups[int(i / 2)](h)
            return h"""), "groups")
    assert found is not None and found.count == "num_hidden_layers"
    # a second mention of the list, a count that is not the config's, or two calls: not this shape
    for source in ("""
        def forward(self, h):
            for i in range(self.config.n):
                h = self.groups[0](h)
            return self.groups[0](h)""", """
        def forward(self, h, n):
            for i in range(n):
                h = self.groups[0](h)
            return h""", """
        def forward(self, h):
            for i in range(self.config.n):
                h = self.groups[0](self.groups[0](h))
            return h"""):
        assert looped_call(_tree(source), "groups") is None


def test_albert_is_cut_by_its_iterations():
    model = _albert(num_hidden_layers=5)
    policy = resolve_policy(model, None)
    assert policy.pp_refusal is None and policy.pp_loop_count == "num_hidden_layers"
    assert policy.layers == GROUPS and GROUPS in policy.pp_every_stage and policy.pp_receive_at_blocks
    plan = build_stage_plan(model, policy, stages=2)
    assert plan.layer_ranges == ((0, 3), (3, 5))  # five iterations of the one group
    assert plan.block(model, 4) is model.albert.encoder.albert_layer_groups[0]
    config = model.albert.encoder.config
    own = cut_layer_lists(config, start=3, stop=5, total=5, count=plan.loop_count)
    assert own.num_hidden_layers == 2 and config.num_hidden_layers == 5  # the shared config is untouched
    with pytest.raises(ValueError, match=r"pp=6 is larger than the number of blocks \(5\)"):
        build_stage_plan(model, policy, stages=6)


def test_a_loop_picking_one_of_several_modules_by_the_count_is_refused_for_pp_only():
    model = _albert(num_hidden_layers=4, num_hidden_groups=2)
    policy = resolve_policy(model, None)
    assert "calls one of the 2 modules of albert_layer_groups in each of config.num_hidden_layers iterations" in (
        policy.pp_refusal)
    with pytest.raises(ValueError, match=r"pp=2 \(albert\): .*which a stage's cut changes; use pp=1"):
        build_stage_plan(model, policy, stages=2)
    assert build_stage_plan(model, policy, stages=1).stages == 1


def _step(worlds, size: int, **mesh) -> dict:
    return worlds.run(size, any_model_cases.head_step, model_type="albert", cls="AlbertForSequenceClassification",
                      **mesh)[0]


MESHES = [  # size, mesh
    # two chunks a rank: each view's count (make test's one)
    pytest.param(2, dict(pp=2, virtual_stages=2, overrides={"num_hidden_layers": 4}), marks=pytest.mark.core),
    pytest.param(4, dict(tp=2, pp=2), marks=pytest.mark.long),
    pytest.param(4, dict(dp=2, dp_shard=2, pp=2), marks=pytest.mark.long),  # the group in FSDP's root
    pytest.param(2, dict(pp=2, schedule="zb_h1", microbatches=4), marks=pytest.mark.long),  # W passes
    pytest.param(4, dict(pp=4, overrides={"num_hidden_layers": 4}), marks=pytest.mark.long),
]


@pytest.mark.parametrize(("size", "mesh"), MESHES)
def test_equal_to_the_plain_model(worlds, size, mesh):
    verdict = _step(worlds, size, **mesh)
    assert verdict["verdict"] == "equal", verdict


@pytest.mark.long
def test_sequence_parallelism_is_refused(worlds):
    verdict = _step(worlds, 4, tp=2, pp=2, sequence_parallel=True)
    assert verdict["verdict"] == "refused" and "where a split sequence cannot begin and end" in verdict["reason"]


@pytest.mark.long
def test_checkpoint_moves_between_meshes(worlds, tmp_path):
    case = dict(model_type="albert", cls="AlbertForSequenceClassification", ckpt=str(tmp_path / "ckpt"))
    straight = worlds.run(2, any_model_cases.resume_step, save=True, dp=1, pp=2, **case)[0]
    for mesh in (dict(dp=2, pp=1), dict(dp=1, pp=2)):
        resumed = worlds.run(2, any_model_cases.resume_step, save=False, **mesh, **case)[0]
        assert abs(straight - resumed) <= 1e-5 * abs(straight), (mesh, straight, resumed)


def test_the_planner_refuses_to_price_its_stages(tmp_path, capsys):
    from qn_hf.planner.cli import main

    config = shrink_config(AlbertConfig())
    config.save_pretrained(tmp_path)
    main([str(tmp_path), "--dp", "1", "--tp", "1", "--pp", "1", "--seq-len", "16"])  # one stage: priced
    assert "estimated step" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--dp", "1", "--tp", "1", "--pp", "2", "--seq-len", "16", "--microbatches", "2"])
    assert "whose calls the planner does not share out between the stages; plan at pp=1" in capsys.readouterr().err
