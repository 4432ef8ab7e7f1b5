"""A policy derived from transformers' own plans (``base_model_tp_plan``, ``base_model_pp_plan``).

Many architectures (Mistral, Qwen2, ...) ship a ``base_model_tp_plan`` in their config: pure data
with ``colwise``/``rowwise`` styles. We translate it into a ``ModelPolicy``; the translation adds
what that plan leaves out (the vocabulary-parallel embedding and head, KV-head replication, the
attribute that ``repeat_kv`` reads) from the model's own structure.
"""

from __future__ import annotations

import ast

from torch import nn

from ..compat import per_layer
from .amendments import AMENDMENTS, CARRIED_REUSED_BY, KV_SHARED_BY, PP_PLANS, REFUSALS, TP_DIVIDES
from .embedding_types import adapter_for
from .entries import derive_entries, forward_tree, self_path, self_references
from .every_stage import every_stage_children, per_block_outputs
from .heads import head_layout
from .layer_fields import any_layer
from .model_policy import ModelPolicy, StandIn
from .module_kinds import position_wise
from .patterns import base_model_and_prefix, match_modules, match_parameters, submodule_or_none
from .peft_names import names_before_peft
from .styles import COLUMN_STYLES, HF_STYLES, PARAM_FORM, Style


def relative_name(root: nn.Module, module: nn.Module) -> str | None:
    for name, candidate in root.named_modules():
        if candidate is module and name:
            return name
    return None


# the config keys architectures count their KV heads under (Falcon's own name), in the order asked
KV_KEYS = ("num_key_value_heads", "num_kv_heads")


def kv_key(config) -> str | None:
    """The config key counting KV heads, where some layer has them."""
    return next((key for key in KV_KEYS if any_layer(config, key)), None)


