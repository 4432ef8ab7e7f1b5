"""The shape of the package, checked from its source: no import cycle between qn_hf's modules (late
and type-checking imports count too), no private name imported from another module, and no file
longer than the house limit (300 lines in the checkpoint package, 400 elsewhere)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "qn_hf"
LIMITS = {"checkpoint": 300}
DEFAULT_LIMIT = 400


def _modules() -> dict[str, tuple[Path, str]]:
    """Dotted module name -> (file, the package its relative imports start from)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
            out[".".join(parts)] = (path, ".".join(parts))
        else:
            out[".".join(parts)] = (path, ".".join(parts[:-1]))
    return out


def _imports(modules: dict[str, tuple[Path, str]]) -> tuple[dict[str, set[str]], list[tuple[str, str, str]]]:
    edges: dict[str, set[str]] = {m: set() for m in modules}
    private = []
    for name, (path, package) in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    dest = f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules else target
                    if dest in modules and dest != name:
                        edges[name].add(dest)
                        if alias.name.startswith("_") and not alias.name.startswith("__"):
                            private.append((name, dest, alias.name))
            elif isinstance(node, ast.Import):
                edges[name].update(a.name for a in node.names if a.name in modules and a.name != name)
    return edges, private


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the list of modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_no_import_cycle():
    edges, _ = _imports(_modules())
    assert _cycle(edges) is None, " -> ".join(_cycle(edges))


def _folder(module: str) -> str:
    """The unit a module belongs to: its folder under qn_hf, or the root module itself."""
    return module.split(".")[1] if module.count(".") >= 1 else module


def _folder_edges(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for source, targets in edges.items():
        out.setdefault(_folder(source), set()).update(_folder(t) for t in targets if _folder(t) != _folder(source))
    return out


def _mutual(folders: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, targets in folders.items() for b in targets if a < b and a in folders.get(b, ()))


def test_no_two_folders_import_each_other():
    # The floors of the package (config at the bottom; policies, mesh and comm above it; the mechanisms;
    # step and checkpoint; validation; transform and the handle; the planner; the entry, parallelize; check,
    # training and integrations on top): a folder that imports another is above it, so no pair imports both ways.
    edges, _ = _imports(_modules())
    assert _mutual(_folder_edges(edges)) == []


def test_config_is_the_ground_floor():
    # config/ holds data only: it describes the mechanisms without importing them.
    edges, _ = _imports(_modules())
    assert _folder_edges(edges)["config"] <= {"arguments"}


def test_folder_checks_can_fail():
    edges = {"qn_hf.a.x": {"qn_hf.b.y"}, "qn_hf.b.y": {"qn_hf.a.z"}, "qn_hf.a.z": set(), "qn_hf.c": {"qn_hf.a.x"}}
    assert _mutual(_folder_edges(edges)) == [("a", "b")]


def test_no_private_name_imported_across_modules():
    _, private = _imports(_modules())
    assert private == [], private


def test_finds_what_it_forbids():
    # The checks above must be able to fail: a cycle and a private import, built by hand.
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    edges, _ = _imports(_modules())
    assert "qn_hf.parallel_model" in edges["qn_hf.transform.parallelize"]  # the graph is read from the real files
    assert "qn_hf.checkpoint.format" in edges["qn_hf.checkpoint.save"]


def test_file_sizes():
    too_long = []
    for path in PACKAGE.rglob("*.py"):
        folder = path.relative_to(PACKAGE).parts[0] if len(path.relative_to(PACKAGE).parts) > 1 else ""
        limit = LIMITS.get(folder, DEFAULT_LIMIT)
        lines = len(path.read_text().splitlines())
        if lines > limit:
            too_long.append((str(path.relative_to(ROOT)), lines, limit))
    assert too_long == []


ROOT_MODULES = 13


def test_package_root_keeps_only_entry_points_and_shared_modules():
    # Each concept has its folder (docs/layout.md); the root keeps the entry points and what every
    # folder shares (mesh, comm, compat, placement, arguments, failure, version).
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= ROOT_MODULES, root


def _option_enums() -> tuple[type, ...]:
    """Every closed vocabulary of the package: a ``Choice`` enum whose values callers may spell."""
    from qn_hf.comm_meter import Collective
    from qn_hf.config.dims import Axis
    from qn_hf.config.features import Feature
    from qn_hf.config.layout import GroupRole
    from qn_hf.config.options import Dispatch, Gather, LossKind, Offload, Precision, ProblemType, Recompute
    from qn_hf.config.schedule import Schedule
    from qn_hf.launch.nodes import Launcher
    from qn_hf.pipeline.nccl_replay import Step, Work
    from qn_hf.pipeline.schedule import Op
    from qn_hf.planner.calibration import Link
    from qn_hf.policies.fused import FusedLayout, HeadAxis
    from qn_hf.policies.model_policy import StandIn
    from qn_hf.policies.structure import Role
    from qn_hf.policies.styles import Style

    return (Style, Schedule, Axis, LossKind, ProblemType, Role, FusedLayout, HeadAxis, Precision, Recompute, Gather, Feature, Collective, StandIn, Op, Step, Work,
            Link, Launcher, Dispatch, Offload, GroupRole)


def _names_of_choices() -> dict[str, str]:
    """Every spelling of an option (a style, schedule, mesh axis, loss kind, precision, recompute
    mode, gather mode, feature) -> which enum it belongs to."""
    return {value: enum.__name__ for enum in _option_enums() for value in enum.values()}


def test_every_option_enum_is_guarded():
    # A new Choice enum in the package joins the guard above, or this fails naming it.
    import importlib

    from qn_hf.arguments import Choice

    found = set()
    for path in PACKAGE.rglob("*.py"):
        if path.name == "__main__.py":  # runs its command when imported
            continue
        module = importlib.import_module(".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"))
        found |= {v for v in vars(module).values()
                  if isinstance(v, type) and issubclass(v, Choice) and v is not Choice and v.__module__ == module.__name__}
    assert sorted(e.__name__ for e in found - set(_option_enums())) == []


