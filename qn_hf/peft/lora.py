"""PEFT LoRA models: what is accepted, and how a LoRA layer is sharded under its base layer's style.

``peft.get_peft_model`` wraps each target (``q_proj``) in a LoRA layer holding the original as
``base_layer`` and two small ``nn.Linear``s per adapter, ``lora_A`` (r x in) and ``lora_B`` (out x r);
its forward adds ``lora_B(lora_A(dropout(x))) * scaling`` to ``base_layer(x)``. qn_hf parallelizes
the HF model inside (``get_base_model()``), with LoRA layers in place, and never replaces their
forward: the rule a policy gives the target is carried to the three leaves.

* **column styles** (output features split): ``base_layer`` and ``lora_B`` are split the same way
  (each rank computes its columns of both terms); ``lora_A`` is replicated and sees the whole input,
  which is in the tp region (the target or a module around it is a tp entry, whose input gradient
  is all-reduced). Its gradient ``(B_r^T g_r) x^T`` covers only this rank's columns of ``lora_B``,
  so it is summed over tp (``replicate_grad_sum``).
* **row styles** (input features split, output summed): ``base_layer`` and ``lora_A`` are split the
  same way, so ``lora_A`` sums its partial products over tp (a rank-r all-reduce, or a
  reduce-scatter along the sequence with sequence parallelism); ``lora_B`` is replicated on the
  whole sum (``replicate_after_row``). Its gradient is then whole on every rank, except with
  sequence parallelism, where each rank sees its slice of the sequence and the gradients are summed.
* ``replicate``: everything stays whole.

* DoRA: at tp > 1 on column layers, its magnitude vector split like the outputs (``_check_dora``).

LoRA on a bare parameter (``LoraConfig(target_parameters=...)``, peft's ``ParamWrapper``; in practice
the fused 3-D expert weights ``gate_up_proj [E, out, in]``) adds ``scaling * B_e A_e`` to each
expert's weight while the module runs (a parametrization), with every expert's factors stacked:
``lora_A [E*r, in]`` (expert-major rows) and ``lora_B [out, r*E]`` (column ``k*E + e``). peft inserts
the wrapper where the module was, so the module moves to ``<name>.base_layer`` (once per targeted
parameter); rules and names see through it (``without_wrappers``). Under a parameter's rule the
factor on the split side is split alike and the other one, whole on every rank, sees only this
rank's part of the weight's gradient, so it is summed over tp (``_param_lora_rules``); ep cuts both
into expert blocks (``qn_hf.expert_parallel.apply``).

Other styles (embeddings, the vocabulary head) under a LoRA layer, ``target_parameters`` on a
swapped linear layer's weight at tp > 1, DoRA on row layers at tp > 1, other LoRA variants at
tp > 1, and other PEFT methods are refused.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from torch import nn

from ..policies.module_kinds import is_projection
from ..policies.patterns import submodule_or_none
from ..policies.peft_names import is_lora_layer, is_param_wrapper, lora_layer_type
from ..policies.styles import (
    COLUMN_STYLES,
    HOOK_STYLES,
    PARAM_FORM,
    PARAM_STYLES,
    ROW_STYLES,
    Split,
    Style,
    param_shard_dim,
)


@dataclass(frozen=True)
class Adapter:
    """The PEFT model a ParallelModel was built from, for saving its adapter directory."""

    peft_model: nn.Module
    name: str  # the adapter ("default")


@dataclass(frozen=True)
class ParamLora:
    """peft's LoRA on one bare parameter (a ``ParamWrapper``; module docstring)."""

    wrapper: str  # the wrapper's module name
    param: str  # the adapted parameter's name (below every wrapper's base_layer)
    out_dim: int  # the parameter's dims that hold the LoRA's outputs and inputs
    in_dim: int
    adapters: tuple[str, ...]

    def factor(self, part: str, adapter: str) -> str:
        """The weight of ``lora_A`` or ``lora_B`` of ``adapter``."""
        return f"{self.wrapper}.{part}.{adapter}.weight"


def param_loras(model: nn.Module) -> dict[str, ParamLora]:
    """Every ``ParamWrapper`` of ``model``, by the name of the parameter it adapts."""
    out = {}
    for name, module in model.named_modules():
        if not is_param_wrapper(module):
            continue
        inner, path = module, name
        while is_lora_layer(inner):
            inner, path = inner.base_layer, f"{path}.base_layer"
        ndim = getattr(inner, module.parameter_name).dim()
        # peft reads a 3-D parameter as [E, out, in] unless the module says ``is_transposed``
        # ([E, in, out]); a 2-D one as a Linear weight [out, in] (ParamWrapper.update_layer)
        if ndim == 3:
            out_dim, in_dim = (2, 1) if getattr(inner, "is_transposed", False) else (1, 2)
        else:
            out_dim, in_dim = 0, 1
        out[f"{path}.{module.parameter_name}"] = ParamLora(wrapper=name, param=f"{path}.{module.parameter_name}",
                                                           out_dim=out_dim, in_dim=in_dim,
                                                           adapters=tuple(module.lora_A))
    return out