def _translate(base: nn.Module, config, hf_plan: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """transformers' plan in our styles, and what cannot be translated (refused at tp > 1)."""
    layout = head_layout(config, tp=1, num_kv_heads_key=kv_key(config))
    kv_width = layout.kv_heads * layout.head_dim
    tp_plan: dict[str, Style] = {}
    problems: list[str] = []
    rename = names_before_peft(base)  # a parameter peft wrapped (target_parameters) keeps its name for the plan
    for pattern, hf_style in hf_plan.items():
        if hf_style not in HF_STYLES:
            problems.append(f"style {hf_style!r} ({pattern})")
            continue
        style = HF_STYLES[hf_style]
        if style is None:
            continue
        # transformers' forwards chunk a fused gate|up projection into halves, so each half is split
        # on its own (a plain colwise split would give rank 0 both halves of the gate).
        if style == Style.COLWISE and pattern.endswith("gate_up_proj"):
            style = Style.COLWISE_PACKED2
        modules = match_modules(base, pattern)
        if not modules and match_parameters(base, pattern, rename=rename):  # the rule names a bare parameter
            if style not in PARAM_FORM:
                problems.append(f"style {hf_style!r} on the parameter {pattern}")
                continue
            style = PARAM_FORM[style]
        first = base.get_submodule(modules[0]) if modules else None
        # transformers shards k/v like q; ours must know they hold KV heads to replicate them.
        if style == Style.COLWISE and isinstance(first, nn.Linear) and layout.kv_heads < layout.heads and first.out_features == kv_width:
            style = Style.COLWISE_KV
        tp_plan[pattern] = style
    return tp_plan, problems


def derived_pp_cut(base: nn.Module, *, layers: str, embeddings: str | None) -> tuple[list[str], tuple[str, ...]]:
    """What a pp plan would list for a base model transformers gives none (the embedding, the blocks,
    the final norm), and what the base forward reads off the embedding besides calling it (a
    weight's device: ``pp_entry_reads``), or ([], ()) where the model does not say it plainly.

    Plain means, read from the base forward's source and its children: the input embedding is a
    child; every child registered after the blocks is a norm over the features that the forward
    uses only after its last mention of the blocks (the final norm: last stage only), or a
    parameter-free rotary embedding (it builds the position tables every stage's blocks need).
    A parameter-free norm that also runs before the blocks (NanoChat's) is left unplaced, real on
    every stage: the stages then receive at their blocks (``blocks_take_entry_output`` sees the
    norm on the blocks' input). With parameters it is refused, as is anything whose place the
    source does not tell."""
    children = [name for name, _ in base.named_children()]
    tree = forward_tree(base)
    if tree is None or embeddings is None or embeddings not in children or layers not in children:
        return [], ()
    uses = self_references(tree)
    if not uses.get(layers):
        return [], ()
    last_block_use = max(line for line, _ in uses[layers])
    after = []
    for name in children[children.index(layers) + 1 :]:
        module = getattr(base, name)
        if position_wise(module) and not isinstance(module, (nn.Dropout, nn.Identity)):
            if not uses.get(name):
                return [], ()
            if min(line for line, _ in uses[name]) <= last_block_use:
                if list(module.parameters()):
                    return [], ()
                continue  # NanoChat's norm, also before the blocks: no parameters, real on every stage
            after.append(name)
        elif list(module.parameters()) or not all(type(m).__name__.endswith("RotaryEmbedding")
                                                  for m in module.modules() if not isinstance(m, (nn.ModuleDict, nn.ModuleList))):
            return [], ()  # rotary embeddings, or a list of them per layer kind (GraniteMoE-SWA): every stage
    reads = set()
    for _, rest in uses.get(embeddings, []):
        holder, kept = getattr(base, embeddings), []
        for attr in rest.split(".") if rest else []:
            kept.append(attr)
            holder = getattr(holder, attr, None)
            if not isinstance(holder, nn.Module):
                break  # a tensor or a plain value: the stand-in mirrors it
        if kept and not isinstance(holder, nn.Module) and not callable(holder):
            reads.add(".".join(kept))
    return [embeddings, layers, *after], tuple(sorted(reads))


def block_call(tree: ast.FunctionDef, layers: str) -> tuple[ast.For, ast.Call] | None:
    """The base forward's one loop over ``self.<layers>`` and its one call of a block, or None."""
    loops = [n for n in ast.walk(tree) if isinstance(n, ast.For)
             and any(self_path(a) == layers for a in ast.walk(n.iter) if isinstance(a, ast.Attribute))]
    if len(loops) != 1:
        return None
    blocks = {n.id for n in ast.walk(loops[0].target) if isinstance(n, ast.Name)}
    calls = [n for n in ast.walk(loops[0]) if isinstance(n, ast.Call) and _called_name(n) in blocks]
    return (loops[0], calls[0]) if len(calls) == 1 else None


def _called_name(call: ast.Call) -> str | None:
    """The name ``call`` runs: ``layer(...)``, or ``layer.forward(...)``."""
    func = call.func.value if called_past_hooks(call) else call.func
    return func.id if isinstance(func, ast.Name) else None


def called_past_hooks(call: ast.Call) -> bool:
    """Whether ``call`` runs a module's ``forward`` itself (SqueezeBERT's ``layer.forward(...)``), past
    ``__call__`` and every hook on the module."""
    return (isinstance(call.func, ast.Attribute) and call.func.attr == "forward"
            and isinstance(call.func.value, ast.Name))


def carried_between_blocks(base: nn.Module, *, layers: str) -> list[str]:
    """What a block hands the next one besides the hidden states, read from the base forward:
    ``hidden_states, topk = layer(..., prev_topk=topk)`` (HY-V4's shared top-k indices). A pipeline
    sends the hidden states only, so a stage's first block would miss it."""
    tree = forward_tree(base)
    found = block_call(tree, layers) if tree is not None else None
    if found is None:
        return []
    loop, call = found
    results = [n for n in ast.walk(loop) if isinstance(n, ast.Assign) and n.value is call
               and isinstance(n.targets[0], ast.Tuple)]
    names = {e.id for r in results for e in r.targets[0].elts[1:] if isinstance(e, ast.Name)}
    # and the names the loop copies them into (T5: position_bias = self_attention_position_bias)
    copies = [(t.id, n.value.id) for n in ast.walk(loop) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Name)
              for t in n.targets if isinstance(t, ast.Name)]
    grown = True
    while grown:
        grown = False
        for target, source in copies:
            if source in names and target not in names:
                names.add(target)
                grown = True
    read = {n.id for n in ast.walk(call) if isinstance(n, ast.Name)}
    return sorted(names & read)


