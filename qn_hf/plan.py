"""Policies (data) and their resolution against a concrete model (validation, no communication).

A ``ModelPolicy`` names Hugging Face modules with wildcard patterns (``h.*.attn.c_attn``; ``*`` is
one path component) and says how each is parallelized. ``build_tp_plan`` matches it against a model
and checks everything that could otherwise fail later, inside a collective: every rule matches,
every Linear inside a block has a rule, every patched attribute exists, and every sharded size
divides by tp. It only reads the model, so it runs on every rank before any process group exists.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from torch import nn
from transformers.pytorch_utils import Conv1D

# Styles a rule can name. ``colwise_kv`` is colwise over key/value heads, replicated across
# consecutive tp ranks when tp exceeds the number of KV heads; ``colwise_packedN`` splits each of
# N fused outputs (GPT-2's q|k|v) separately; ``vocab_*`` pad the vocabulary to a multiple of tp.
STYLES = (
    "colwise",
    "colwise_kv",
    "colwise_packed2",
    "colwise_packed3",
    "rowwise",
    "vocab_embedding",
    "vocab_colwise",
    "replicate",
)
# Values an attribute patch can take, computed from the head layout at the current tp.


def packed_parts(style: str) -> int:
    """Number of fused outputs a column style splits separately (``colwise_packed3`` -> 3)."""
    return int(style.removeprefix("colwise_packed")) if style.startswith("colwise_packed") else 1


LAYOUT_VALUES = ("local_heads", "local_kv_heads", "local_kv_groups", "local_q_width")
LOSSES = ("causal_lm", "classification")
STANDINS = ("zeros", "identity")


@dataclass(frozen=True)
class ModelPolicy:
    """How to parallelize one architecture. Patterns in ``tp_plan``, ``layers``, ``attr_patches`` and
    the rng regions are relative to the base model (``model.base_model``); ``head_plan`` patterns
    are relative to the task model and apply only when it has that head.

    ``tp_entries`` names modules (attention, MLP) whose first forward argument feeds only their
    column-parallel layers: the tensor enters the tp region once there, so the input gradient of
    q, k and v takes one all-reduce instead of three. Column layers outside entries enter alone.

    Pipeline stages run the base model's own forward over their blocks. ``pp_entry`` is the module
    that makes the first hidden state (the token or patch embedding): on later stages it is
    replaced by a stand-in that returns the activation received from the previous stage, keeping
    the attributes in ``pp_entry_reads`` that the forward reads from it. ``pp_first`` and
    ``pp_last`` name the other modules that belong to the first or last stage only, with the stand-in
    they get elsewhere: ``"zeros"`` (GPT-2's position embedding, added to the received activation)
    or ``"identity"`` (dropout after the embedding, the final norm).
    """

    model_type: str
    layers: str
    tp_plan: Mapping[str, str]
    head_plan: Mapping[str, str] = field(default_factory=dict)
    attr_patches: Mapping[str, str] = field(default_factory=dict)
    tp_entries: tuple[str, ...] = ()
    tp_rng_regions: tuple[str, ...] = ()
    shared_rng_regions: tuple[str, ...] = ()
    loss: str | None = None
    forward_kwargs: Mapping[str, object] = field(default_factory=dict)
    num_kv_heads_key: str | None = None
    pp_entry: str | None = None
    pp_entry_reads: tuple[str, ...] = ()
    pp_first: Mapping[str, str] = field(default_factory=dict)
    pp_last: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for pattern, style in {**self.tp_plan, **self.head_plan}.items():
            if style not in STYLES:
                raise ValueError(f"policy {self.model_type}: rule {pattern!r} has unknown style {style!r}; known: {STYLES}")
        for pattern, value in self.attr_patches.items():
            if value not in LAYOUT_VALUES:
                raise ValueError(f"policy {self.model_type}: patch {pattern!r} has unknown value {value!r}; known: {LAYOUT_VALUES}")
        for name, standin in {**self.pp_first, **self.pp_last}.items():
            if standin not in STANDINS:
                raise ValueError(f"policy {self.model_type}: stage stand-in {standin!r} for {name!r} is unknown; known: {STANDINS}")
        if self.loss is not None and self.loss not in LOSSES:
            raise ValueError(f"policy {self.model_type}: unknown loss {self.loss!r}; known: {LOSSES}")


@dataclass(frozen=True)
class HeadLayout:
    """Attention heads at a tensor-parallel degree; validates that they split (or replicate) evenly."""

    heads: int
    kv_heads: int
    head_dim: int
    tp: int

    def __post_init__(self) -> None:
        if self.heads % self.tp:
            raise ValueError(
                f"tp={self.tp} does not divide num_attention_heads={self.heads}; "
                f"use a tp among {divisors(self.heads)}"
            )
        if self.heads % self.kv_heads:
            raise ValueError(f"num_key_value_heads={self.kv_heads} does not divide num_attention_heads={self.heads}")
        if self.tp <= self.kv_heads and self.kv_heads % self.tp:
            raise ValueError(
                f"tp={self.tp} does not divide num_key_value_heads={self.kv_heads}; use a tp that divides "
                f"{self.kv_heads} or a multiple of it (KV heads are then replicated)"
            )
        if self.tp > self.kv_heads and self.tp % self.kv_heads:
            raise ValueError(
                f"tp={self.tp} exceeds num_key_value_heads={self.kv_heads} but is not a multiple of it, so KV "
                f"heads cannot be replicated evenly; use a tp among {divisors(self.heads)} that divides or is a "
                f"multiple of {self.kv_heads}"
            )

    @property
    def kv_replicas(self) -> int:
        return max(1, self.tp // self.kv_heads)

    def value(self, name: str) -> int:
        local_heads = self.heads // self.tp
        local_kv = max(1, self.kv_heads // self.tp)
        return {
            "local_heads": local_heads,
            "local_kv_heads": local_kv,
            "local_kv_groups": local_heads // local_kv,
            "local_q_width": local_heads * self.head_dim,
        }[name]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class TpPlan:
    """A policy resolved against one model at one tp: concrete module names, no patterns."""

    policy: ModelPolicy
    tp: int
    layout: HeadLayout
    rules: tuple[tuple[str, str], ...]  # (module name from the top model, style)
    patches: tuple[tuple[str, str, int], ...]  # (module name, attribute, new value)
    tp_entries: tuple[str, ...]
    tp_rng_regions: tuple[str, ...]
    shared_rng_regions: tuple[str, ...]
    loss: str | None  # the built-in loss, None for a base model without a head
    base_prefix: str

    def only(self, keep: Callable[[str], bool]) -> TpPlan:
        """The plan restricted to the modules ``keep`` accepts (those of this pipeline stage)."""
        return replace(
            self,
            rules=tuple(r for r in self.rules if keep(r[0])),
            patches=tuple(p for p in self.patches if keep(p[0])),
            tp_entries=tuple(n for n in self.tp_entries if keep(n)),
            tp_rng_regions=tuple(n for n in self.tp_rng_regions if keep(n)),
            shared_rng_regions=tuple(n for n in self.shared_rng_regions if keep(n)),
        )


def pattern_regex(pattern: str) -> re.Pattern[str]:
    parts = [r"[^.]+" if p == "*" else re.escape(p) for p in pattern.split(".")]
    return re.compile(r"\.".join(parts) + r"\Z")


def match_modules(root: nn.Module, pattern: str) -> list[str]:
    """Names of the modules under ``root`` that ``pattern`` matches (``*`` = one name component)."""
    regex = pattern_regex(pattern)
    return [name for name, _ in root.named_modules() if name and regex.match(name)]


def base_model_and_prefix(model: nn.Module) -> tuple[nn.Module, str]:
    """HF's base model and its attribute path in ``model`` ('' when ``model`` is the base model)."""
    base = getattr(model, "base_model", model)
    if base is model:
        return model, ""
    for name, module in model.named_modules():
        if module is base:
            return base, name
    raise ValueError(f"{type(model).__name__}.base_model is not one of its submodules")


def head_layout(config, *, tp: int, num_kv_heads_key: str | None) -> HeadLayout:
    heads = config.num_attention_heads
    kv_heads = getattr(config, num_kv_heads_key, None) if num_kv_heads_key else None
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return HeadLayout(heads=heads, kv_heads=kv_heads or heads, head_dim=head_dim, tp=tp)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _is_projection(module: nn.Module) -> bool:
    return isinstance(module, (nn.Linear, Conv1D))


def _check_rule(model: nn.Module, name: str, style: str, layout: HeadLayout, tp: int) -> None:
    module = model.get_submodule(name)
    if style == "replicate":
        return
    if style == "vocab_embedding":
        if not isinstance(module, nn.Embedding):
            raise ValueError(f"rule {style!r} on {name}: expected nn.Embedding, got {type(module).__name__}")
        return
    if not _is_projection(module):
        raise ValueError(f"rule {style!r} on {name}: expected nn.Linear or Conv1D, got {type(module).__name__}")
    if isinstance(module, Conv1D):
        in_f, out_f = module.nx, module.nf
    else:
        in_f, out_f = module.in_features, module.out_features
    if style == "rowwise":
        if in_f % tp:
            raise ValueError(f"tp={tp} does not divide in_features={in_f} of {name}")
    elif style == "colwise_kv":
        if out_f != layout.kv_heads * layout.head_dim:
            raise ValueError(
                f"{name} has {out_f} outputs, not num_key_value_heads*head_dim = {layout.kv_heads}*{layout.head_dim}"
            )
    elif style.startswith("colwise"):
        parts = packed_parts(style)
        if out_f % (parts * tp):
            raise ValueError(f"tp={tp} does not divide the {parts} output part(s) of {name} (out_features={out_f})")


def build_tp_plan(model: nn.Module, policy: ModelPolicy, *, tp: int) -> TpPlan:
    """Resolve ``policy`` on ``model``; raise ``ValueError`` for anything that does not fit."""
    config = model.config
    if config.model_type != policy.model_type:
        raise ValueError(f"policy for {policy.model_type!r} given a {config.model_type!r} model")
    layout = head_layout(config, tp=tp, num_kv_heads_key=policy.num_kv_heads_key)
    base, prefix = base_model_and_prefix(model)
    has_head = base is not model

    rules: dict[str, str] = {}
    for scope, plan, root_prefix in ((base, policy.tp_plan, prefix), (model, policy.head_plan if has_head else {}, "")):
        for pattern, style in plan.items():
            names = match_modules(scope, pattern)
            if not names:
                raise ValueError(f"policy {policy.model_type}: rule {pattern!r} matches no module of {type(scope).__name__}")
            for name in names:
                rules[_join(root_prefix, name)] = style
    for name, style in rules.items():
        _check_rule(model, name, style, layout, tp)

    blocks = match_modules(base, f"{policy.layers}.*")
    if not blocks:
        raise ValueError(f"policy {policy.model_type}: layers {policy.layers!r} has no blocks")
    for block in blocks:
        for sub, module in base.get_submodule(block).named_modules():
            full = _join(prefix, f"{block}.{sub}" if sub else block)
            if _is_projection(module) and full not in rules:
                raise ValueError(
                    f"policy {policy.model_type}: {full} ({type(module).__name__}) inside a sharded block has no rule; "
                    f"add it to tp_plan (use 'replicate' to keep it whole)"
                )

    patches: list[tuple[str, str, int]] = []
    for target, value in policy.attr_patches.items():
        pattern, _, attr = target.rpartition(".")
        names = match_modules(base, pattern)
        if not names:
            raise ValueError(f"policy {policy.model_type}: patch {target!r} matches no module")
        for name in names:
            if not hasattr(base.get_submodule(name), attr):
                raise ValueError(f"policy {policy.model_type}: {_join(prefix, name)} has no attribute {attr!r} to patch")
            patches.append((_join(prefix, name), attr, layout.value(value)))

    def regions(patterns: tuple[str, ...], what: str) -> tuple[str, ...]:
        found: list[str] = []
        for pattern in patterns:
            names = match_modules(base, pattern)
            if not names:
                raise ValueError(f"policy {policy.model_type}: {what} {pattern!r} matches no module")
            found += [_join(prefix, n) for n in names]
        return tuple(found)

    entries = regions(policy.tp_entries, "tp entry")
    for entry in entries:
        inside = [n for n, style in rules.items() if n.startswith(entry + ".") and style.startswith("colwise")]
        if not inside:
            raise ValueError(f"policy {policy.model_type}: tp entry {entry} holds no column-parallel layer")

    return TpPlan(
        policy=policy,
        tp=tp,
        layout=layout,
        rules=tuple(rules.items()),
        patches=tuple(patches),
        tp_entries=entries,
        tp_rng_regions=regions(policy.tp_rng_regions, "rng region"),
        shared_rng_regions=regions(policy.shared_rng_regions, "rng region"),
        loss=policy.loss if has_head else None,
        base_prefix=prefix,
    )
