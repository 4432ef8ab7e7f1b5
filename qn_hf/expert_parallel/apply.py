"""Expert parallelism (``parallelize(..., ep=N)``): each of N ranks of a stage's dp x tp grid holds a
contiguous block of every MoE layer's experts, whole, and tokens travel to them (expert_dispatch.py).

What is sharded is transformers' fused experts module (or experts stacked the same way that take
every token once per expert, Llama 4's: ``stacked.py``): a module decorated with
``@use_experts_implementation`` whose every parameter stacks the experts along dim 0
(``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``, biases where the architecture has them), called
as ``experts(hidden [T, H], top_k_index [T, K], top_k_weights [T, K])``. Its forward stays
transformers': the dispatch is registered in transformers' experts registry under a name of this
model's own and selected with ``set_experts_implementation``, and the module's ``num_experts`` is set
to the local count, so the model's own implementation (eager or grouped_mm) computes the local
experts. Routers, shared experts and dense layers keep their tp rules; the experts' own tp rules
(expert-TP) give way to ep.

LoRA on the experts' weights (peft's ``target_parameters``) wraps the module, which moves below the
wrapper (``<name>.base_layer``); the wrapper stands where the module was (``experts_roots``). Each
expert's factors sit in its block's rows of ``lora_A [E*r, in]`` and columns ``k*E + e`` of
``lora_B [out, r*E]``: both are cut into the same expert blocks (``_shard_expert_lora``) and the
wrapper's ``num_experts`` set to the local count, so peft's delta is each local expert's own.

Gradients: a token's contribution to an expert's weights is computed on the expert's owner, so the
owner's gradient is the sum over the tokens of its whole ep group; the ranks holding the same block
(``expert_replicas`` of them, ``Groups.experts``) sum theirs, like dp ranks. Nothing else changes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..compat import skip_expert_sentinels
from ..config.dims import Axis, ParallelDims
from ..config.options import Dispatch
from ..peft.lora import ParamLora, param_loras
from ..policies.module_kinds import is_fused_experts
from ..policies.patterns import base_model_and_prefix, join, match_modules
from ..policies.peft_names import is_lora_layer, lora_layer_names, without_wrappers
from ..policies.styles import Style
from ..policies.tp_plan import TpPlan
from ..tensor_parallel.shard import ShardSpec
from .dispatch import ExpertRoute, expert_parallel_forward
from .stacked import is_stacked_experts, stacked_expert_hooks

# transformers' name for the module holding an MoE layer's routed experts (a module name, not the
# tensor-parallel style of the same spelling).
EXPERTS_MODULE = "experts"

# config keys that count a model's routed experts (transformers' names differ by architecture)
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def counts_experts(config) -> bool:
    """Whether a (text) config counts routed experts: a mixture-of-experts architecture."""
    text = config.get_text_config()
    return any(isinstance(getattr(text, key, None), int) and getattr(text, key) > 1 for key in _EXPERT_COUNTS)


def experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The fused experts modules of ``model`` by name."""
    return {name: m for name, m in model.named_modules() if is_fused_experts(m)}


def sharded_experts(model: nn.Module) -> dict[str, nn.Module]:
    """Every experts module ep shards by name: fused ones and stacked ones (``stacked.py``)."""
    return {name: m for name, m in model.named_modules() if is_fused_experts(m) or is_stacked_experts(m)}


def experts_roots(model: nn.Module) -> dict[str, nn.Module]:
    """The experts modules ep shards by the name of what stands in their place: the module's own name,
    or for experts under LoRA wrappers (module docstring) the outermost wrapper's."""
    wrappers = lora_layer_names(model)
    return {without_wrappers(name, wrappers): module for name, module in sharded_experts(model).items()}


