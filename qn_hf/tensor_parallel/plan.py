"""Policies (data) and their resolution against a concrete model (validation, no communication).

A ``ModelPolicy`` names Hugging Face modules with wildcard patterns (``h.*.attn.c_attn``; ``*`` is
one path component) and says how each is parallelized. ``build_tp_plan`` matches it against a model
and checks everything that could otherwise fail later, inside a collective: every rule matches,
every Linear inside a block has a rule, every patched attribute exists, and every sharded size
divides by tp. It only reads the model, so it runs on every rank before any process group exists.
"""

from __future__ import annotations

from torch import nn

from ..peft.lora import LoraLeaves, lora_rules
from ..policies.heads import HeadLayout, attention_layout, divisors, head_layout
from ..policies.layer_fields import layer_values
from ..policies.model_policy import ModelPolicy
from ..policies.module_kinds import is_projection
from ..policies.patterns import base_model_and_prefix, join, match_modules, match_parameters
from ..policies.peft_names import is_lora_layer, is_param_wrapper, names_before_peft
from ..policies.positions import learned_positions
from ..policies.styles import COLUMN_STYLES, PARAM_STYLES, VOCAB_ROWS, WHOLE_SUMMED_LINEAR, Style
from ..policies.task import TaskHead, task_head
from ..policies.tp_plan import TpPlan
from .rules import check_head_tables, check_rule, check_split_norms, check_ties, split_kv_per_module


def _resolve_rules(model: nn.Module, policy: ModelPolicy, base: nn.Module, prefix: str,
                   head: TaskHead) -> dict[str, str]:
    # a task model with a base model inside, or one that is its own base (T5) with an LM head found in it
    has_head = base is not model or head.vocab_output is not None
    rules: dict[str, Style] = {}
    # the head found from the model: an LM head over the vocabulary splits its columns (the loss is
    # then vocab-parallel); any other head stays whole. A policy's head_plan may say otherwise.
    head_plan = {head.vocab_output: Style.VOCAB_COLWISE} if head.vocab_output and has_head else {}
    head_plan.update(policy.head_plan if has_head else {})
    if head.vocab_output in head_plan and not _tied_rows_split(model, base, prefix, policy, head.vocab_output):
        del head_plan[head.vocab_output]  # its weight is an embedding's that stays whole: so does the head
    for scope, plan, root_prefix in ((base, policy.tp_plan, prefix), (model, head_plan, "")):
        rename = names_before_peft(scope)  # a parameter rule names it as before peft wrapped its module
        for pattern, style in plan.items():
            if style in PARAM_STYLES:
                names = match_parameters(scope, pattern, rename=rename)
            else:  # a whole-keeping rule may also name one parameter (a bare per-head weight)
                names = match_modules(scope, pattern) or (match_parameters(scope, pattern, rename=rename)
                                                          if style in (Style.REPLICATE, Style.REPLICATE_GRAD_SUM) else [])
            if not names and not policy.transformers_plan and scope is base:  # transformers' plans name
                # optional modules; a head rule applies to the heads a model has
                raise ValueError(f"policy {policy.model_type}: rule {pattern!r} matches no module of {type(scope).__name__}")
            for name in names:
                rules[join(root_prefix, name)] = style
    if policy.transformers_plan:
        _keep_ties_whole(model, rules)
    return rules


def _keep_ties_whole(model: nn.Module, rules: dict[str, Style]) -> None:
    """A derived plan's vocabulary-split embedding whose weight a layer left whole also uses (an LM head
    kept whole: BART's, beside its logits bias) stays whole too, rather than untie them."""
    users: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if not list(module.children()) and isinstance(getattr(module, "weight", None), nn.Parameter):
            users.setdefault(id(module.weight), []).append(name)
    for names in users.values():
        if any(rules.get(n) not in VOCAB_ROWS for n in names):
            for name in names:
                if rules.get(name) in VOCAB_ROWS:
                    del rules[name]