def _string_comparisons(source: str, names: dict[str, str]) -> list[tuple[int, str]]:
    """(line, literal) of every comparison (==, !=, in, not in) against one of ``names`` spelled out,
    and of every tuple, list or set that spells out two or more of them (a membership contract)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            spelled = [(node.lineno, e.value) for e in node.elts
                       if isinstance(e, ast.Constant) and isinstance(e.value, str) and e.value in names]
            found += spelled if len(spelled) > 1 else []
        if not isinstance(node, ast.Compare):
            continue
        for side in (node.left, *node.comparators):
            elements = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
            found += [(node.lineno, e.value) for e in elements
                      if isinstance(e, ast.Constant) and isinstance(e.value, str) and e.value in names]
    return sorted(set(found))


def test_no_module_compares_a_choice_against_a_string_literal():
    # Styles, schedules, axes and loss kinds are enums (qn_hf.arguments.Choice); code compares members,
    # so a misspelling is an AttributeError at import, not a branch that silently never runs.
    names = _names_of_choices()
    found = [(str(path.relative_to(ROOT)), line, f"{literal!r} ({names[literal]})")
             for path in PACKAGE.rglob("*.py") for line, literal in _string_comparisons(path.read_text(), names)]
    assert found == []


def test_the_string_comparison_check_can_fail():
    names = _names_of_choices()
    assert _string_comparisons('if style == "colwise": pass\nif s in ("x", "zb_h1"): pass', names) == [
        (1, "colwise"), (2, "zb_h1")]
    assert _string_comparisons("if style == Style.COLWISE: pass", names) == []
    assert _string_comparisons('ROWS = ("vocab_embedding", "vocab_colwise")\nx = ("layers", "dp")', names) == [
        (1, "vocab_colwise"), (1, "vocab_embedding")]


def _pass_order_problems(passes, initial: set[str]) -> list[str]:
    """Each pass's needs that neither parallelize starts from nor an earlier pass makes."""
    made, problems = set(initial), []
    for step in passes:
        problems += [f"{step.name} needs {field!r} before anything makes it" for field in step.needs if field not in made]
        made |= set(step.makes)
    return problems