def expert_parameter_names(model: nn.Module) -> frozenset[str]:
    """Names of the parameters ep cuts into expert blocks: every parameter of a fused experts module
    and the LoRA factors of those parameters."""
    loras = param_loras(model)
    names = {f"{name}.{p}" for name, module in sharded_experts(model).items() for p, _ in module.named_parameters()}
    return frozenset(names | {lora.factor(part, a) for n in names if (lora := loras.get(n)) is not None
                              for a in lora.adapters for part in ("lora_A", "lora_B")})


def _unfused_experts(model: nn.Module) -> list[str]:
    """Modules that hold routed experts in another form (a ModuleList of MLPs, a custom class)."""
    found = []
    for name, module in model.named_modules():
        if is_lora_layer(module):
            continue  # a LoRA wrapper stands where the experts were; the module itself is checked below it
        if name.rpartition(".")[2] == EXPERTS_MODULE and not (is_fused_experts(module) or is_stacked_experts(module)):
            found.append(f"{name} ({type(module).__name__})")
    return found


def check_expert_parallel(model: nn.Module, *, dims: ParallelDims, plan: TpPlan,
                          dispatch: Dispatch = Dispatch.ALL_TO_ALL) -> None:
    """Raise ``ValueError`` (every rank, no communication) for what ep cannot shard, or dispatch so."""
    if dims.ep == 1:
        return
    model_type = model.config.model_type
    unfused = _unfused_experts(model)
    if unfused:
        raise ValueError(f"ep={dims.ep}: {model_type}'s experts {unfused[0]} are neither transformers' fused experts "
                         f"form (one module with 3-D gate_up_proj/down_proj, @use_experts_implementation) nor experts "
                         f"stacked on dim 0 called with every expert's rows (Llama 4), which expert parallelism "
                         f"shards; use ep=1 (tp shards its experts)")
    found = sharded_experts(model)
    if not found:
        counts = {k: getattr(model.config.get_text_config(), k, None) for k in _EXPERT_COUNTS}
        why = "has no mixture-of-experts layers" if not any(counts.values()) else "has no fused experts module"
        raise ValueError(f"ep={dims.ep}: {model_type} {why}; use ep=1")
    sizes = {module.num_experts for module in found.values()}
    if len(sizes) > 1:
        raise ValueError(f"ep={dims.ep}: {model_type}'s MoE layers have different numbers of experts {sorted(sizes)}; "
                         f"use ep=1")
    for name, module in found.items():
        if module.num_experts % dims.ep:
            raise ValueError(f"ep={dims.ep} must divide the {module.num_experts} experts of {name}; choose ep among "
                             f"the divisors of {module.num_experts} that divide dp*tp")
    _check_ep_plan(model)
    identity = [n for n, style in plan.policy.tp_plan.items() if style == Style.EXPERTS_IDENTITY]
    if identity:
        raise ValueError(f"ep={dims.ep}: {model_type} routes tokens to identity experts ({identity[0]}) outside "
                         f"the experts' weights; use ep=1")
    if dispatch is Dispatch.ALL_GATHER:
        _check_gathered_dispatch(model)


# transformers' experts implementations that leave expert-parallel sentinels (ids past the local experts) out
# of their output without reading the device (integrations/moe.py); "eager" loops over the experts it finds
# with a device read per expert, and a model's own eager forward need not know the sentinel (gpt_oss's)
_SENTINEL_IMPLEMENTATIONS = ("grouped_mm", "batched_mm")


def _check_gathered_dispatch(model: nn.Module) -> None:
    """``expert_dispatch="all_gather"`` hands the experts the choices of other ranks' experts as
    transformers' sentinel: its implementation must leave them out (dispatch.py; every transformers qn_hf
    supports does so in grouped_mm and batched_mm, compat.skip_expert_sentinels)."""
    for name, module in experts_modules(model).items():
        implementation = module.config._experts_implementation
        if implementation not in _SENTINEL_IMPLEMENTATIONS:
            raise ValueError(f"expert_dispatch='all_gather': {name} runs the {implementation!r} experts "
                             f"implementation, which reads the device per expert and need not skip sentinels; "
                             f"call model.set_experts_implementation('grouped_mm') before parallelize, or use "
                             f"expert_dispatch='all_to_all'")