def _tied_rows_split(model: nn.Module, base: nn.Module, prefix: str, policy: ModelPolicy, head: str) -> bool:
    """Whether every other module sharing the LM head's weight is one the body's plan splits by
    vocabulary rows (the embedding it is tied to), or there is none."""
    weight = getattr(model.get_submodule(head), "weight", None)
    # the head's own submodules (peft's base_layer under a LoRA head) share its weight without tying it
    owners = [name for name, module in model.named_modules() if name != head and not name.startswith(head + ".")
              and getattr(module, "weight", None) is weight and weight is not None]
    split = {join(prefix, n) for pattern, style in policy.tp_plan.items() if style == Style.VOCAB_EMBEDDING
             for n in match_modules(base, pattern)}
    return all(owner in split for owner in owners)


def _check_coverage(policy: ModelPolicy, model: nn.Module, base: nn.Module, prefix: str, rules: dict[str, Style]) -> None:
    """Every Linear inside a block has a rule; under transformers' convention an unnamed one stays whole."""
    if policy.layers is None:
        return
    blocks = match_modules(base, f"{policy.layers}.*")
    if not blocks:
        raise ValueError(f"policy {policy.model_type}: layers {policy.layers!r} has no blocks")
    if policy.transformers_plan:
        return
    wrapped = tuple(name + "." for name, style in rules.items()
                    if style not in PARAM_STYLES and is_lora_layer(model.get_submodule(name)))
    # a wrapped parameter's factors follow its rule (lora.py)
    wrapped += tuple(name + "." for name, module in model.named_modules() if is_param_wrapper(module))
    for block in blocks:
        for sub, module in base.get_submodule(block).named_modules():
            full = join(prefix, f"{block}.{sub}" if sub else block)
            if full.startswith(wrapped):  # the leaves of a LoRA layer follow its rule (lora.py)
                continue
            if is_projection(module) and full not in rules:
                raise ValueError(
                    f"policy {policy.model_type}: {full} ({type(module).__name__}) inside a sharded block has no rule; "
                    f"add it to tp_plan (use 'replicate' to keep it whole)"
                )


def _has_path(obj: object, path: list[str]) -> bool:
    for attr in path:
        if not hasattr(obj, attr):
            return False
        obj = getattr(obj, attr)
    return True


def _resolve_patches(policy: ModelPolicy, base: nn.Module, prefix: str, layout: HeadLayout) -> list[tuple[str, str, int]]:
    """(module, attribute path, value) for every patch; the module part is the longest prefix of the
    key that names modules, the rest an attribute path that must exist on each of them."""
    patches: list[tuple[str, str, int]] = []
    for target, value in policy.attr_patches.items():
        parts = target.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            names = match_modules(base, ".".join(parts[:cut]))
            if names:
                path = parts[cut:]
                break
        else:
            raise ValueError(f"policy {policy.model_type}: patch {target!r} matches no module")
        for name in names:
            module = base.get_submodule(name)
            if not _has_path(module, path):
                if policy.transformers_plan:
                    continue  # a layer of another kind (MiniMax's linear attention) reads no such value
                raise ValueError(f"policy {policy.model_type}: {join(prefix, name)} has no attribute "
                                 f"{'.'.join(path)!r} to patch")
            patches.append((join(prefix, name), ".".join(path), attention_layout(module, layout).value(value)))
    return patches


def _grad_sum_params(model: nn.Module, rules: dict[str, Style]) -> tuple[str, ...]:
    """The parameters a ``replicate_grad_sum`` rule names: itself, or every parameter of its module."""
    params = dict(model.named_parameters())
    names: list[str] = []
    for name, style in rules.items():
        if style == Style.REPLICATE_GRAD_SUM or style in WHOLE_SUMMED_LINEAR:
            names += [name] if name in params else [join(name, p) for p, _ in model.get_submodule(name).named_parameters()]
    return tuple(names)


# the layout of a model without attention heads qn_hf can read, at tp=1 (nothing splits heads there)
NO_HEADS = HeadLayout(heads=1, kv_heads=1, head_dim=1, tp=1)


def _has_heads(config) -> bool:
    """Whether ``config`` counts attention heads (every layer's an int) and their width."""
    heads = layer_values(config, "num_attention_heads")
    widths = layer_values(config, "head_dim") if any(layer_values(config, "head_dim")) else \
        (getattr(config, "hidden_size", None),)
    return all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (*heads, *widths))


