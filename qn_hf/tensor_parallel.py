"""Applying a resolved ``TpPlan``: swap leaf modules for parallel ones and patch what forwards read.

Nothing here replaces a Hugging Face ``forward``: only leaves (Linear, Conv1D, Embedding) are
swapped, and the few integer attributes a forward reads to reshape (GPT-2's ``split_size``,
Llama's ``num_key_value_groups``) are set to their per-rank values.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from torch import nn
from torch.distributed import ProcessGroup

from .comm import copy_to_group
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, _dims
from .plan import TpPlan, packed_parts
from .shard import ShardSpec, padded


@dataclass(frozen=True)
class VocabShard:
    """Where this rank's logits columns sit in the vocabulary (for the vocab-parallel loss)."""

    start: int
    size: int


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def _enter_region_hook(group: ProcessGroup):
    """Forward pre-hook: the module's first argument enters the tp region (all-reduce backward)."""

    def hook(module: nn.Module, args: tuple, kwargs: dict):
        if args:
            return (copy_to_group(args[0], group=group), *args[1:]), kwargs
        name = next(iter(inspect.signature(module.forward).parameters))
        return args, {**kwargs, name: copy_to_group(kwargs[name], group=group)}

    return hook


def _parallel_module(
    module: nn.Module, style: str, plan: TpPlan, tp_rank: int, group: ProcessGroup, copy_input: bool
) -> nn.Module:
    tp = plan.tp
    if style == "vocab_embedding":
        spec = ShardSpec(dim=0, tp=tp, size=module.num_embeddings, padded_size=padded(module.num_embeddings, tp))
        return VocabParallelEmbedding.from_module(module, spec=spec, tp_rank=tp_rank, group=group)
    in_f, out_f, _, _ = _dims(module)
    if style == "rowwise":
        return RowParallelLinear.from_module(module, spec=ShardSpec(dim=0, tp=tp, size=in_f), tp_rank=tp_rank, group=group)
    if style == "vocab_colwise":
        spec = ShardSpec(dim=0, tp=tp, size=out_f, padded_size=padded(out_f, tp))
    elif style == "colwise_kv":
        spec = ShardSpec(dim=0, tp=tp, size=out_f, replicas=plan.layout.kv_replicas)
    else:
        spec = ShardSpec(dim=0, tp=tp, size=out_f, parts=packed_parts(style))
    return ColumnParallelLinear.from_module(module, spec=spec, tp_rank=tp_rank, group=group, copy_input=copy_input)


def apply_tp_plan(
    model: nn.Module, plan: TpPlan, *, tp_rank: int, group: ProcessGroup
) -> tuple[dict[str, ShardSpec | None], VocabShard | None]:
    """Shard ``model`` in place; return every parameter's ``ShardSpec`` (None: replicated across tp)
    by its Hugging Face name, and the vocabulary shard of the output head if it has one."""
    # Ties (GPT-2's lm_head.weight is wte.weight) are found by identity before anything is swapped
    # and restored on the new shards afterwards.
    owner_of: dict[int, str] = {}
    ties: list[tuple[str, str]] = []
    for name, style in plan.rules:
        if style == "replicate":
            continue
        weight = model.get_submodule(name).weight
        if id(weight) in owner_of:
            ties.append((owner_of[id(weight)], name))
        owner_of.setdefault(id(weight), name)

    vocab: VocabShard | None = None
    for name, style in plan.rules:
        if style == "replicate":
            continue
        entered = any(name.startswith(entry + ".") for entry in plan.tp_entries)
        new = _parallel_module(model.get_submodule(name), style, plan, tp_rank, group, copy_input=not entered)
        _replace(model, name, new)
        if style == "vocab_colwise":
            vocab = VocabShard(start=new.weight_spec.local_range(tp_rank)[0], size=new.weight_spec.size)
    for entry in plan.tp_entries:
        model.get_submodule(entry).register_forward_pre_hook(_enter_region_hook(group), with_kwargs=True)
    for name, attr, value in plan.patches:
        setattr(model.get_submodule(name), attr, value)
    for owner, follower in ties:
        source, target = model.get_submodule(owner), model.get_submodule(follower)
        if source.weight.shape != target.weight.shape or source.weight_spec != target.weight_spec:
            raise ValueError(f"tied weights {owner} and {follower} are sharded differently")
        target.weight = source.weight

    specs: dict[str, ShardSpec | None] = {}
    for module_name, module in model.named_modules():
        local = module.shard_specs() if hasattr(module, "shard_specs") else {}
        for pname, _ in module.named_parameters(recurse=False):
            specs[f"{module_name}.{pname}" if module_name else pname] = local.get(pname)
    return specs, vocab