def test_parallelize_passes_run_after_what_they_need():
    import dataclasses

    from qn_hf.transform.passes import PASSES, Build, Pass

    fields = {f.name: f for f in dataclasses.fields(Build)}
    initial = {n for n, f in fields.items() if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    assert all(field in fields for step in PASSES for field in (*step.needs, *step.makes))
    assert _pass_order_problems(PASSES, initial) == []
    assert len({step.name for step in PASSES}) == len(PASSES)
    # the check can fail: the dropout streams moved before the placement exists
    moved = sorted(PASSES, key=lambda step: step.name != "dropout streams")
    assert _pass_order_problems(moved, initial) and isinstance(moved[0], Pass)


# files qn_hf writes under its own name, which the docs name as qn_hf.<extension> (a DCP directory's qn_hf.json,
# a checkpoint root's qn_hf.lock): not attributes
_FILES_NAMED_QN_HF = frozenset({"json", "lock"})


def test_every_public_name_the_docs_give_exists():
    """``qn_hf.X`` in the README and docs is an attribute or a module of the package (issue 66: the docs named a
    ``qn_hf.auto_choice`` that was not exported)."""
    import importlib.util
    import re

    import qn_hf

    missing = sorted({(match.group(1), path.name) for path in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
                      for match in re.finditer(r"\bqn_hf\.([A-Za-z_]\w*)", path.read_text())
                      if match.group(1) not in _FILES_NAMED_QN_HF and not hasattr(qn_hf, match.group(1))
                      and importlib.util.find_spec(f"qn_hf.{match.group(1)}") is None})
    assert not missing, missing


# The degrees are named in one table (qn_hf/config/dims.py AXES); a place that spells four or more of them out
# (a dict, a call's keywords, a signature, a tuple, a class's fields) is a copy of that table a new dimension
# must find. Issue 69 counted them (65 in 22 modules); the count may only fall (docs/layout.md).
DEGREE_NAMES = {"dp", "tp", "pp", "cp", "ep", "dp_shard"}
DEGREE_LISTS_LIMIT = 6


def _degree_lists(source: str) -> list[tuple[int, str]]:
    """(line, what) of each node of ``source`` that names four or more degrees."""
    def name(e) -> str | None:  # "dp", dp, Axis.DP and Axis.DP.value all name dp
        if isinstance(e, ast.Attribute) and e.attr == "value" and isinstance(e.value, ast.Attribute):
            e = e.value
        return e.value if isinstance(e, ast.Constant) else e.attr.lower() if isinstance(e, ast.Attribute) \
            else e.id if isinstance(e, ast.Name) else None

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Dict):
            names = [name(k) for k in node.keys if k is not None]
        elif isinstance(node, ast.Call):
            names = [k.arg for k in node.keywords]
        elif isinstance(node, ast.arguments):
            names = [a.arg for a in node.posonlyargs + node.args + node.kwonlyargs]
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            names = [name(e) for e in node.elts]
        elif isinstance(node, ast.ClassDef):
            names = [t.id.lower() for s in node.body for t in (s.targets if isinstance(s, ast.Assign) else [s.target]
                     if isinstance(s, ast.AnnAssign) else []) if isinstance(t, ast.Name)]
        else:
            continue
        if len(DEGREE_NAMES & {n for n in names if isinstance(n, str)}) >= 4:
            found.append((getattr(node, "lineno", 0), type(node).__name__))
    return found


def test_the_degrees_are_spelled_out_in_few_places():
    places = [(str(path.relative_to(ROOT)), *where) for path in sorted(PACKAGE.rglob("*.py"))
              for where in _degree_lists(path.read_text())]
    assert len(places) <= DEGREE_LISTS_LIMIT, "\n".join(map(str, places))


def test_the_degree_count_can_fail():
    source = ('d = {"dp": 1, "tp": 1, "pp": 1, "cp": 1}\nf(dp=1, tp=2, pp=1, ep=1)\n'
              'g = (Axis.DP, Axis.TP, Axis.PP, Axis.CP)\ndef h(*, dp, tp, pp, dp_shard): pass\n'
              'class C:\n    dp: int\n    tp: int\n    pp: int\n    cp: int\n'
              'fine = {"dp": 1, "tp": 1, "pp": 1}\n'
              'k = {Axis.DP.value: 1, Axis.TP.value: 2, Axis.PP.value: 1, Axis.CP.value: 1}\n'
              'n = (Axis.DP.value, Axis.TP.value, Axis.PP.value, Axis.EP.value)\n')
    assert sorted(_degree_lists(source)) == [(0, "arguments"), (1, "Dict"), (2, "Call"), (3, "Tuple"), (5, "ClassDef"),
                                             (11, "Dict"), (12, "Tuple")]


def test_parallelize_takes_the_configuration_and_few_keywords():
    # every option of the configuration is ParallelConfig's keyword (written once there); parallelize's own
    # say where the model runs and what it starts from
    import inspect

    import qn_hf

    parameters = inspect.signature(qn_hf.parallelize).parameters
    assert len(parameters) <= 12, list(parameters)
    assert not set(parameters) & set(qn_hf.ParallelConfig.keyword_names())