def build_tp_plan(model: nn.Module, policy: ModelPolicy, *, tp: int, sequence_parallel: bool = False) -> TpPlan:
    """Resolve ``policy`` on ``model``; raise ``ValueError`` for anything that does not fit.

    At tp=1 nothing is sharded, so no style is checked or applied: data and pipeline parallelism
    never depend on what tensor parallelism would need."""
    config = model.config
    if config.model_type != policy.model_type:
        raise ValueError(f"policy for {policy.model_type!r} given a {config.model_type!r} model")
    if tp > 1 and policy.tp_refusal:
        raise ValueError(f"tp={tp}: {policy.tp_refusal}; use tp=1 (data and pipeline parallelism still apply)")
    if tp > 1 and policy.tp_divides is not None and policy.tp_divides[0] % tp:
        count, why = policy.tp_divides
        raise ValueError(f"tp={tp} does not divide {count} for {policy.model_type}: {why}; use a tp among "
                         f"{divisors(count)}")
    # at tp=1 nothing splits heads: a model without attention heads (a state-space or convolution
    # model) has one nominal head then
    layout = (head_layout(config, tp=tp, num_kv_heads_key=policy.num_kv_heads_key) if tp > 1 or _has_heads(config)
              else NO_HEADS)
    base, prefix = base_model_and_prefix(model)
    head = task_head(model)

    rules = _resolve_rules(model, policy, base, prefix, head)
    _check_coverage(policy, model, base, prefix, rules)
    patches = _resolve_patches(policy, base, prefix, layout)
    lora = LoraLeaves(rules=rules, entries=[], shared_dropout=[], local_dropout=[])
    if tp > 1:
        rules = split_kv_per_module(model, rules, layout)
        check_ties(model, rules)
        check_split_norms(model, rules)
        check_head_tables(model, rules, layout, head_inputs=bool(policy.head_inputs))
        lora = lora_rules(model, rules, tp=tp)
        rules = lora.rules
        for name, style in rules.items():
            check_rule(model, name, style, layout, tp)

    def regions(patterns: tuple[str, ...], what: str) -> tuple[str, ...]:
        found: list[str] = []
        for pattern in patterns:
            names = match_modules(base, pattern)
            if not names and not policy.transformers_plan:  # optional modules, as in its rules
                raise ValueError(f"policy {policy.model_type}: {what} {pattern!r} matches no module")
            found += [join(prefix, n) for n in names]
        return tuple(found)

    head_inputs = tuple((join(prefix, name), tuple(inputs.items())) for pattern, inputs in policy.head_inputs.items()
                        for name in match_modules(base, pattern))
    entries = regions(policy.tp_entries, "tp entry")
    entries += tuple(n for n in lora.entries if not any(n.startswith(e + ".") for e in entries))
    for entry in entries:
        inside = [n for n, style in rules.items() if n.startswith(entry + ".") and style in COLUMN_STYLES]
        if not inside:
            raise ValueError(f"policy {policy.model_type}: tp entry {entry} holds no column-parallel layer")
    sharding = tp > 1
    mla = any(style == Style.MLA_KV_A for style in rules.values())
    return TpPlan(
        policy=policy,
        tp=tp,
        layout=layout,
        rules=tuple(rules.items()) if sharding else (),
        patches=tuple(patches) if sharding else (),
        grad_sum=_grad_sum_params(model, rules) if sharding else (),
        tp_entries=entries if sharding else (),
        tp_rng_regions=regions(policy.tp_rng_regions, "rng region") + tuple(lora.local_dropout),
        shared_rng_regions=regions(policy.shared_rng_regions, "rng region") + tuple(lora.shared_dropout),
        whole_input_rng_regions=tuple(lora.shared_dropout),
        head=head,
        positions=learned_positions(model),
        base_prefix=prefix,
        mla_rope_dim=config.get_text_config().qk_rope_head_dim if mla and sharding else None,
        head_inputs=head_inputs if sharding else (),
    )
