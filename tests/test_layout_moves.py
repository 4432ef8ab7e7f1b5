"""A stack whose forward moves its input to another layout around the loop over its blocks (SqueezeBERT's
channels-first encoder) is cut for a pipeline only where the moves after the loop undo those before it
(policies/layout_moves.py), and a stack that runs its blocks by ``forward`` never receives at them."""

from __future__ import annotations

import ast

import pytest
from torch import nn

from qn_hf.policies.cuts import StackCut
from qn_hf.policies.layout_moves import undone_around
from qn_hf.policies.stack_cut import stack_cut
from tests.test_derivation import _policy


def _undone(before: str, after: str) -> bool:
    lines = ["def forward(self, x):", *("    " + line for line in before.split("\n")),
             "    for layer in self.layers:", "        x = layer(x)", *("    " + line for line in after.split("\n")),
             "    return x"]
    tree = ast.parse("\n".join(lines)).body[0]
    loop = next(n for n in ast.walk(tree) if isinstance(n, ast.For))
    return undone_around(tree, loop, "x")


@pytest.mark.parametrize(("before", "after", "undone"), [
    ("x = x.permute(0, 2, 1)", "x = x.permute(0, 2, 1)", True),
    ("x = x.permute(1, 2, 0)", "x = x.permute(2, 0, 1)", True),
    ("x = x.permute(1, 2, 0)", "x = x.permute(1, 2, 0)", False),  # a rotation twice is not the identity
    ("x = x.transpose(1, 2)", "x = x.permute(0, 2, 1)", True),
    ("x = x.transpose(0, 1)\nx = x.transpose(1, 2)", "x = x.transpose(1, 2)\nx = x.transpose(0, 1)", True),
    ("x = x.transpose(0, 1)\nx = x.transpose(1, 2)", "x = x.transpose(0, 1)\nx = x.transpose(1, 2)", False),
    ("x = x.permute(0, 2, 1)", "y = x.permute(0, 2, 1)", False),  # what the forward returns is another name
    ("x = x.transpose(-1, -2)", "x = x.transpose(-1, -2)", False),  # the rank the negative dims count from is unsaid
    ("x = x.permute(0, 2, 1)", "x = x.permute(0, 2, 1, 3)", False),
    ("if flag:\n    x = x.permute(0, 2, 1)", "x = x.permute(0, 2, 1)", False),  # moved only sometimes
    ("pass", "x = x.permute(0, 2, 1)", False),
])
def test_moves_after_the_loop_undo_those_before_it(before, after, undone):
    assert _undone(before, after) is undone


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(4, 4, 1)

    def forward(self, x):
        return {"feature_map": self.conv(x)}


class _ChannelsFirst(nn.Module):
    def __init__(self, *, undo: bool):
        super().__init__()
        self.layers = nn.ModuleList(_Block() for _ in range(4))
        self.undo = undo

    def forward(self, hidden_states):
        hidden_states = hidden_states.permute(0, 2, 1)
        for layer in self.layers:
            hidden_states = layer.forward(hidden_states)["feature_map"]
        if self.undo:
            return hidden_states.permute(0, 2, 1)
        return hidden_states


class _Undone(_ChannelsFirst):
    def forward(self, hidden_states):
        hidden_states = hidden_states.permute(0, 2, 1)
        for layer in self.layers:
            hidden_states = layer.forward(hidden_states)["feature_map"]
        hidden_states = hidden_states.permute(0, 2, 1)
        return hidden_states


class _Body(nn.Module):
    def __init__(self, encoder: nn.Module):
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.encoder = encoder

    def forward(self, ids):
        x = self.embed(ids)
        return self.encoder(x)


def test_a_stack_moved_channels_first_and_back_is_cut_in_the_entrys_place():
    cut = stack_cut(_Body(_Undone(undo=True)), layers="encoder.layers", embeddings="embed")
    assert isinstance(cut, StackCut) and cut.entry == "embed" and not cut.receive_at_blocks, cut


def test_a_stack_left_channels_first_and_run_by_forward_refuses_pp():
    # not undone, a later stage would have to receive at its first block, whose hooks layer.forward(...) skips
    refusal = stack_cut(_Body(_ChannelsFirst(undo=False)), layers="encoder.layers", embeddings="embed")
    assert isinstance(refusal, str) and "runs each block by its forward method, past the hooks" in refusal, refusal


def test_squeezebert_is_cut_for_a_pipeline():
    policy = _policy("squeezebert", "SqueezeBertForMaskedLM")
    assert policy.pp_refusal is None and policy.pp_entry == "embeddings" and not policy.pp_receive_at_blocks
