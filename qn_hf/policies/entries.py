"""Finding the tp entries of a transformers plan: modules whose first argument feeds only column layers.

A hand-written policy names its entries (``ModelPolicy.tp_entries``); transformers' plans do not. An
entry lets the input of q, k and v take one all-reduce of its gradient instead of three, and it is
where sequence parallelism gathers the sequence, so derived policies find them here. What makes a
module an entry is how its ``forward`` uses its first argument, so that is read from the source:
every use must be the argument of a call to one of its column-parallel submodules
(``self.q_proj(hidden_states)``) or a read of its shape, dtype or device, and every call of a
column-parallel submodule must take it. Anything else (a
replicated gate or router reading it, a helper function) means the argument has another consumer,
whose input gradient would be summed over tp a second time: no entry then. A statement of the
forward's own body that assigns the name anew (``hidden_states = self.fc1(hidden_states)``, as
MLPs write it) ends the argument's life: what the name holds after it is not the argument, so later
uses do not count; an assignment anywhere else (inside a branch or loop) is refused, since which
uses then read the argument depends on the path taken.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap

from torch import nn

from .patterns import match_modules

# Reading these from the argument does not consume its values.
_METADATA = {"shape", "dtype", "device", "size", "dim", "ndim"}


def self_path(node: ast.AST) -> str | None:
    """``self.a.b`` -> ``"a.b"``; None for anything that is not an attribute chain on ``self``."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == "self" and parts:
        return ".".join(reversed(parts))
    return None


def forward_source(cls: type) -> str:
    """The source of ``cls.forward``, or "" where there is none to read (a builtin's, a compiled one's)."""
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return ""


def forward_tree(module: nn.Module) -> ast.FunctionDef | None:
    return method_tree(module, "forward")


def method_tree(module: nn.Module, name: str) -> ast.FunctionDef | None:
    """The parsed source of ``type(module).<name>`` (a property's getter), or None where it has none."""
    function = getattr(type(module), name, None)
    return _function_tree(_undecorated(function.fget if isinstance(function, property) else function, name))


def _undecorated(function: object, name: str) -> object:
    """``function`` as its class wrote it: a decorator's wrapper that names it (``functools.wraps``) unwrapped, and
    one that does not, held in the wrapper's closure under the method's own name (transformers 5.25's
    ``use_kernelized_func`` replaces ``__init__`` by a ``new_init`` that calls it), taken from there."""
    function = inspect.unwrap(function) if callable(function) else function
    for _ in range(8):  # decorators over decorators, a few deep at most
        if getattr(function, "__name__", name) == name:
            return function
        inner = [cell.cell_contents for cell in getattr(function, "__closure__", None) or ()
                 if inspect.isfunction(getattr(cell, "cell_contents", None))]
        named = [f for f in inner if f.__name__ == name]
        if not named and len(inner) != 1:
            return function
        function = (named or inner)[0]
    return function


@functools.cache
def _function_tree(function: object) -> ast.FunctionDef | None:
    """Parsed once a function: a model holds many instances of each class, and the trees are only read."""
    try:
        source = textwrap.dedent(inspect.getsource(function))
    except (OSError, TypeError):
        return None
    tree = ast.parse(source).body[0]
    return tree if isinstance(tree, ast.FunctionDef) else None


def _own_code(module: nn.Module, name: str) -> bool:
    """Whether ``type(module).<name>`` is a model's own code (defined in a ``transformers.models`` module or the
    module's own), not transformers' or torch's generic classes (``PreTrainedModel.dtype``,
    ``get_extended_attention_mask``), which read parameters and config and call no child by its name."""
    function = getattr(type(module), name, None)
    function = function.fget if isinstance(function, property) else function
    where = getattr(_undecorated(function, name), "__module__", "") if callable(function) else ""
    return where.startswith("transformers.models.") or where == type(module).__module__


def own_methods(module: nn.Module, tree: ast.FunctionDef) -> dict[str, set[str]]:
    """The model's own methods and properties the forward ``tree`` calls (``self.compute_position_bias(x)``),
    each with the attributes of ``self`` it reads, transitively (``relative_attention_bias``); a method that
    reaches ``self`` another way (``children_reached``) is left out, as the source does not say what it runs."""
    found: dict[str, set[str]] = {}
    for head in self_references(tree):
        if not _own_code(module, head) or isinstance(getattr(module, head, None), nn.Module):
            continue
        method = method_tree(module, head)
        reached = children_reached(module, method) if method is not None else None
        if reached is not None:
            found[head] = reached
    return found


