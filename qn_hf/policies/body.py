"""A policy for any model no other policy describes: its body's list of blocks, found from the module
structure. Data parallelism (dp, ZeRO-1, dp_shard) needs nothing more of a model; the dimensions
that cut or shard layers take what this policy can prove and refuse the rest, each for itself.

The blocks are the repeated layers transformers itself names as the units never to split across
devices (``_no_split_modules``, what accelerate's FSDP wrapping reads), else the largest list of
modules of one class; a model with no such list has none (``layers=None``).
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap

from torch import nn
from torch.nn.utils.parametrize import ParametrizationList
from transformers.pytorch_utils import Conv1D

from .derive import carried_between_blocks, kv_key, relative_name
from .embedding_types import adapter_for
from .entries import derive_entries, forward_source, method_tree, self_path
from .fused import FUSED
from .model_policy import ModelPolicy
from .packed_inputs import item_towers
from .patterns import base_model_and_prefix
from .seq2seq_cut import seq2seq_cut
from .stack_cut import stack_cut
from .stacks import derive_structure, head_bias_tables
from .styles import COLUMN_STYLES, Style


def _size(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def block_lists(root: nn.Module, *, one_class: bool = True) -> list[str]:
    """Every ``nn.ModuleList`` under ``root`` whose members are all one class (or, ``one_class=False``, of
    any classes: a hybrid stack of Mamba and attention layers) and hold parameters, outermost first (a list
    inside another list's block is not listed), largest first among those (a parametrization's list of a
    weight's pieces is none)."""
    found = []
    for name, module in root.named_modules():
        if not name or not isinstance(module, nn.ModuleList) or not len(module) or isinstance(module, ParametrizationList):
            continue
        if (one_class and len({type(m) for m in module}) != 1) or not _size(module):
            continue
        if any(name.startswith(outer + ".") for outer in found):
            continue
        found.append(name)
    return sorted(found, key=lambda n: -_size(root.get_submodule(n)))


def repeated_blocks(model: nn.Module, among: list[nn.Module] | None = None) -> list[nn.Module]:
    """The repeated blocks of every stack of ``model`` (an encoder's and a decoder's, a vision and a
    text tower's): the modules of the classes transformers names in ``_no_split_modules``, outermost
    only, else the members of ``block_lists``; or those of ``among`` (a pipeline stage's own blocks).
    What FSDP2 wraps one by one (data_parallel/sharded.py), so a module sharing a parameter with anything
    outside it (BERT's embeddings, tied to the masked-LM head) is left to the root group, where both are,
    and so is one the code runs past its hooks, where FSDP2 gathers, and one inside a tower run on the items a
    batch packs (``item_towers``: a rank whose rows hold no image never calls it, so its gathers would not pair
    up with another rank's)."""
    found = list(among) if among is not None else _named_blocks(model)
    owners: dict[int, set[int]] = {}  # parameter -> the modules (ids) holding it directly
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), set()).add(id(module))
    embedding = _looked_up_directly(model)
    past_hooks = _called_past_hooks(model)
    in_towers = {id(m) for tower in item_towers(model) for m in tower.modules()}
    blocks = []
    for block in found:
        # SqueezeBERT's encoder runs ``layer.forward(...)``: FSDP2 would never gather; a tower's blocks run as
        # many times as a rank's rows hold kinds of items: their gathers would not pair up across ranks
        if id(block) in past_hooks or id(block) in in_towers:
            continue
        members = {id(m) for m in block.modules()}
        # a block holding the input embedding that a forward looks up directly (ModernVBERT's
        # ``text_model.get_input_embeddings()(input_ids)``), past the block's own forward, where FSDP2 would
        # gather its weights
        inner = embedding is not None and embedding is not block and id(embedding) in members
        if all(owners[id(p)] <= members for p in block.parameters()) and not inner:
            blocks.append(block)
    return blocks


def _named_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules of the classes ``model`` names in ``_no_split_modules`` (holding parameters), outermost
    only, else the members of ``block_lists``."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found: list[nn.Module] = []
    inside: set[int] = set()
    for _, module in model.named_modules():
        if id(module) in inside:
            continue
        if type(module).__name__ in names and any(True for _ in module.parameters()):
            found.append(module)
            inside.update(id(m) for m in module.modules())
    return found or [m for name in block_lists(model) for m in _callable(model.get_submodule(name))]


def _called_past_hooks(model: nn.Module) -> set[int]:
    """The modules (ids) ``model``'s code runs past ``__call__`` and every hook on it, by ``forward`` or by a method
    of their own (``self.<child>.encode(...)``, ``<block>.forward(...)`` in a loop over ``self.<list>``), in any
    method of a module's class: SqueezeBERT's encoder calls ``layer.forward``, Mimi ``self.quantizer.encode``."""
    found: set[int] = set()
    for module in model.modules():
        for path, each, method in _method_calls(type(module)):
            target = _submodule(module, path)
            if target is None:
                continue
            members = list(target) if each and isinstance(target, nn.ModuleList) else [target]
            for member in members:
                if method == "forward" or (not hasattr(nn.Module, method) and _calls_a_child(member, method)):
                    found.add(id(member))
    return found