def unwrap_peft(model: nn.Module) -> tuple[nn.Module, Adapter | None]:
    """The HF model to parallelize and, for a PEFT model, its adapter; refuse what is not supported
    (on every rank, before any collective)."""
    peft = sys.modules.get("peft")
    if peft is None or not isinstance(model, peft.PeftModel):
        if lora_layer_type() is not None and any(is_lora_layer(m) for m in model.modules()):
            raise ValueError("the model holds LoRA layers but is not a PeftModel (inject_adapter_in_model?); pass the "
                             "model get_peft_model returned, so that save_pretrained can write its adapter")
        return model, None
    names = list(model.peft_config)
    if len(names) != 1:
        raise ValueError(f"the PEFT model has {len(names)} adapters {names}; qn_hf trains one: delete the others "
                         f"(model.delete_adapter(name)) before parallelize")
    name = names[0]
    config = model.peft_config[name]
    kind = getattr(config.peft_type, "value", str(config.peft_type))
    if kind != "LORA":
        raise ValueError(f"PEFT method {kind} is not supported: qn_hf parallelizes LoRA adapters (LoraConfig); "
                         f"{kind} changes the model in ways its tensor and pipeline splits do not reproduce")
    if getattr(config, "modules_to_save", None):
        raise ValueError(f"LoraConfig(modules_to_save={config.modules_to_save}) is not supported: the wrapped copies "
                         f"would need their own sharding rules; train those modules by leaving them unfrozen "
                         f"in a plain model, or leave modules_to_save empty")
    inner = model.get_base_model()
    for module_name, module in inner.named_modules():
        if is_lora_layer(module) and not is_param_wrapper(module) and not is_projection(module.base_layer):
            raise ValueError(f"LoRA on {module_name} ({type(module.base_layer).__name__}) is not supported: qn_hf "
                             f"shards LoRA on linear layers; remove it from target_modules")
    return inner, Adapter(peft_model=model, name=name)


@dataclass(frozen=True)
class LoraLeaves:
    """What ``lora_rules`` derives from the rules on LoRA layers."""

    rules: dict[str, str]  # every rule, those on LoRA layers carried to their leaves
    entries: list[str]  # LoRA layers under a column style whose input must enter the tp region there
    shared_dropout: list[str]  # dropout on a whole, replicated input: the same mask on every tp rank
    local_dropout: list[str]  # dropout on this rank's slice of the features: its own mask


def lora_rules(model: nn.Module, rules: dict[str, Style], *, tp: int) -> LoraLeaves:
    """``rules`` with each rule on a LoRA layer carried to its leaves (module docstring)."""
    out: dict[str, Style] = {}
    leaves = LoraLeaves(rules=out, entries=[], shared_dropout=[], local_dropout=[])
    on_params = param_loras(model)
    for name, style in rules.items():
        # (a whole-keeping rule may name a bare parameter: no module there)
        module = submodule_or_none(model, name) if style not in PARAM_STYLES else None
        if module is None and name in on_params:
            out[name] = style
            out.update(_param_lora_rules(model, on_params[name], style))
            continue
        if module is None or not is_lora_layer(module):
            out[name] = style
            continue
        if is_param_wrapper(module):
            if style in HOOK_STYLES or style == Style.REPLICATE:  # the wrapper passes the module's arguments on
                out[name] = style
                continue
            raise ValueError(f"LoRA on a parameter of {name} (target_parameters, style {style!r}) is not supported "
                             f"with tp={tp}: its factors would need the layer's split; target the layer itself "
                             f"(target_modules) or use tp=1")
        adapters = list(module.lora_A)
        if module.lora_variant and tp > 1:
            _check_dora(module, name, style, tp=tp)
            magnitude = PARAM_FORM.get(style, Style.REPLICATE)  # the outputs' split, or whole under replicate
            out.update({f"{name}.lora_magnitude_vector.{a}.weight": magnitude for a in adapters})
        dropouts = [f"{name}.lora_dropout.{a}" for a in adapters if isinstance(module.lora_dropout[a], nn.Dropout)]
        out[f"{name}.base_layer"] = style
        if style == Style.REPLICATE:
            out.update({f"{name}.{part}.{a}": Style.REPLICATE for a in adapters for part in ("lora_A", "lora_B")})
        elif style in COLUMN_STYLES:
            out.update({f"{name}.lora_A.{a}": Style.REPLICATE_GRAD_SUM for a in adapters})
            out.update({f"{name}.lora_B.{a}": style for a in adapters})
            leaves.entries.append(name)
            leaves.shared_dropout.extend(dropouts)  # x is whole on every rank: one mask, as in one process
        elif style in ROW_STYLES:
            out.update({f"{name}.lora_A.{a}": style for a in adapters})
            out.update({f"{name}.lora_B.{a}": Style.REPLICATE_AFTER_ROW for a in adapters})
            # the features are split (rowwise: the input is this rank's slice; rowwise_split: the whole input,
            # of which lora_A keeps this rank's slice after the mask): independent masks per slice
            leaves.local_dropout.extend(dropouts)
        else:
            raise ValueError(f"LoRA on {name} (style {style!r}) is not supported with tp={tp}: qn_hf shards LoRA under "
                             f"column and row styles {COLUMN_STYLES + ROW_STYLES}; remove {name.rpartition('.')[2]!r} from "
                             f"target_modules or use tp=1")
    return leaves


