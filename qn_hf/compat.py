"""The torch and transformers APIs qn_hf calls that are newer than the oldest releases it supports
(torch 2.11, transformers 5.17), each with a fallback that computes the same on an older release.
The one place that knows which release has what (but for FSDP2's private state, below): every other
module calls these functions.

Each function asks the installed release at call time (an attribute present or absent), not its
version number, so a test can remove the newer name and run the fallback on a current release.

Each API, the release that added it, and the fallback:

- ``torch.distributed.all_gather_single``, torch 2.13 (a rename): ``all_gather_into_tensor``, the same
  collective under its old name. 2.13 deprecates the old name with a FutureWarning, so the new name is
  called wherever it exists.
- ``torch.distributed.reduce_scatter_single``, torch 2.13 (a rename): ``reduce_scatter_tensor``, likewise.
- FSDP2's list of parameter groups per state, ``FSDPState._fsdp_param_groups`` (private: what torch's own
  pipelining runs each group's post-backward over), torch 2.12 (per-parameter meshes): torch 2.11's one
  optional group, ``FSDPState._fsdp_param_group``. Read in data_parallel/fsdp_internals.py
  (``fsdp_param_groups``), with FSDP's other private state, so that every private name of FSDP has one home.
- The instance marker ``_is_expert_parallel`` that transformers' ``@use_experts_implementation`` sets on
  fused experts modules, transformers 5.18: on 5.17 the decorator marks its instances with the layout
  flags it sets (``has_gate``, ``is_concatenated``, ``is_transposed``) and wraps ``forward``; its
  ``grouped_mm`` and ``batched_mm`` leave expert-parallel sentinels out whatever the marker says
  (``skip_expert_sentinels``), where 5.18 and later do so only for a marked instance.
- ``config.kv_sharing_modes`` (Gemma 3n and 4: which block stores the keys and values a later block
  reuses), transformers 5.23: computed from ``num_kv_shared_layers`` and ``layer_types`` as the attention
  of 5.17 to 5.22 computes it (the last ``num_kv_shared_layers`` blocks reuse, each from the last earlier
  block of its kind, which stores).

A name that moved, both spellings read wherever qn_hf reads it:

- The cache a model's and a block's forward take, ``cache`` from transformers 5.24 (``past_key_values``
  before, still accepted by the model's forward until 5.40): ``CACHE_KWARGS``.

One behaviour of an older release, evened out:

- transformers 5.17's generation loop, with ``synced_gpus`` and no cache, builds an attention mask for a
  prompt given without one and extends it by a column per step also on a peer that has finished, whose
  ``input_ids`` stop growing; that peer's forward (its output discarded) then fails on the longer mask.
  5.18 on keep the two the same length. ``trim_attention_mask`` cuts the mask to the ids' length, the
  mask those ids had.

Written with what every supported release has instead, so needing nothing here: the checkpoint reader's
key renaming (checkpoint/hf.py calls each transform's ``rename_source_key``, not transformers 5.21's
``apply_renamings``/``apply_converters``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

# the flags transformers 5.17's ``use_experts_implementation`` sets on every instance it decorates
_EXPERTS_FLAGS_5_17 = ("has_gate", "is_concatenated", "is_transposed")
# the names of the cache argument a forward takes: transformers 5.24's, then 5.17-5.23's
CACHE_KWARGS = ("cache", "past_key_values")
# transformers 5.23's name of the per-block list, and the modes in it
KV_SHARING_MODES = "kv_sharing_modes"
KV_STORE, KV_REUSE = "store", "reuse"


def all_gather_single(output: torch.Tensor, input: torch.Tensor, *, group: ProcessGroup,
                      async_op: bool = False) -> dist.Work | None:
    """Every member's ``input`` concatenated along dim 0 into ``output`` (``dist.all_gather_single``)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, *, group: ProcessGroup,
                          async_op: bool = False) -> dist.Work | None:
    """This member's block of dim 0 of the sum of every member's ``input``, into ``output``
    (``dist.reduce_scatter_single``)."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input, group=group, async_op=async_op)


def trim_attention_mask(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """A forward pre-hook (``with_kwargs=True``) on a model that generates with ``synced_gpus`` and no
    cache: a 2-D ``attention_mask`` longer than ``input_ids`` cut to their length (module docstring)."""
    ids, mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
    if not isinstance(ids, torch.Tensor) or not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return None
    if mask.shape[1] <= ids.shape[1]:
        return None
    return args, {**kwargs, "attention_mask": mask[:, : ids.shape[1]]}


def decorated_experts(module: nn.Module) -> bool:
    """Whether ``module``'s class is decorated by transformers' ``use_experts_implementation`` (its
    forward dispatches through the experts registry)."""
    if hasattr(module, "_is_expert_parallel"):
        return True
    return (all(hasattr(module, flag) for flag in _EXPERTS_FLAGS_5_17)
            and hasattr(type(module).forward, "__wrapped__") and hasattr(getattr(module, "config", None),
                                                                        "_experts_implementation"))


def skip_expert_sentinels(module: nn.Module) -> None:
    """Make a fused experts module's ``grouped_mm`` and ``batched_mm`` leave expert-parallel sentinels (ids
    past its experts) out of the output: transformers' marker from 5.18; 5.17 leaves them out always."""
    if hasattr(module, "_is_expert_parallel"):
        module._is_expert_parallel = True


def per_layer(config, key: str) -> list | None:
    """The per-block list ``config`` declares under ``key`` (e.g. ``kv_sharing_modes``), or where the
    installed transformers predates that name, the list its modeling code computes; None if neither."""
    found = getattr(config, key, None)
    if isinstance(found, list) or key != KV_SHARING_MODES:
        return found if isinstance(found, list) else None
    shared, kinds = getattr(config, "num_kv_shared_layers", None), getattr(config, "layer_types", None)
    if not isinstance(shared, int) or not isinstance(kinds, list):
        return None
    first = len(kinds) - max(shared, 0)  # the blocks from here on reuse
    modes: list[str | None] = [None] * first + [KV_REUSE] * (len(kinds) - first)
    if first < len(kinds):
        for kind in set(kinds[:first]):  # the last block of each kind before them stores
            modes[first - 1 - kinds[:first][::-1].index(kind)] = KV_STORE
    return modes
