"""Applying a resolved ``TpPlan``: swap leaves, shard bare parameters, hook modules, patch attributes.

Nothing here replaces a Hugging Face ``forward``: only exact leaves (Linear, Conv1D, Embedding, or
an embedding subclass with an adapter) are swapped, bare parameters replaced by their slice, and
the integers a forward reads to reshape (GPT-2's ``split_size``, Llama's ``num_key_value_groups``,
or a value inside a module's own copy of the config) set to their per-rank values.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from torch import nn
from torch.distributed import ProcessGroup

from ..comm import copy_to_group
from ..policies.heads import attention_layout
from ..policies.styles import (
    EMBEDDING_STYLES,
    HOOK_STYLES,
    LINEAR_STYLES,
    PARAM_STYLES,
    REPLICATED_SUMMED,
    Style,
    packed_parts,
    param_shard_dim,
)
from ..policies.tp_plan import TpPlan
from .embeddings import ColumnParallelEmbedding, VocabParallelEmbedding
from .hooks import head_input_hooks, identity_expert_hooks, mla_kv_a_hooks, partial_sum_hooks
from .layers import ColumnParallelLinear, RowParallelLinear, SharedKVColumnLinear, linear_dims
from .sequence_parallel import first_argument, with_first
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
        key, value = first_argument(module, args, kwargs)
        return with_first(args, kwargs, key, copy_to_group(value, group=group))

    return hook


def _parallel_leaf(module: nn.Module, style: Style, plan: TpPlan, tp_rank: int, group: ProcessGroup,
                   entered: bool, head_dim: int | None = None) -> nn.Module:
    tp = plan.tp
    if style == Style.VOCAB_EMBEDDING:
        spec = ShardSpec(dim=0, tp=tp, size=module.num_embeddings, padded_size=padded(module.num_embeddings, tp))
        return VocabParallelEmbedding.from_module(module, spec=spec, tp_rank=tp_rank, group=group)
    if style == Style.EMBEDDING_COLWISE:
        spec = ShardSpec(dim=1, tp=tp, size=module.embedding_dim)
        return ColumnParallelEmbedding.from_module(module, spec=spec, tp_rank=tp_rank, group=group)
    in_f, out_f, _, _ = linear_dims(module)
    if style == Style.COLWISE_SHARED_KV:
        return SharedKVColumnLinear.from_module(module, heads=plan.layout.heads, head_dim=head_dim, tp=tp,
                                                tp_rank=tp_rank, group=group, copy_input=not entered)
    if style in (Style.ROWWISE, Style.ROWWISE_SPLIT):
        return RowParallelLinear.from_module(module, spec=ShardSpec(dim=0, tp=tp, size=in_f), tp_rank=tp_rank,
                                             group=group, split_input=style == Style.ROWWISE_SPLIT,
                                             sequence_parallel=plan.sequence_parallel and entered)
    if style == Style.VOCAB_COLWISE:
        spec = ShardSpec(dim=0, tp=tp, size=out_f, padded_size=padded(out_f, tp))
    elif style == Style.COLWISE_KV:
        spec = ShardSpec(dim=0, tp=tp, size=out_f, replicas=plan.layout.kv_replicas)
    else:
        spec = ShardSpec(dim=0, tp=tp, size=out_f, parts=packed_parts(style))
    return ColumnParallelLinear.from_module(module, spec=spec, tp_rank=tp_rank, group=group, copy_input=not entered,
                                            gather_output=style == Style.COLWISE_GATHER)


def _shard_parameter(model: nn.Module, name: str, style: Style, plan: TpPlan, tp_rank: int) -> ShardSpec | None:
    """Replace the bare parameter ``name`` by this rank's slice; its module runs unchanged on it."""
    owner_name, _, pname = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    param = getattr(owner, pname)
    dim = param_shard_dim(style, param.dim())
    if dim is None:
        return None
    spec = ShardSpec(dim=dim, tp=plan.tp, size=param.shape[dim], parts=packed_parts(style))
    setattr(owner, pname, nn.Parameter(spec.shard(param.data, tp_rank), requires_grad=param.requires_grad))
    return spec


def _patch(module: nn.Module, path: str, value: int) -> None:
    """Set ``module.<path>``; an object on the way (a config shared by every module) is copied for
    this module first, so no other module and no saved config sees the per-rank value."""
    *objects, attr = path.split(".")
    holder = module
    for part in objects:
        own = copy.copy(getattr(holder, part))
        setattr(holder, part, own)
        holder = own
    setattr(holder, attr, value)


