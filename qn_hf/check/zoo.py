"""The model zoo: every causal-LM architecture of the installed transformers that ships a tp plan,
and the README table of how each trains under qn_hf (equal to the plain model, or refused and why).

The table is written from the zoo test's own results (``make zoo-table``), never by hand.
"""

from __future__ import annotations

import re

# The meshes every zoo model is checked at (name -> (dp, tp, pp)); MESH_FEW only for ZOO_FEW.
MESHES = {"tp2": (1, 2, 1), "pp2": (1, 1, 2)}
MESH_FEW = {"tp2pp2": (1, 2, 2)}
ZOO_FEW = ("qwen3", "gemma3_text", "mixtral", "deepseek_v3", "phi3", "olmo3", "qwen3_next", "qwen3_moe")
TABLE_START, TABLE_END = "<!-- zoo-table:start -->", "<!-- zoo-table:end -->"
REASON_CHARS = 150  # a refusal's reason in the table is cut here (the test checks the whole text)


def zoo_model_types() -> list[str]:
    """Model types whose default config declares ``base_model_tp_plan`` and that have a causal-LM class."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        if model_type not in CONFIG_MAPPING:
            continue
        try:
            config = CONFIG_MAPPING[model_type]()
        except Exception:  # noqa: BLE001 - a config that cannot be built with defaults is not in the zoo
            continue
        if getattr(config, "base_model_tp_plan", None):
            found.append(model_type)
    return found


def has_pp_plan(model_type: str) -> bool:
    from transformers import CONFIG_MAPPING

    return bool(getattr(CONFIG_MAPPING[model_type](), "base_model_pp_plan", None))


def meshes_for(model_type: str) -> dict[str, tuple[int, int, int]]:
    return {**MESHES, **(MESH_FEW if model_type in ZOO_FEW else {})}


def _cell(result: str | None) -> str:
    if result is None:
        return ""
    if result == "equal":
        return "equal"
    reason = result.removeprefix("refused: ")
    reason = reason if len(reason) <= REASON_CHARS else reason[: REASON_CHARS - 1] + "…"
    return "refused: " + reason.replace("|", "\\|").replace("\n", " ")


def render_table(results: dict[str, dict[str, str]]) -> str:
    """Markdown: one row per model type, one column per mesh; counts first."""
    columns = [*MESHES, *MESH_FEW]
    lines = []
    for mesh in columns:
        cells = [r[mesh] for r in results.values() if mesh in r]
        equal = sum(c == "equal" for c in cells)
        lines.append(f"- {mesh}: {equal} equal, {len(cells) - equal} refused, 0 different (of {len(cells)})")
    lines += ["", "| model type | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for model_type, row in sorted(results.items()):
        lines.append(f"| {model_type} | " + " | ".join(_cell(row.get(m)) for m in columns) + " |")
    return "\n".join(lines)


def replace_table(readme: str, table: str) -> str:
    """``readme`` with the text between the zoo-table markers replaced by ``table``."""
    pattern = re.compile(re.escape(TABLE_START) + ".*?" + re.escape(TABLE_END), re.S)
    if not pattern.search(readme):
        raise ValueError(f"README has no {TABLE_START} ... {TABLE_END} block")
    return pattern.sub(lambda _: f"{TABLE_START}\n{table}\n{TABLE_END}", readme)
