"""Choosing a policy for a model: our own per-architecture files first, then transformers' plan.

Many architectures (Mistral, Qwen2, ...) ship a ``base_model_tp_plan`` in their config: pure data
with ``colwise``/``rowwise`` styles. We translate it into a ``ModelPolicy``; the translation adds
what that plan leaves out (the vocabulary-parallel embedding and head, KV-head replication, the
attribute that ``repeat_kv`` reads) from the model's own structure.
"""

from __future__ import annotations

from torch import nn

from .plan import ModelPolicy, base_model_and_prefix, head_layout, match_modules

# transformers' styles that map onto ours; "packed_colwise" is a fused gate|up projection.
_HF_STYLES = {"colwise": "colwise", "rowwise": "rowwise", "packed_colwise": "colwise_packed2",
              "replicated_with_grad_allreduce": "replicate"}


def builtin_policies() -> dict[str, ModelPolicy]:
    from model_policies import POLICIES  # imported late: policy files import qn_hf.plan

    return dict(POLICIES)


def resolve_policy(model: nn.Module, policy: ModelPolicy | None) -> ModelPolicy:
    """The given policy, else ours for ``config.model_type``, else one derived from transformers' plan."""
    if policy is not None:
        return policy
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    builtin = builtin_policies()
    if model_type in builtin:
        return builtin[model_type]
    derived = derive_policy(model)
    if derived is not None:
        return derived
    raise ValueError(
        f"unsupported architecture model_type={model_type!r} ({type(model).__name__}): qn_hf has policies for "
        f"{sorted(builtin)} and derives one for any model whose config declares base_model_tp_plan "
        f"(e.g. mistral, qwen2); pass policy=ModelPolicy(...) to parallelize it"
    )


def _relative_name(root: nn.Module, module: nn.Module) -> str | None:
    for name, candidate in root.named_modules():
        if candidate is module and name:
            return name
    return None


def derive_policy(model: nn.Module) -> ModelPolicy | None:
    """A policy from ``config.base_model_tp_plan`` and ``base_model_pp_plan``, or None without them."""
    config = model.config
    hf_plan = getattr(config, "base_model_tp_plan", None) or {}
    pp_plan = getattr(config, "base_model_pp_plan", None) or {}
    if not hf_plan:
        return None
    base, _ = base_model_and_prefix(model)
    unknown = sorted({s for s in hf_plan.values() if s not in _HF_STYLES})
    if unknown:
        raise ValueError(
            f"model_type={config.model_type!r}: its base_model_tp_plan uses styles {unknown} that qn_hf does not "
            f"support (supported: {sorted(_HF_STYLES)}); pass policy=ModelPolicy(...)"
        )
    layers = next((n for n in pp_plan if isinstance(getattr(base, n, None), nn.ModuleList)), None)
    if layers is None:
        raise ValueError(f"model_type={config.model_type!r}: no base_model_pp_plan entry names the list of blocks")

    kv_key = "num_key_value_heads" if getattr(config, "num_key_value_heads", None) else None
    layout = head_layout(config, tp=1, num_kv_heads_key=kv_key)
    kv_width = layout.kv_heads * layout.head_dim
    tp_plan: dict[str, str] = {}
    rowwise_parents: set[str] = set()
    for pattern, hf_style in hf_plan.items():
        style = _HF_STYLES[hf_style]
        names = match_modules(base, pattern)
        first = base.get_submodule(names[0]) if names else None
        # transformers shards k/v like q; ours must know they hold KV heads to replicate them.
        if style == "colwise" and isinstance(first, nn.Linear) and layout.kv_heads < layout.heads and first.out_features == kv_width:
            style = "colwise_kv"
        if style == "rowwise":
            rowwise_parents.add(pattern.rpartition(".")[0])
        tp_plan[pattern] = style

    embeddings = _relative_name(base, model.get_input_embeddings())
    if embeddings is not None and isinstance(model.get_input_embeddings(), nn.Embedding):
        tp_plan.setdefault(embeddings, "vocab_embedding")
    head_plan: dict[str, str] = {}
    loss = None
    output = model.get_output_embeddings() if base is not model else None
    if isinstance(output, nn.Linear) and output.out_features == config.vocab_size:
        head_plan[_relative_name(model, output)] = "vocab_colwise"
        loss = "causal_lm"

    # Pipeline cut points from transformers' pp plan: the entry is the input embedding; whatever
    # comes after the blocks (the final norm) is last-stage only.
    order = list(pp_plan)
    after_layers = [n for n in order[order.index(layers) + 1 :] if isinstance(getattr(base, n, None), nn.Module)]

    attention = [p for p in rowwise_parents if any(hasattr(base.get_submodule(n), "num_key_value_groups")
                                                    for n in match_modules(base, p))]
    return ModelPolicy(
        model_type=config.model_type,
        layers=layers,
        tp_plan=tp_plan,
        head_plan=head_plan,
        attr_patches={f"{p}.num_key_value_groups": "local_kv_groups" for p in attention},
        tp_rng_regions=tuple(sorted(rowwise_parents)),
        loss=loss,
        forward_kwargs={"use_cache": False},
        num_kv_heads_key=kv_key,
        pp_entry=embeddings,
        pp_last={n: "identity" for n in after_layers},
    )