# How transformers' ``base_model_ep_plan`` marks the experts: the module by a style ending so
# (``ep_dispatch_experts`` in 5.23, ``moe_tp_experts`` in 5.17), its stacked weights by the grouped GEMM
# (the only mark Llama 4's plan gives in 5.17).
_EXPERTS_STYLE = "_experts"
_EXPERT_WEIGHTS_STYLE = "grouped_gemm"


def _check_ep_plan(model: nn.Module) -> None:
    """Where the config declares transformers' own expert-parallel plan, the experts it dispatches to
    must be the very modules ep shards here: a model whose experts the two read differently is refused
    rather than sharded by one reading. Its other entries (the grouped GEMM kernel for the experts'
    weights; colwise/rowwise/replicated rules, which transformers applies over the ep mesh) describe
    its own runtime's layout; qn_hf's tp and dp rules place those modules."""
    text = model.config.get_text_config()
    ep_plan = getattr(text, "base_model_ep_plan", None) or getattr(model.config, "base_model_ep_plan", None)
    if not ep_plan:
        return
    base, prefix = base_model_and_prefix(model)
    patterns = {pattern for pattern, style in ep_plan.items() if str(style).endswith(_EXPERTS_STYLE)}
    patterns |= {pattern.rpartition(".")[0] for pattern, style in ep_plan.items() if style == _EXPERT_WEIGHTS_STYLE}
    declared = {join(prefix, name) for pattern in patterns for name in match_modules(base, pattern)}
    sharded = set(experts_roots(model))  # under LoRA the wrapper stands where transformers' plan names the experts
    if declared != sharded:
        unsharded = sorted(declared - sharded)
        what = (f"names {unsharded[0]} as experts, which qn_hf does not find in a form it shards" if unsharded else
                f"does not name {sorted(sharded - declared)[0]}, which qn_hf would shard as experts")
        raise ValueError(f"ep: transformers' base_model_ep_plan of {model.config.model_type} {what}; "
                         f"use ep=1 (tp shards its experts)")


def expert_parallel_plan(model: nn.Module, plan: TpPlan, *, ep: int) -> TpPlan:
    """``plan`` without the tp rules of the experts modules and their parameters (ep shards them)."""
    if ep == 1:
        return plan
    names = tuple(experts_roots(model))  # LoRA factors and a hook rule on a wrapper go too
    return plan.only(lambda module: not any(module == n or module.startswith(n + ".") for n in names))


def apply_expert_parallel(model: nn.Module, *, route: ExpertRoute, ep_rank: int) -> dict[str, ShardSpec]:
    """Keep this rank's block of every experts module's experts and route the model's experts
    calls through the ep dispatch; return the specs of the sharded parameters by name."""
    found = sharded_experts(model)
    loras = param_loras(model)
    specs: dict[str, ShardSpec] = {}
    for name, module in found.items():
        for pname, param in list(module.named_parameters(recurse=False)):
            spec = ShardSpec(dim=0, tp=route.ep, size=route.experts, axis=Axis.EP)
            setattr(module, pname, nn.Parameter(spec.shard(param.data, ep_rank), requires_grad=param.requires_grad))
            specs[f"{name}.{pname}"] = spec
            lora = loras.get(f"{name}.{pname}")
            if lora is not None:
                specs.update(_shard_expert_lora(model, lora, route=route, ep_rank=ep_rank))
        module.num_experts = route.local
        if is_stacked_experts(module):
            stacked_expert_hooks(module, route=route)
        elif route.gathering is not None:
            skip_expert_sentinels(module)  # transformers' own switch: sentinel ids left out (dispatch.py)
    _replace_experts(model, "qn_hf_ep", lambda local: expert_parallel_forward(route, local))
    return specs


