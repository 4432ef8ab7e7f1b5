"""The model zoo: every causal-LM architecture of the installed transformers that ships a tp plan,
and the table of how each trains under qn_hf (docs/zoo-table.md: equal to the plain model, or refused and why);
and the heads zoo: every model type under every head class transformers' auto mappings list for it
(``head_classes``), at data parallelism and the dimensions that apply (docs/heads-table.md).

The table is written from the zoo test's own results (``make zoo-table``), never by hand.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..config.dims import NamedDegrees, ParallelDims
from ..config.parallel_config import ParallelConfig
from .run import parity_config


@dataclass(frozen=True, init=False)
class ZooMesh(NamedDegrees):
    """One column of the zoo: the configuration a model trains one step at, built from
    ``parity_config``'s keywords (``ZooMesh(tp=2, sequence_parallel=True)``: dp, tp, pp, cp, ep,
    sequence_parallel, virtual_stages, recompute). ``moe``: the column applies to mixture-of-experts
    types only (the cell of any other type stays empty)."""

    parallel: ParallelConfig
    moe: bool = False

    def __init__(self, *, moe: bool = False, **keywords: Any) -> None:
        # frozen: the fields are set once, here, as dataclasses' own __init__ sets them
        object.__setattr__(self, "parallel", parity_config(**keywords))
        object.__setattr__(self, "moe", moe)

    @property
    def dims(self) -> ParallelDims:
        return self.parallel.dims

    # The options by name, as the zoo's tests read a column (``COLUMNS["sp"].tp``; the degrees: NamedDegrees).





    @property
    def virtual_stages(self) -> int:
        return self.parallel.virtual_stages

    @property
    def size(self) -> int:
        return self.dims.world_size

    def parity_kwargs(self) -> dict:
        """The keywords of ``one_step_parity`` (without the mesh object)."""
        return {"parallel": self.parallel}


# Every model type at MESHES in ``make test``; MESH_FEW there for ZOO_FEW, the SWEEP columns for
# SWEEP_FEW (a sliding-window + softcapped type, a windowed one, a fused-q|k|v one, an MoE one); the
# rest under ``make zoo-sweep`` (tests marked long).
MESHES = {"tp2": ZooMesh(tp=2), "pp2": ZooMesh(pp=2)}
MESH_FEW = {"tp2pp2": ZooMesh(tp=2, pp=2)}
SWEEP = {
    "sp": ZooMesh(tp=2, sequence_parallel=True),
    "cp2": ZooMesh(cp=2),
    "ep2": ZooMesh(dp=2, ep=2, moe=True),
    "tp2ep2": ZooMesh(tp=2, ep=2, moe=True),
    "pp2v2": ZooMesh(pp=2, virtual_stages=2),
}
COLUMNS = {**MESHES, **MESH_FEW, **SWEEP}
ZOO_FEW = ("qwen3", "gemma3_text", "mixtral", "deepseek_v3", "phi3", "olmo3", "qwen3_next", "qwen3_moe")
SWEEP_FEW = ("gemma2", "ministral", "phi3", "qwen3_moe")
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


def is_moe(model_type: str) -> bool:
    """Whether the type's default config counts routed experts."""
    from transformers import CONFIG_MAPPING

    from ..expert_parallel.apply import counts_experts

    return counts_experts(CONFIG_MAPPING[model_type]())


def meshes_for(model_type: str, *, sweep: bool = True) -> dict[str, ZooMesh]:
    """The columns a type is checked at: MESHES always; MESH_FEW for ZOO_FEW; the SWEEP columns (MoE
    ones for MoE types only) for SWEEP_FEW, or for every type with ``sweep``."""
    out = {**MESHES, **(MESH_FEW if model_type in ZOO_FEW else {})}
    if model_type in SWEEP_FEW or sweep:
        moe = is_moe(model_type)
        out.update({name: mesh for name, mesh in SWEEP.items() if moe or not mesh.moe})
    return out


def _cell(result: str | None) -> str:
    if result is None:
        return ""
    if result == "equal":
        return "equal"
    reason = result.removeprefix("refused: ")
    reason = reason if len(reason) <= REASON_CHARS else reason[: REASON_CHARS - 1] + "…"
    return "refused: " + reason.replace("|", "\\|").replace("\n", " ")


