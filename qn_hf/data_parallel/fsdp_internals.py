"""FSDP2's private state, in one module: what qn_hf needs of ``fully_shard`` that no public call gives,
behind one function (``fsdp_root``). Every name read here is private to torch and may move in any
release; each is read through ``_private``, which names the attribute and the installed torch when it
is gone, and tests/test_fsdp_internals.py reads them all on the installed torch.

What qn_hf reads, and why (data_parallel/sharded.py says when):

- ``fully_shard.state(module)``: the ``FSDPState`` of a module ``fully_shard`` was applied to (the
  ``contract`` decorator's registry).
- ``FSDPState._lazy_init()``: find every group under a root now. FSDP does it at the root's first
  forward; a pipeline stage with several chunks runs that forward in one chunk's view, which hides
  the other chunks' blocks.
- ``FSDPState._state_ctx.all_states``: every state under the root (filled by ``_lazy_init``).
- ``FSDPState._fsdp_param_groups`` (torch 2.12 on: a list, per-parameter meshes) or torch 2.11's one
  optional ``FSDPState._fsdp_param_group``: a state's parameter groups (``fsdp_param_groups``).
- ``FSDPParamGroup.post_backward()`` and ``FSDPState._root_post_backward_final_callback()``: reduce
  the gradients a pipeline step accumulated, once, and free the gathered weights, as torch's own
  pipelining does (``PipelineStage.perform_reduce_grad``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard


class FsdpInternalsMoved(RuntimeError):
    """A private name of FSDP2 that qn_hf reads is not where this module expects it on the installed
    torch: this module has to follow torch's change."""


def _private(owner: object, name: str, *, of: str):
    """``owner.name``, or ``FsdpInternalsMoved`` naming ``of.name`` and the installed torch."""
    try:
        return getattr(owner, name)
    except AttributeError:
        raise FsdpInternalsMoved(
            f"torch {torch.__version__} has no {of}.{name}: qn_hf reads this private attribute of FSDP2 "
            f"(qn_hf/data_parallel/fsdp_internals.py), which this torch release has moved or removed") from None


def fsdp_param_groups(state: object) -> list:
    """The parameter groups of one FSDP2 state: torch 2.12's list, or torch 2.11's one optional group.
    Asks the state at call time (not the version number), so a test can read a current state as 2.11
    holds it."""
    groups = getattr(state, "_fsdp_param_groups", None)  # absent: torch 2.11, read below
    if groups is not None:
        return list(groups)
    group = _private(state, "_fsdp_param_group", of="FSDPState")  # torch 2.11: at most one group per state
    return [group] if group is not None else []


@dataclass(frozen=True)
class FsdpRoot:
    """The private state of the root of a model ``fully_shard`` was applied to, block by block and
    then to the model itself."""

    state: object  # torch's FSDPState of the root

    def find_groups(self) -> None:
        """Make this the root of every group under it now, rather than at its first forward."""
        _private(self.state, "_lazy_init", of="FSDPState")()

    def states(self) -> list:
        """Every FSDP state under the root, the root's own included (after ``find_groups`` or a forward)."""
        return list(_private(_private(self.state, "_state_ctx", of="FSDPState"), "all_states", of="FSDPStateContext"))

    def post_backward(self) -> None:
        """Every group's post-backward (reduce its accumulated gradients, or keep them whole where gradient
        sync is off; free its gathered weights), then the root's end-of-backward callback."""
        for state in self.states():
            for group in fsdp_param_groups(state):
                _private(group, "post_backward", of="FSDPParamGroup")()
        _private(self.state, "_root_post_backward_final_callback", of="FSDPState")()


def fsdp_root(model: nn.Module) -> FsdpRoot:
    """The private FSDP2 state of ``model``, which ``fully_shard`` was applied to last (the root)."""
    state = _private(fully_shard, "state", of="fully_shard")(model)
    if state is None:
        raise ValueError(f"{type(model).__name__} is not a module fully_shard was applied to")
    return FsdpRoot(state)