def eager_experts(model: nn.Module) -> None:
    """Run every fused experts call of ``model`` eagerly inside compiled code (for ``compile``): its
    current implementation (the model's own, or ep's dispatch) wrapped in ``torch.compiler.disable``. A
    token's experts are chosen at run time, so each expert's rows (and ep's all-to-all splits) have
    data-dependent sizes, which would split and recompile a block's graph at every new size; around the
    call the block compiles once."""
    _replace_experts(model, "qn_hf_eager_experts", torch.compiler.disable)


def _replace_experts(model: nn.Module, prefix: str, wrap: Callable[[Callable], Callable]) -> None:
    """Register ``wrap`` of the fused experts' current implementation (``local_forward(module, rows, ids,
    weights)``, eager or grouped_mm) in transformers' experts registry and select it (no fused experts:
    nothing). The registry is process-wide: a name of this model's own keeps two models (with different
    groups) apart, as ring attention's registration does."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

    fused = experts_modules(model)
    if not fused:
        return
    first = next(iter(fused.values()))
    current = ALL_EXPERTS_FUNCTIONS.get_interface(first.config._experts_implementation, type(first).forward.__wrapped__)
    key = f"{prefix}_{id(model):x}"
    ExpertsInterface.register(key, wrap(current))
    model.set_experts_implementation(key)


def _shard_expert_lora(model: nn.Module, lora: ParamLora, *, route: ExpertRoute, ep_rank: int) -> dict[str, ShardSpec]:
    """Keep this rank's experts' rows of ``lora_A`` ([E*r, in], expert-major: one contiguous block)
    and columns of ``lora_B`` ([out, r*E], column ``k*E + e``: r parts of E columns, each cut into
    the same blocks), and make the wrapper read them as ``route.local`` experts."""
    wrapper = model.get_submodule(lora.wrapper)
    specs = {}
    for adapter in lora.adapters:
        r = wrapper.r[adapter]
        for part, spec in (("lora_A", ShardSpec(dim=0, tp=route.ep, size=route.experts * r, axis=Axis.EP)),
                           ("lora_B", ShardSpec(dim=1, tp=route.ep, size=r * route.experts, parts=r, axis=Axis.EP))):
            linear = getattr(wrapper, part)[adapter]
            linear.weight = nn.Parameter(spec.shard(linear.weight.data, ep_rank),
                                         requires_grad=linear.weight.requires_grad)
            specs[lora.factor(part, adapter)] = spec
    wrapper.num_experts = route.local
    return specs


def expert_tp_blocks(model: nn.Module, plan: TpPlan) -> dict[str, frozenset[str]]:
    """At ep=1, the MoE blocks whose only tp rules are their experts' (style experts on the experts
    module, its sliced parameters): with sequence parallelism they run on this rank's slice of the
    sequence, the router on this rank's tokens, the experts on every rank's rows (gathered at their
    call); each with the names of the experts' parameters (split over tp, not replicated)."""
    out = {}
    for name, module in sharded_experts(model).items():
        block = name.rpartition(".")[0]
        inside = [(rule, style) for rule, style in plan.rules if rule == block or rule.startswith(block + ".")]
        if (name, Style.EXPERTS) in inside and all(rule == name or rule.startswith(name + ".") for rule, _ in inside):
            out[block] = frozenset(f"{name}.{p}" for p, _ in module.named_parameters())
    return out


def token_wise_blocks(model: nn.Module, plan: TpPlan) -> dict[str, frozenset[str]]:
    """The MoE blocks (parents of fused experts modules) that act token by token under ep: nothing in
    them is split over tp (no rule inside; a shared expert with tp rules keeps the block out), so with
    sequence parallelism they run on this rank's slice of the sequence, each with the names of its
    ep-sharded parameters."""
    out = {}
    sharded = expert_parameter_names(model)
    for name in experts_roots(model):
        block = name.rpartition(".")[0]
        if not any(rule == block or rule.startswith(block + ".") for rule, _ in plan.rules):
            out[block] = frozenset(n for n in sharded if n.startswith(name + "."))
    return out