def children_reached(module: nn.Module, tree: ast.FunctionDef) -> set[str] | None:
    """The attributes of ``self`` the forward ``tree`` reads, through the model's own methods and properties it
    calls too (``self._create_attention_masks(...)``, transitively); None where it reaches ``self`` another way
    (``self`` handed to a function, ``getattr(self, ...)``, ``self(...)``, ``super()``), which the source does not
    say what it runs of."""
    reached: set[str] = set()
    todo, seen = [tree], {tree.name}
    while todo:
        current = todo.pop()
        parents = {child: parent for parent in ast.walk(current) for child in ast.iter_child_nodes(parent)}
        for node in ast.walk(current):
            bare = isinstance(node, ast.Name) and node.id == "self" and not isinstance(parents.get(node), ast.Attribute)
            if bare or (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"):
                return None
        for head in self_references(current):
            reached.add(head)
            if head not in seen and _own_code(module, head) and not isinstance(getattr(module, head, None), nn.Module):
                seen.add(head)
                found = method_tree(module, head)
                if found is None:
                    return None
                todo.append(found)
    return reached


def feeds_only(module: nn.Module, columns: set[str]) -> bool:
    """Whether ``module.forward`` uses its first argument only as an argument of calls to the
    submodules named in ``columns`` (paths relative to ``module``) or for its metadata."""
    tree = forward_tree(module)
    if tree is None or len(tree.args.args) < 2:
        return False
    arg = tree.args.args[1].arg
    parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
    if any(isinstance(node, ast.Call) and self_path(node.func) in columns
           and not any(isinstance(a, ast.Name) and a.id == arg for a in node.args) for node in ast.walk(tree)):
        # a column layer fed by another argument (CTRL's attention takes v, k and q apart, though its
        # block passes one tensor thrice): the entry's one all-reduce would not reach that input's gradient
        return False
    used = False
    for statement in tree.body:
        rebinds = isinstance(statement, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == arg for t in statement.targets)
        # a top-level ``arg = ...``: its value side still reads the argument, its target is the end
        for node in ast.walk(statement.value if rebinds else statement):
            if not isinstance(node, ast.Name) or node.id != arg:
                continue
            if not isinstance(node.ctx, ast.Load):
                return False  # assigned inside a branch, loop or unpacking: which value a use reads depends
            parent = parents.get(node)
            if isinstance(parent, ast.Attribute) and parent.attr in _METADATA:
                continue
            if isinstance(parent, ast.Call) and node in parent.args and self_path(parent.func) in columns:
                used = True
                continue
            return False
        if rebinds:
            if any(not (isinstance(t, ast.Name) and t.id == arg) for t in statement.targets):
                return False
            break
    return used


def derive_entries(base: nn.Module, candidates: list[str], column_rules: set[str]) -> tuple[str, ...]:
    """The candidate patterns (``layers.*.self_attn``) whose every matched module is an entry, and
    where only some are (DeepSeek's ``layers.*.mlp`` is a dense MLP in the first layers and an MoE
    block, which is none, after them) the names of those that are.

    ``column_rules`` are the patterns of the column-parallel rules; a module's columns are the rules
    directly under its pattern."""
    entries = []
    for pattern in candidates:
        columns = {rule[len(pattern) + 1 :] for rule in column_rules if rule.startswith(pattern + ".")}
        names = match_modules(base, pattern)
        found = [n for n in names if columns and feeds_only(base.get_submodule(n), columns)]
        entries += [pattern] if found and found == names else found
    return tuple(sorted(entries))


def self_references(tree: ast.FunctionDef) -> dict[str, list[tuple[int, str]]]:
    """Every ``self.<child>...`` the forward reads: child -> [(line, the rest of the path, "" if none)],
    the outermost chain of each (``self.embed_tokens.weight.device`` once, as "weight.device")."""
    parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
    found: dict[str, list[tuple[int, str]]] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or isinstance(parents.get(node), ast.Attribute):
            continue
        path = self_path(node)
        if path is not None:
            head, _, rest = path.partition(".")
            found.setdefault(head, []).append((node.lineno, rest))
    return found