def loop_indexed(base: nn.Module, *, layers: str) -> list[str]:
    """The local names the base forward's loop over the blocks subscripts by the loop's position
    (``per_layer_inputs[:, :, i, :]``); a stage's loop counts from 0 over its own blocks."""
    tree = forward_tree(base)
    found = block_call(tree, layers) if tree is not None else None
    if found is None:
        return []
    loop = found[0]
    target = loop.target.elts[0] if isinstance(loop.target, ast.Tuple) and loop.target.elts else None
    if not (isinstance(loop.iter, ast.Call) and isinstance(loop.iter.func, ast.Name) and loop.iter.func.id == "enumerate"
            and isinstance(target, ast.Name)):
        return []
    # an argument the forward never assigns (a multimodal wrapper's deepstack_visual_embeds) comes from
    # the caller, who passes none in text training: only what the forward computes is counted
    assigned = {t.id for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(t, ast.Name)}
    assigned |= {e.id for node in ast.walk(tree) if isinstance(node, ast.Assign) for t in node.targets
                 if isinstance(t, ast.Tuple) for e in t.elts if isinstance(e, ast.Name)}
    arguments = {a.arg for a in [*tree.args.args, *tree.args.kwonlyargs]} - assigned
    names = set()
    for node in ast.walk(loop):
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id != "self":
            parts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            if any(isinstance(p, ast.Name) and p.id == target.id for p in parts) and node.value.id not in arguments:
                names.add(node.value.id)
    return sorted(names)