def apply_tp_plan(
    model: nn.Module, plan: TpPlan, *, tp_rank: int, group: ProcessGroup
) -> tuple[dict[str, ShardSpec | None], VocabShard | None]:
    """Shard ``model`` in place; return every parameter's ``ShardSpec`` (None: replicated across tp)
    by its Hugging Face name, and the vocabulary shard of the output head if it has one."""
    leaves = [(n, s) for n, s in plan.rules if s in LINEAR_STYLES or s in EMBEDDING_STYLES]
    # Ties (GPT-2's lm_head.weight is wte.weight) are found by identity before anything is swapped
    # and restored on the new shards afterwards.
    owner_of: dict[int, str] = {}
    ties: list[tuple[str, str]] = []
    for name, _ in leaves:
        weight = model.get_submodule(name).weight
        if id(weight) in owner_of:
            ties.append((owner_of[id(weight)], name))
        owner_of.setdefault(id(weight), name)

    # a leaf registered under several names (T5's shared embedding, each stack's embed_tokens) is one
    # module: its parallel replacement takes every one of them
    aliases: dict[int, list[str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        aliases.setdefault(id(module), []).append(path)
    vocab: VocabShard | None = None
    # a replaced leaf's parameter -> (it, its shard): holding it keeps its id from being reused
    swapped: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
    for name, style in leaves:
        entered = any(name.startswith(entry + ".") for entry in plan.tp_entries)
        old = model.get_submodule(name)
        head_dim = attention_layout(model.get_submodule(name.rpartition(".")[0]), plan.layout).head_dim
        new = _parallel_leaf(old, style, plan, tp_rank, group, entered=entered, head_dim=head_dim)
        for path in aliases.get(id(old), [name]):
            _replace(model, path, new)
        swapped.update({id(param): (param, getattr(new, p)) for p, param in old.named_parameters(recurse=False)
                        if isinstance(getattr(new, p, None), nn.Parameter)})
        if style == Style.VOCAB_COLWISE:
            vocab = VocabShard(start=new.weight_spec.local_range(tp_rank)[0], size=new.weight_spec.size)
    param_specs = {name: _shard_parameter(model, name, style, plan, tp_rank)
                   for name, style in plan.rules if style in PARAM_STYLES}
    for name, style in plan.rules:
        if style not in HOOK_STYLES or style in REPLICATED_SUMMED:
            continue  # no hook: these act on gradients (GradSync)
        module = model.get_submodule(name)
        if name in plan.sequence_experts:
            continue  # their hooks gather rows while sequence parallelism is on: sequence_hooks.py
        if style in (Style.EXPERTS, Style.ALL_REDUCE):
            partial_sum_hooks(module, group=group)
        elif style == Style.EXPERTS_IDENTITY:
            identity_expert_hooks(module, group=group)
        elif style == Style.MLA_KV_A:
            mla_kv_a_hooks(module, group=group, rope_dim=plan.mla_rope_dim)
    for name, inputs in plan.head_inputs:
        head_input_hooks(model.get_submodule(name), inputs=dict(inputs), heads=plan.layout.heads, tp=plan.tp,
                         tp_rank=tp_rank)
    for entry in plan.tp_entries if not plan.sequence_parallel else ():  # else sequence_hooks.py's gather
        model.get_submodule(entry).register_forward_pre_hook(_enter_region_hook(group), with_kwargs=True)
    for name, path, value in plan.patches:
        _patch(model.get_submodule(name), path, value)
    for owner, follower in ties:
        source, target = model.get_submodule(owner), model.get_submodule(follower)
        if source.weight.shape != target.weight.shape or source.weight_spec != target.weight_spec:
            raise ValueError(f"tied weights {owner} and {follower} are sharded differently")
        target.weight = source.weight
    for module in model.modules():  # other registrations of a replaced parameter (BERT's head's bias)
        for pname, param in list(module.named_parameters(recurse=False)):
            if id(param) in swapped and swapped[id(param)][0] is param:
                setattr(module, pname, swapped[id(param)][1])

    specs: dict[str, ShardSpec | None] = {}
    by_tensor: dict[int, ShardSpec] = {}  # a parameter registered twice takes its shard's spec under both names
    for module_name, module in model.named_modules():
        local = module.shard_specs() if hasattr(module, "shard_specs") else {}
        for pname, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{pname}" if module_name else pname
            specs[full] = local.get(pname, param_specs.get(full))
            if specs[full] is not None:
                by_tensor[id(param)] = specs[full]
    for module_name, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{pname}" if module_name else pname
            if specs[full] is None and id(param) in by_tensor:
                specs[full] = by_tensor[id(param)]
    return specs, vocab
