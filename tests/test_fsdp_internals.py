"""FSDP2's private state as qn_hf reads it (qn_hf/data_parallel/fsdp_internals.py), on the installed
torch, in this process: a one-rank gloo world and a two-block model sharded the way data_parallel/sharded.py
shards a pipeline stage. If a torch release moves one of the private names, these tests fail naming it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from qn_hf.data_parallel.fsdp_internals import FsdpInternalsMoved, fsdp_param_groups, fsdp_root
from qn_hf.data_parallel.sharded import ShardedParameters


@pytest.fixture(scope="module")
def mesh():
    """A one-rank gloo world and its 1-D mesh (FSDP's collectives are identities over one rank)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _inputs() -> list[torch.Tensor]:
    torch.manual_seed(1)
    return [torch.randn(5, 4) for _ in range(2)]


def test_a_pipelined_step_reduces_once_through_fsdps_private_state(mesh):
    """What ShardedParameters does under a pipeline: the groups found before any forward, two
    microbatches' gradients accumulated whole, one post-backward at the end of the step: the same
    gradients as plain autograd over both microbatches."""
    plain = _model()
    for x in _inputs():
        plain(x).square().sum().backward()

    model = _model()
    sharded = ShardedParameters(model, mesh=mesh, blocks=[model[0], model[2]], compute_dtype=None, pipelined=True)
    states = sharded.root.states()
    assert len(states) == 3, states  # two blocks and the root: found before the first forward
    assert all(fsdp_param_groups(state) for state in states[1:]), states  # each block has its group
    sharded.start_backward(sync=True)
    for x in _inputs():
        model(x).square().sum().backward()
    sharded.finish_backward(sync=True)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-6, atol=1e-6, msg=name)


def test_a_module_fully_shard_was_not_applied_to_is_refused(mesh):
    with pytest.raises(ValueError, match="Sequential is not a module fully_shard was applied to"):
        fsdp_root(_model())


def _root(mesh):
    model = _model()
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, fsdp_root(model)


@pytest.mark.parametrize(("owner", "name", "call"), [
    ("FSDPState", "_lazy_init", "find_groups"),
    ("FSDPState", "_root_post_backward_final_callback", "post_backward"),
    ("FSDPParamGroup", "post_backward", "post_backward"),
])
def test_a_moved_private_method_is_named(mesh, monkeypatch, owner, name, call):
    """As a torch release that renamed it would leave it: gone from its class."""
    _, root = _root(mesh)
    root.find_groups()
    classes = {"FSDPState": type(root.state), "FSDPParamGroup": type(fsdp_param_groups(root.state)[0])}
    monkeypatch.delattr(classes[owner], name)
    with pytest.raises(FsdpInternalsMoved, match=rf"torch .* has no {owner}\.{name}: qn_hf reads"):
        getattr(root, call)()


def test_moved_private_state_is_named(mesh, monkeypatch):
    """The registry of states, the states' shared context and torch 2.11's one group, each gone."""
    model, root = _root(mesh)
    root.find_groups()
    monkeypatch.delattr(root.state, "_state_ctx")
    with pytest.raises(FsdpInternalsMoved, match=r"has no FSDPState\._state_ctx"):
        root.states()
    monkeypatch.undo()

    class Neither:  # neither torch 2.12's list of groups nor torch 2.11's one group
        pass

    with pytest.raises(FsdpInternalsMoved, match=r"has no FSDPState\._fsdp_param_group\b"):
        fsdp_param_groups(Neither())
    monkeypatch.delattr(fully_shard, "state")
    with pytest.raises(FsdpInternalsMoved, match=r"has no fully_shard\.state"):
        fsdp_root(model)