def blocks_take_entry_output(base: nn.Module, *, layers: str, entries: set[str]) -> bool | None:
    """Whether the blocks' first argument is the entry's output as it is, read from the base forward:
    every assignment to the name the block call passes, and to the names it was copied from, is
    a call of an entry (the embedding, or what extends it) or a plain copy (``hidden_states = inputs_embeds``). False: the forward turns
    the embedding into the blocks' input first (DeepSeek-V4 expands it into hyper-connection
    streams, NanoChat normalizes it), so later stages must receive at the blocks. None: the source
    does not say (no loop over the blocks, a block input that is not a name)."""
    tree = forward_tree(base)
    found = block_call(tree, layers) if tree is not None else None
    if found is None or not found[1].args or not isinstance(found[1].args[0], ast.Name):
        return None
    loop, call = found
    assigned: dict[str, list[ast.expr]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and node.lineno < loop.lineno:
            for target in node.targets:
                if isinstance(target, ast.Name):
                    assigned.setdefault(target.id, []).append(node.value)
    seen, todo = set(), [call.args[0].id]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for value in assigned.get(name, []):
            if isinstance(value, ast.Call) and self_path(value.func) in entries:
                continue
            if not isinstance(value, ast.Name):
                return False
            todo.append(value.id)
    return True


def after_blocks(base: nn.Module, *, layers: str, placed: set[str]) -> list[str]:
    """Children with parameters the pp plan does not place that the base forward uses only after its
    last mention of the blocks (DeepSeek-V4's and HY-V4's hyper-connection head): last stage."""
    tree = forward_tree(base)
    uses = self_references(tree) if tree is not None else {}
    if not uses.get(layers):
        return []
    last_block = max(line for line, _ in uses[layers])
    return [name for name, module in base.named_children()
            if name not in placed and any(True for _ in module.parameters()) and uses.get(name)
            and min(line for line, _ in uses[name]) > last_block]


def entry_extension(base: nn.Module, *, layers: str, entry: str, placed: set[str]) -> str | None:
    """A child with parameters that transformers' pp plan does not place and that extends the entry,
    or None: the base forward uses it once, before the blocks, as ``x = self.<it>(..., x, ...)`` on the
    entry's output ``x = self.<entry>(...)`` (Phi-4-multimodal's image and audio embedding). It
    becomes the entry (later stages receive its output) and the entry first-stage only.

    """
    tree = forward_tree(base)
    if tree is None:
        return None
    uses = self_references(tree)
    if not uses.get(layers):
        return None
    first_block = min(line for line, _ in uses[layers])
    calls: dict[str, list[ast.Assign]] = {}  # self.<child>(...) assigned to one name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Call) and (path := self_path(node.value.func)) is not None):
            calls.setdefault(path, []).append(node)
    entry_out = {a.targets[0].id for a in calls.get(entry, [])}
    found = []
    for name, module in base.named_children():
        if name in placed or not any(True for _ in module.parameters()) or len(uses.get(name, [])) != 1:
            continue
        if uses[name][0][0] < first_block and any(
                a.targets[0].id in entry_out and any(isinstance(v, ast.Name) and v.id == a.targets[0].id
                                                     for v in a.value.args)
                for a in calls.get(name, [])):
            found.append(name)
    return found[0] if len(found) == 1 else None


def derive_policy(model: nn.Module) -> ModelPolicy | None:
    """A policy from ``config.base_model_tp_plan`` and ``base_model_pp_plan``, or None without them (or
    where they name no list of blocks in the base model).

    The plan keeps transformers' meaning: a rule may match nothing, and a Linear it does not name
    stays whole. What cannot be translated makes the policy refuse tp > 1, never dp or pp."""
    config = model.config
    hf_plan = getattr(config, "base_model_tp_plan", None) or {}
    pp_plan = getattr(config, "base_model_pp_plan", None) or PP_PLANS.get(config.model_type, {})
    if not hf_plan:
        return None
    # where transformers' plan is incomplete or wrong for this architecture (amendments.py)
    added, refusal = AMENDMENTS.get(config.model_type, {}), REFUSALS.get(config.model_type)
    hf_plan = {**hf_plan, **added}
    base, _ = base_model_and_prefix(model)
    layers = next((n for n in pp_plan if isinstance(getattr(base, n, None), nn.ModuleList)), None)
    if layers is None:  # no pp plan: the first list of blocks the tp plan reaches into (HRM has two)
        layers = next((prefix for p in hf_plan if (prefix := p.partition(".*.")[0]) != p
                       and isinstance(submodule_or_none(base, prefix), nn.ModuleList)), None)
    if layers is None:
        # the plans name modules of another model than this one's base (Llama 4's text plan on its multimodal
        # model, whose blocks sit under language_model): the body is found from the structure (body.py), so
        # data parallelism never waits on a plan that does not fit
        return None
    if not any(p == layers or p.startswith(layers + ".") for p in hf_plan):
        # a plan of the embedding alone (transformers 5.24's for GPT-OSS, Bamba, LFM2, Qwen3-VL's text model...)
        # says nothing of the blocks, where tp does its work: the body found from the structure splits them and the
        # embedding as that plan does (vocabulary-parallel), rather than leaving every block whole
        return None
    tp_plan, problems = _translate(base, config, hf_plan)
    rowwise_parents = {p.rpartition(".")[0] for p, style in tp_plan.items() if style == Style.ROWWISE}
    # a module ending in a row layer on a gathered input (colwise_gather, then rowwise_split) may be an
    # entry too; its activations are whole between the two, so it is no tp-local rng region
    row_parents = rowwise_parents | {p.rpartition(".")[0] for p, style in tp_plan.items() if style == Style.ROWWISE_SPLIT}

    # The embedding is sharded over the vocabulary when qn_hf reproduces its class exactly
    # (qn_hf.policies.embedding_types); anything else stays whole, which is always correct. The head
    # (an LM head over the vocabulary, a classifier) is found from the model, not the policy (task.py).
    embeddings = relative_name(base, model.get_input_embeddings())
    if embeddings is not None and adapter_for(model.get_input_embeddings()) is not None:
        tp_plan.setdefault(embeddings, Style.VOCAB_EMBEDDING)

    # Pipeline cut points from transformers' pp plan: the entry is the input embedding; whatever
    # comes after the blocks (the final norm) is last-stage only. Without a pp plan, from the order
    # the base model registers its children in, where that order says no less (derived_pp_order).
    order, entry_reads = list(pp_plan), ()
    if not order:
        order, entry_reads = derived_pp_cut(base, layers=layers, embeddings=embeddings)
    after_layers = [n for n in order[order.index(layers) + 1 :] if isinstance(getattr(base, n, None), nn.Module)] if layers in order else []
    entry, first, receive_at_blocks = (embeddings if layers in order else None), {}, False
    every_stage, per_block = (), ()
    if entry is not None:
        extension = entry_extension(base, layers=layers, entry=entry, placed=set(order))
        if extension and isinstance(getattr(base, entry), nn.Embedding):  # its stand-in: zeros of its shape
            entry, first = extension, {embeddings: StandIn.ZEROS}
        # what the forward computes before the blocks for every block besides the hidden states
        # (Gemma 4's per-layer embeddings): every stage computes it, from the real entry (every_stage.py)
        shared = every_stage_children(base, layers=layers, placed={*order, entry, *first}) if not first else []
        if shared:
            every_stage, per_block = (entry, *shared), tuple(per_block_outputs(base, candidates=shared))
        # a forward that makes the blocks' input out of the embedding (a multiplier, dropout, streams)
        # would do it again, on a later stage, to what that stage receives
        receive_at_blocks = bool(shared) or blocks_take_entry_output(base, layers=layers,
                                                                     entries={entry, embeddings}) is False
        if receive_at_blocks:  # what follows the blocks then runs on the last stage only (HY-V4's hc_head)
            after_layers += after_blocks(base, layers=layers, placed=set(order))
    carried = carried_between_blocks(base, layers=layers)
    # what the loop indexes by position is the per-block outputs' when there are some (they are rotated)
    indexed = [] if per_block else loop_indexed(base, layers=layers)

    attention = [p for p in rowwise_parents if any(hasattr(base.get_submodule(n), "num_key_value_groups")
                                                    for n in match_modules(base, p))]
    kv_heads_key = kv_key(config)
    return ModelPolicy(
        model_type=config.model_type,
        layers=layers,
        tp_plan=tp_plan,
        attr_patches={f"{p}.num_key_value_groups": "local_kv_groups" for p in attention},
        tp_entries=derive_entries(base, sorted(row_parents),
                                  {p for p, style in tp_plan.items() if style in COLUMN_STYLES}),
        tp_rng_regions=tuple(sorted(rowwise_parents)),
        forward_kwargs={"use_cache": False},
        num_kv_heads_key=kv_heads_key,
        pp_entry=entry,
        pp_entry_reads=entry_reads,
        pp_first=first,
        pp_last={n: StandIn.IDENTITY for n in after_layers},
        pp_receive_at_blocks=receive_at_blocks,
        pp_carried=tuple(carried),
        pp_carried_reuse=next(((k, v) for k, v in CARRIED_REUSED_BY.items() if isinstance(getattr(config, k, None), list)),
                              None) if carried else None,
        pp_every_stage=every_stage,
        pp_per_block_outputs=per_block,
        pp_kv_sharing=next(((k, *v) for k, v in KV_SHARED_BY.items() if per_layer(config, k) is not None), None),
        pp_refusal=(f"its base forward hands each block {', '.join(indexed)}[..., i, ...] by the block's position i in "
                    f"its loop, which on a later stage counts from that stage's first block" if indexed else None),
        transformers_plan=True,
        tp_refusal=(f"transformers' tp plan for {config.model_type!r}: {refusal}" if refusal else
                    f"transformers' tp plan for {config.model_type!r} uses {', '.join(problems)}, which qn_hf does not "
                    f"support" if problems else None),
        tp_divides=TP_DIVIDES.get(config.model_type),
    )