# The style that splits a 2-D LoRA factor like its parameter: B's rows where the parameter's outputs
# are split, A's columns where its inputs are, in as many fused parts.
_FACTOR_STYLES = {(Split.COLUMN, 1): Style.PARAM_COLWISE, (Split.COLUMN, 2): Style.PARAM_PACKED_COLWISE,
                  (Split.ROW, 1): Style.PARAM_ROWWISE, (Split.ROW, 2): Style.PARAM_PACKED_ROWWISE}


def _param_lora_rules(model: nn.Module, lora: ParamLora, style: Style) -> dict[str, Style]:
    """The rules of a ``ParamWrapper``'s factors under its parameter's rule: the factor on the split
    side is cut alike, so ``B_r A`` (or ``B A_r``) is exactly this rank's part of the delta; the other
    factor is whole and its gradient (``B_r^T dW_r``, or ``dW_r A_r^T``) covers only this rank's part
    of the weight, so it is summed over tp."""
    owner, _, pname = lora.param.rpartition(".")
    dim = param_shard_dim(style, getattr(model.get_submodule(owner), pname).dim())
    if dim is None:
        return {}  # the parameter stays whole, and so do its factors and their gradients
    if dim not in (lora.out_dim, lora.in_dim):
        raise ValueError(f"LoRA on {lora.param} (style {style!r}) is not supported: the style splits dim {dim}, "
                         f"neither the LoRA's outputs (dim {lora.out_dim}) nor its inputs (dim {lora.in_dim})")
    split, whole, side = ("lora_B", "lora_A", Split.COLUMN) if dim == lora.out_dim else ("lora_A", "lora_B", Split.ROW)
    factor = _FACTOR_STYLES.get((side, style.parts))
    if factor is None:
        raise ValueError(f"LoRA on {lora.param} (style {style!r}, {style.parts} fused parts) is not supported")
    rules = {lora.factor(split, a): factor for a in lora.adapters}
    rules.update({lora.factor(whole, a): Style.REPLICATE_GRAD_SUM for a in lora.adapters})
    return rules


def _check_dora(module: nn.Module, name: str, style: Style, *, tp: int) -> None:
    """DoRA (``use_dora=True``) at tp > 1: peft's forward scales each output feature by
    ``magnitude / ||W + s B A||`` over that output's row of inputs. Under a column style a rank holds
    whole rows (its outputs' weights, lora_B's rows, the magnitudes split alike), so the norms are
    local and exact. Under a row style every row is split over tp and the norm would need a sum over
    tp inside peft's forward, which qn_hf does not replace: refused, as are q|k|v fused, gathered and
    KV-head columns (the magnitude vector's split does not follow them) and other LoRA variants."""
    from peft.tuners.lora.variants import DoraLinearVariant  # peft is imported: the model holds LoRA layers

    variants = sorted(type(v).__name__ for v in module.lora_variant.values())
    if not all(isinstance(v, DoraLinearVariant) for v in module.lora_variant.values()):
        raise ValueError(f"LoRA variant {variants} on {name} is not supported with tp={tp}; use tp=1 (dp and pp work) "
                         f"or plain LoRA")
    if style not in (Style.COLWISE, Style.COLWISE_PACKED2, Style.REPLICATE):
        why = ("each output's norm spans the input features, which this style splits over tp"
               if style in ROW_STYLES else "its outputs are fused three ways, gathered, or KV heads that may be "
               "replicated over tp, which the magnitude vector's split does not follow")
        raise ValueError(f"DoRA (use_dora=True) on {name} (style {style!r}) is not supported with tp={tp}: {why}; "
                         f"use DoRA on plain column layers only (q_proj, gate_proj, up_proj), plain LoRA here, or tp=1")