@functools.cache
def _method_calls(kind: type) -> tuple[tuple[str, bool, str], ...]:
    """The method calls on ``self.<path>`` in any method of the class ``kind``: (path, whether called on each
    member of a list the code loops over, method). Read once a class: a model holds many instances of each."""
    tree = None if kind.__module__.startswith("torch.") else _parsed(kind)
    if tree is None:
        return ()
    looped: dict[str, str] = {}  # loop variable -> the list it walks
    for loop in (n for n in ast.walk(tree) if isinstance(n, ast.For)):
        walked = next((self_path(a) for a in ast.walk(loop.iter) if self_path(a) is not None), None)
        looped.update({t.id: walked for t in ast.walk(loop.target) if isinstance(t, ast.Name) and walked})
    calls = []
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)):
        owner, method = call.func.value, call.func.attr
        each = isinstance(owner, ast.Name)
        path = looped.get(owner.id) if each else self_path(owner)
        if path:
            calls.append((path, each, method))
    return tuple(calls)


def _parsed(kind: type) -> ast.Module | None:
    """The syntax tree of a class's source, or None where it has none to read (read once: ``_method_calls``)."""
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(kind)))
    except (OSError, TypeError, SyntaxError):
        return None


def _calls_a_child(module: nn.Module, method: str, depth: int = 3) -> bool:
    """Whether ``type(module).<method>`` runs a child module of its own, by calling it or a method of it that does
    (Mimi's quantizer's ``encode`` reaches its input projection through its residual quantizers' ``encode``), as
    against one that only sets things up (BigBird's ``set_attention_type``)."""
    tree = method_tree(module, method) if depth > 0 else None
    if tree is None:
        return False
    children = dict(module.named_children())
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
        path = self_path(call.func) or ""
        child, _, inner = path.partition(".")
        if child in children and (not inner or inner == "forward" or (
                "." not in inner and not hasattr(nn.Module, inner) and _calls_a_child(children[child], inner, depth - 1))):
            return True
    return False


def _submodule(module: nn.Module, path: str) -> nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def _looked_up_directly(model: nn.Module) -> nn.Module | None:
    """``model``'s input embedding where a forward of its modules calls it by ``get_input_embeddings()``."""
    if not any("get_input_embeddings()(" in forward_source(kind) for kind in {type(m) for m in model.modules()}):
        return None
    try:
        return model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return None


def _callable(modules: nn.Module) -> list[nn.Module]:
    """The members of a list of blocks that run a forward of their own: a member that is itself a container
    (GLPN keeps a ModuleList of blocks per stage) gives its own members, as FSDP2 wraps only modules it can
    hook a forward on."""
    members = modules.values() if isinstance(modules, nn.ModuleDict) else modules
    return [block for m in members
            for block in (_callable(m) if isinstance(m, (nn.ModuleList, nn.ModuleDict)) else [m])]


def main_blocks(base: nn.Module, model: nn.Module) -> str | None:
    """The base model's list of blocks: of ``block_lists``, the largest whose members are of a class
    ``_no_split_modules`` names, else the largest whose members are modules of modules (a list of tables is
    no stack of blocks: MarkupLM's 50 XPath embeddings outweigh its tiny encoder's layers), else the
    largest; None without any."""
    lists = block_lists(base)
    names = set(getattr(model, "_no_split_modules", None) or ())
    named = [n for n in lists if type(base.get_submodule(n)[0]).__name__ in names]
    composite = [n for n in lists if any(True for _ in base.get_submodule(n)[0].children())]
    return (named or composite or lists or [None])[0]


def body_policy(model: nn.Module) -> ModelPolicy:
    """The policy of a model no other policy describes (module docstring)."""
    config = model.config
    model_type = getattr(config, "model_type", None) or type(model).__name__
    base, _ = base_model_and_prefix(model)
    layers = main_blocks(base, model)
    entry, first, last, reads, pp_refusal, every_stage, loop_count, siblings = None, {}, {}, (), None, (), None, ()
    embeddings = input_embeddings(model)
    name = relative_name(base, embeddings) if isinstance(embeddings, nn.Module) else None
    receive, seq2seq = False, None
    if getattr(config, "is_encoder_decoder", False) and layers is not None:
        seq2seq = seq2seq_cut(model, base, lists=block_lists, embeddings=_embeddings_path,
                              carried=lambda module, found: carried_between_blocks(module, layers=found))
        pp_refusal, seq2seq = (seq2seq, None) if isinstance(seq2seq, str) else (None, seq2seq)
    elif layers is None:
        pp_refusal = "no list of repeated blocks was found in the model to cut into stages"
    else:
        cut = stack_cut(base, layers=layers, embeddings=name)
        if isinstance(cut, str):
            pp_refusal = cut
        else:
            entry, first, last, reads, receive = cut.entry, cut.first, cut.last, cut.entry_reads, cut.receive_at_blocks
            every_stage, loop_count, siblings = cut.every_stage, cut.loop_count, cut.siblings
            layers = cut.blocks or layers
    tp_plan, patches, entries, regions, tp_refusal, head_inputs = _tensor_parallel(model, base, name)
    return ModelPolicy(
        model_type=model_type,
        layers=layers,
        tp_plan=tp_plan,
        attr_patches=patches,
        tp_entries=entries,
        tp_rng_regions=regions,
        num_kv_heads_key=kv_key(config.get_text_config() if hasattr(config, "get_text_config") else config),
        forward_kwargs=no_cache(model),
        pp_entry=entry,
        pp_entry_reads=reads,
        pp_first=first,
        pp_last=last,
        pp_receive_at_blocks=receive,
        pp_every_stage=every_stage,
        pp_loop_count=loop_count,
        pp_siblings=siblings,
        transformers_plan=True,
        tp_refusal=tp_refusal,
        head_inputs=head_inputs,
        pp_seq2seq=seq2seq,
        pp_refusal=pp_refusal,
    )