def not_applicable(mesh: str, outcome: str) -> str | None:
    """Why a refused cell says the architecture lacks what the column splits, rather than a limit of
    qn_hf (None otherwise): a column inside tensor parallelism (sp, tp2ep2, tp2pp2) where tp itself is
    refused, and context parallelism where layers mix positions outside softmax attention (recurrent,
    convolution or indexer layers), which no ring over attention can split."""
    from ..context_parallel.apply import POSITION_MIXING

    column = COLUMNS[mesh]
    reason = outcome.removeprefix("refused: ")
    if column != COLUMNS["tp2"] and column.tp > 1 and reason.startswith(f"tp={column.tp}:"):
        return "tp itself refused"
    if column.cp > 1 and POSITION_MIXING in reason:
        return "layers that mix positions outside attention"
    return None


def render_table(results: dict[str, dict[str, str]]) -> str:
    """Markdown: one row per model type, one column per mesh; counts first, each column's share equal
    of the types it applies to (``not_applicable``)."""
    columns = list(COLUMNS)
    lines = []
    for mesh in columns:
        cells = [r[mesh] for r in results.values() if mesh in r]
        equal = sum(c == "equal" for c in cells)
        apart = [why for c in cells if c != "equal" and (why := not_applicable(mesh, c))]
        applies = len(cells) - len(apart)
        share = f"{equal} equal of the {applies} it applies to ({100 * equal / applies:.0f}%)" if applies else "0 equal"
        besides = f", {len(apart)} not applicable ({', '.join(sorted(set(apart)))})" if apart else ""
        lines.append(f"- {mesh}: {share}, {applies - equal} refused{besides}, 0 different (of {len(cells)})")
    lines += ["", "| model type | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for model_type, row in sorted(results.items()):
        lines.append(f"| {model_type} | " + " | ".join(_cell(row.get(m)) for m in columns) + " |")
    return "\n".join(lines)


def replace_table(readme: str, table: str) -> str:
    """``readme`` with the text between the zoo-table markers replaced by ``table``."""
    pattern = re.compile(re.escape(TABLE_START) + ".*?" + re.escape(TABLE_END), re.S)
    if not pattern.search(readme):
        raise ValueError(f"the text has no {TABLE_START} ... {TABLE_END} block (docs/zoo-table.md holds one)")
    return pattern.sub(lambda _: f"{TABLE_START}\n{table}\n{TABLE_END}", readme)


# The heads zoo's families: transformers' auto mappings, one column group each (``head_classes``).
HEAD_FAMILIES = {
    "base": "MODEL_MAPPING_NAMES",
    "causal_lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "masked_lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "seq2seq_lm": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "speech_seq2seq": "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
    "sequence_classification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "token_classification": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
    "question_answering": "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES",
    "multiple_choice": "MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES",
    "image_classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "audio_classification": "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES",
    "ctc": "MODEL_FOR_CTC_MAPPING_NAMES",
    "image_text_to_text": "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
    "zero_shot_image_classification": "MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "pretraining": "MODEL_FOR_PRETRAINING_MAPPING_NAMES",
}


# the more specific family first where a class is listed under two with as many columns
_PREFERRED = ("causal_lm", "seq2seq_lm", "speech_seq2seq", "masked_lm")


def head_classes(families: dict[str, str] = HEAD_FAMILIES) -> list[tuple[str, str, str]]:
    """(family, model type, class name) for every class the installed transformers' auto mappings
    list under ``families``, whose config class builds with its defaults (a type needing values no
    default gives is left out), in a stable order. A class several mappings list (BLOOM's causal LM is
    also its pretraining class) is one row, under the family with the most columns (the counted one),
    between equals the first of ``families`` in ``_PREFERRED`` order (an encoder-decoder's generation class is
    also its masked LM, CLIP's model also its zero-shot classifier): the class and its loss are the same
    whichever lists it."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto import modeling_auto

    found: dict[tuple[str, str], str] = {}
    # the base models' mapping last: a class it shares names a head (CLIP's model is its zero-shot classifier)
    order = [f for f in _PREFERRED if f in families] + [f for f in families if f not in _PREFERRED and f != "base"] + \
        [f for f in families if f == "base"]
    for family, mapping in families.items():
        for model_type, names in sorted(getattr(modeling_auto, mapping, {}).items()):
            if model_type not in CONFIG_MAPPING:
                continue
            for name in (names,) if isinstance(names, str) else names:
                held = found.get((model_type, name))
                if held is None or (-len(head_columns(family)), order.index(family)) < \
                        (-len(head_columns(held)), order.index(held)):
                    found[(model_type, name)] = family
    return [(family, model_type, name) for (model_type, name), family in found.items()]


# The heads zoo's columns: every class at dp and dp x dp_shard (two steps), and the dimensions that cut or
# shard layers for the families the issue counts them on (HEAD_COLUMN_FAMILIES).
HEAD_COLUMNS = {"dp2": ZooMesh(dp=2), "dp2_shard2": ZooMesh(dp=2, dp_shard=2), "tp2": ZooMesh(tp=2),
                "pp2": ZooMesh(pp=2)}
HEAD_COLUMN_FAMILIES = {
    "tp2": ("causal_lm", "masked_lm", "seq2seq_lm", "image_classification"),
    "pp2": ("causal_lm", "masked_lm", "sequence_classification", "seq2seq_lm"),
}
HEADS_TABLE_START, HEADS_TABLE_END = "<!-- heads-table:start -->", "<!-- heads-table:end -->"
# Outcomes that are no verdict on qn_hf: the class cannot be built from its default config shrunk, its plain
# forward fails in one process, it takes inputs the check makes no batch for, or its forward draws random numbers
# (counted apart).
APART = ("cannot build", "fails alone", "no batch", "random")


def head_columns(family: str) -> list[str]:
    """The heads zoo's columns for a class of ``family``."""
    return [c for c in HEAD_COLUMNS if c not in HEAD_COLUMN_FAMILIES or family in HEAD_COLUMN_FAMILIES[c]]


def is_equal(outcome: str) -> bool:
    """Equal within the tolerances, or (a model float32 cannot reproduce) equal in float64."""
    return outcome == "equal" or outcome.startswith("equal:")


def outcome_of(verdict: dict) -> str:
    """A check's verdict as the heads zoo records it: ``equal``, or the kind and its reason's first line (an
    equal verdict has one where float64 judged it: ``check.run._float64_verdict``)."""
    if verdict["verdict"] == "equal" and not verdict.get("reason"):
        return "equal"
    reason = (verdict.get("reason") or "").splitlines()[0] if verdict.get("reason") else ""
    return f"{verdict['verdict']}: {reason[:REASON_CHARS]}"


def render_heads_table(results: dict[str, dict], *, classes: int) -> str:
    """Markdown: how many of the ``classes`` the mappings list the record holds; per family and column, how
    many classes train equal, are refused, or are apart (APART); then one row per class."""
    lines = [f"The record holds {len(results)} of the {classes} classes; `make heads-table` sweeps and records "
             f"the others.", "",
             "| family | column | equal | refused | different | apart (cannot build / fails alone / no batch / random) |",
             "|---|---|---|---|---|---|"]
    families = sorted({r["family"] for r in results.values()})
    for column in HEAD_COLUMNS:
        for family in families:
            cells = [r[column] for r in results.values() if r["family"] == family and column in r]
            if not cells:
                continue
            counts = [sum(is_equal(c) for c in cells), sum(c.startswith("refused") for c in cells),
                      sum(c.startswith("different") for c in cells), sum(c.startswith(APART) for c in cells)]
            lines.append(f"| {family} | {column} | " + " | ".join(map(str, counts)) + " |")
    lines += ["", "| class (model type) | family | " + " | ".join(HEAD_COLUMNS) + " |", "|---" * (len(HEAD_COLUMNS) + 2) + "|"]
    for key, row in sorted(results.items()):
        lines.append(f"| {key} | {row['family']} | " + " | ".join(_head_cell(row.get(c)) for c in HEAD_COLUMNS) + " |")
    return "\n".join(lines)


def _head_cell(outcome: str | None) -> str:
    if outcome is None:
        return ""
    cut = outcome if len(outcome) <= REASON_CHARS else outcome[: REASON_CHARS - 1] + "…"
    return cut.replace("|", "\\|").replace("\n", " ")


def replace_heads_table(text: str, table: str) -> str:
    pattern = re.compile(re.escape(HEADS_TABLE_START) + ".*?" + re.escape(HEADS_TABLE_END), re.S)
    if not pattern.search(text):
        raise ValueError(f"the text has no {HEADS_TABLE_START} ... {HEADS_TABLE_END} block (docs/heads-table.md holds one)")
    return pattern.sub(lambda _: f"{HEADS_TABLE_START}\n{table}\n{HEADS_TABLE_END}", text)
