"""Parameter-free modules that stand, on one pipeline stage, for modules that live on another.

The base model's own forward runs on every stage; these keep it running where the real module is
not here: a norm or head becomes a ``PassThrough``, GPT-2's position embedding ``Zeros`` (it is added
once, on the first stage), and the entry (the token or patch embedding) an ``Injector`` that hands
the forward the activation received from the previous stage.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from torch import nn

from ..policies.model_policy import StandIn as StandInKind


class StandIn(nn.Module):
    """A module that lives on another stage, replaced here; holds no parameters."""


class PassThrough(StandIn):
    """Returns its first argument (a norm or dropout that runs on another stage)."""

    def forward(self, x, *args, **kwargs):
        return x


class PassThroughs(PassThrough):
    """A list of modules that runs on another stage (Gemma 3n's ``altup_unembed_projections``, read
    after the blocks): each item, by index or in a loop, is a ``PassThrough``."""

    def __init__(self, length: int) -> None:
        super().__init__()
        self.length = length

    def __getitem__(self, index: int) -> PassThrough:
        return self

    def __len__(self) -> int:
        return self.length

    def __iter__(self):
        return iter([self] * self.length)


class Zeros(StandIn):
    """An embedding that contributes nothing here (GPT-2's ``wpe`` is added once, on stage 0)."""

    def __init__(self, *, dim: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.dim, self.dtype = dim, dtype
        # where the zeros go when the call carries no tensor (the table's device): moves with the module, saved nowhere
        self.register_buffer("anchor", torch.empty(0, device=device), persistent=False)

    def forward(self, ids: torch.Tensor | tuple[int, ...], *args, **kwargs) -> torch.Tensor:
        # a learned position table (BART's, OPT's) is called with more (a cache length, position ids):
        # it reads the first argument's shape, as the zeros do; Blenderbot's takes the shape itself
        if isinstance(ids, torch.Tensor):
            return torch.zeros(*ids.shape, self.dim, dtype=self.dtype, device=ids.device)
        return torch.zeros(*ids, self.dim, dtype=self.dtype, device=self.anchor.device)


class Injector(StandIn):
    """Stands for the entry module on later stages: returns the activation set in ``pending``."""

    def __init__(self) -> None:
        super().__init__()
        self.pending: torch.Tensor | None = None

    def forward(self, *args, **kwargs) -> torch.Tensor:
        if self.pending is None:
            raise RuntimeError("the pipeline entry was called without a received activation (or twice in one forward)")
        out, self.pending = self.pending, None
        return out

    def into_block(self, block: nn.Module, args: tuple, kwargs: dict):
        """Forward pre-hook of a chunk's first block (``receive_at_blocks``): its hidden states, the
        first argument by position or by name, become the received activation. A block called with
        nothing pending (the model's first chunk, on the first stage) runs as it is."""
        if self.pending is None:
            return None
        received, self.pending = self.pending, None
        if args:
            return (received, *args[1:]), kwargs
        name = next(iter(inspect.signature(block.forward).parameters))
        return args, {**kwargs, name: received}


class BodyInjector(Injector):
    """Stands, in a loop body written out over parallel lists (indexed_lists.py), for the module before a chunk's
    first position: returns the received activation as a new tensor, since the body goes on to change what that
    module returned in place (XLM's ``tensor *= mask``), which the received leaf does not allow."""

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return super().forward(*args, **kwargs).clone()


class BlockRotation:
    """A forward hook for a module whose output packs one part per block of the whole model,
    block-major, in its last dimension (``pp_per_block_outputs``: Gemma 4's per-layer embedding and
    projection). A stage's forward loops over its own blocks only and takes part ``i`` for the
    loop's ``i``-th block; rotating the parts left by ``start`` (the running chunk's first block)
    hands block ``start + i`` its own part. A permutation: its backward permutes the gradient back."""

    def __init__(self, *, blocks: int) -> None:
        self.blocks = blocks
        self.start = 0  # set before each chunk's forward (StageModules.forward)

    def hook(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        if self.start == 0:
            return None
        if output.shape[-1] % self.blocks:
            raise ValueError(f"{type(module).__name__}'s output has {output.shape[-1]} features, not one part for each "
                             f"of the {self.blocks} blocks")
        return torch.roll(output, shifts=-self.start * (output.shape[-1] // self.blocks), dims=-1)


def standin_for(kind: StandInKind, module: nn.Module) -> StandIn:
    """The stand-in a policy names for ``module`` (``"zeros"`` for an embedding, else pass-through)."""
    if kind == StandInKind.ZEROS:  # a policy's member, or its string from a saved plan
        if not isinstance(module, nn.Embedding):
            raise ValueError(f"the 'zeros' stand-in replaces an nn.Embedding, not {type(module).__name__}")
        return Zeros(dim=module.embedding_dim, dtype=module.weight.dtype, device=module.weight.device)
    return PassThroughs(len(module)) if isinstance(module, nn.ModuleList) else PassThrough()


def mirror_reads(injector: Injector, entry: nn.Module, reads: Sequence[str]) -> None:
    """Give the injector the attributes the base forward reads from the entry, on empty submodules: a
    parameter (read for its dtype or device) as an empty non-persistent buffer, a buffer as itself (its
    values are read: BigBird slices ``embeddings.token_type_ids``, a row of zeros, on every stage), never
    saved; nothing is trained."""
    for path in reads:
        *mods, attr = path.split(".")
        src, dst = entry, injector
        for m in mods:
            src = getattr(src, m)
            if not hasattr(dst, m):
                dst.add_module(m, nn.Module())
            dst = getattr(dst, m)
        value = getattr(src, attr)
        if isinstance(value, nn.Parameter):
            dst.register_buffer(attr, torch.empty(0, dtype=value.dtype, device=value.device), persistent=False)
        elif isinstance(value, torch.Tensor):
            dst.register_buffer(attr, value, persistent=False)
        else:
            setattr(dst, attr, value)