def _tensor_parallel(model: nn.Module, base: nn.Module, embeddings: str | None):
    """The derived tp plan (structure.py) of every list of blocks, with the vocabulary-parallel input
    embedding where qn_hf reproduces its class, its tp entries and rng regions; or why there is none."""
    model_type = getattr(model.config, "model_type", None) or type(model).__name__
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = getattr(config, "num_attention_heads", None)
    # where no list holds blocks of one class, a list of several (Mllama's text model: self- and cross-attention
    # layers), each kind read apart; not beside lists of one class: a list of stages would hide theirs
    stacks = [n for n in block_lists(base) or block_lists(base, one_class=False)
              if any(isinstance(m, (nn.Linear, Conv1D)) for m in base.get_submodule(n).modules())]
    why = None
    if not isinstance(heads, int) or not stacks:
        why = "its config counts no attention heads (num_attention_heads)" if stacks else "it has no list of blocks"
    else:
        derived = derive_structure(base, stacks=stacks, heads=heads, fused=FUSED.get(model_type) or FUSED.get(config.model_type),
                                     config=config)
        derived = head_bias_tables(base, derived, stacks=stacks, heads=heads)
        why = derived.refusal
    if why is not None:
        declared = (f"transformers' tp plan for {model_type!r} (base_model_tp_plan) does not reach its blocks"
                    if getattr(config, "base_model_tp_plan", None) else
                    f"transformers declares no tp plan for {model_type!r} (base_model_tp_plan)")
        return {}, {}, (), (), f"{declared} and qn_hf derives none from its structure: {why}", {}
    tp_plan = dict(derived.tp_plan)
    if embeddings is not None and isinstance(base.get_submodule(embeddings), nn.Embedding):
        # every embedding sharing the input embedding's weight (BART's shared table, each stack's own
        # module over it) is split alike, where qn_hf reproduces each one's class; else all stay whole
        weight = base.get_submodule(embeddings).weight
        tables = [n for n, m in base.named_modules() if isinstance(m, nn.Embedding) and m.weight is weight]
        if all(adapter_for(base.get_submodule(n)) is not None for n in tables):
            tp_plan.update(dict.fromkeys(tables, Style.VOCAB_EMBEDDING))
    columns = {p for p, style in tp_plan.items() if style in COLUMN_STYLES}
    entries = derive_entries(base, sorted({p.rpartition(".")[0] for p in columns} | set(derived.attention)), columns)
    return tp_plan, derived.attr_patches, entries, derived.attention, None, derived.head_inputs


def _embeddings_path(module: nn.Module) -> str | None:
    found = input_embeddings(module)
    return relative_name(module, found) if found is not None else None


def input_embeddings(model: nn.Module) -> nn.Module | None:
    """``model.get_input_embeddings()``, or None where the model has none transformers can name (an
    audio or convolution model raises NotImplementedError)."""
    try:
        found = model.get_input_embeddings()
    except (NotImplementedError, AttributeError):
        return None
    return found if isinstance(found, nn.Module) else None


def no_cache(model: nn.Module) -> dict:
    """The forward keywords that turn transformers' key/value cache off for training: ``use_cache=False``
    where the forward takes it, by name or through ``**kwargs`` beside a config that has it (GraniteMoeHybrid
    reads it from its kwargs; left on, its cache of only linear-attention layers fails in the forward)."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    through_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    config = getattr(model, "config", None)
    # a composite config keeps it on its text config (Gemma 3's classifier hands its kwargs to its text model,
    # which makes a cache of the whole model's layers: a pipeline stage's blocks index past its end)
    configs = [config, config.get_text_config()] if hasattr(config, "get_text_config") else [config]
    takes = "use_cache" in parameters or (through_kwargs and any(hasattr(c, "use_cache") for c in configs))
    return {"use_cache": False} if takes else {}
