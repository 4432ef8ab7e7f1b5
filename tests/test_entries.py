"""Finding tp entries from a forward's source (qn_hf/policies/entries.py): a module is an entry when
its first argument feeds only its column layers; a top-level reassignment ends the argument's life."""

from __future__ import annotations

import torch
from torch import nn

from qn_hf.policies.entries import feeds_only

COLUMNS = {"fc1", "up"}


class _Layers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.up, self.fc2, self.gate = (nn.Linear(4, 4) for _ in range(4))


class Mlp(_Layers):  # GPT-NeoX / Phi / StarCoder2: the name holds the projection from then on
    def forward(self, hidden_states):
        hidden_states = self.fc1(hidden_states)
        hidden_states = torch.relu(hidden_states)
        return self.fc2(hidden_states)


class TwoColumns(_Layers):
    def forward(self, x):
        batch = x.shape[0]
        h = self.fc1(x) * self.up(x)
        x = self.fc2(h)
        return x.reshape(batch, -1)


class Router(_Layers):  # a replicated gate reads the argument too: its gradient would be summed twice
    def forward(self, x):
        weights = self.gate(x)
        return self.fc1(x) * weights


class Branch(_Layers):  # which value a use reads depends on the path
    def forward(self, x, flag: bool = True):
        if flag:
            x = self.fc1(x)
        return self.fc2(x)


class Residual(_Layers):  # the argument added after the column layer: another consumer
    def forward(self, x):
        y = self.fc1(x)
        return self.fc2(y) + x


class Unpacked(_Layers):
    def forward(self, x):
        x, y = self.fc1(x), self.up(x)
        return self.fc2(x + y)


def test_reassignment_at_the_top_level_ends_the_argument():
    assert feeds_only(Mlp(), COLUMNS)
    assert feeds_only(TwoColumns(), COLUMNS)


def test_other_consumers_or_path_dependent_uses_are_no_entry():
    for module in (Router(), Branch(), Residual(), Unpacked()):
        assert not feeds_only(module, COLUMNS), type(module).__name__
