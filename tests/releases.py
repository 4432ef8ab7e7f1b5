"""Which transformers release the tests run against, and what it has of the model types tests name.

qn_hf supports transformers 5.17 through the current 5.x (pyproject.toml); the suite is written on
the release the test extra pins (``RECORDED_WITH``), which is also the one whose outcomes the model
zoo records (tests/zoo_expected.json). A test that names a model type which an older release lacks,
or whose architecture there has no tp plan, runs on an equivalent type where one exists or is skipped
with the installed release named: never asserted differently on the pinned release.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import transformers

INSTALLED = transformers.__version__


def _pinned(package: str) -> str:
    """The version of ``package`` the project's test extra pins (its one ``"package==X"``; read as
    text, since tomllib is not in Python 3.10)."""
    project = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    found = re.search(rf'"{re.escape(package)}==([^"]+)"', project)
    if found is None:
        raise LookupError(f"pyproject.toml's test extra pins no {package}")
    return found.group(1)


RECORDED_WITH = _pinned("transformers")
PINNED = INSTALLED == RECORDED_WITH
# The heads zoo's record (tests/heads_zoo_expected.json) is of its own release: its sweep takes more than 4 h on 2
# cores, so it is rerun apart from a change of the pin (`make heads-table` under that release, then this line).
# On any other release the heads zoo holds its invariants (never different; data parallelism equal or apart)
# without comparing outcomes with the record.
HEADS_RECORDED_WITH = "5.23.0"
HEADS_PINNED = INSTALLED == HEADS_RECORDED_WITH


def tp_plan_missing(model_type: str) -> str | None:
    """Why the installed transformers cannot stand in for ``model_type`` where a test needs its tp plan
    (the type is absent, or its default config declares no ``base_model_tp_plan``), or None."""
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        return f"transformers {INSTALLED} has no model type {model_type!r} (the suite pins {RECORDED_WITH})"
    if not getattr(CONFIG_MAPPING[model_type](), "base_model_tp_plan", None):
        return f"transformers {INSTALLED} ships no tp plan for {model_type!r} (the suite pins {RECORDED_WITH})"
    return None


def splits_experts_over_tp(model_type: str) -> bool:
    """Whether the installed transformers' tp plan for ``model_type`` splits the experts over tp (``moe_tp_experts``,
    5.17-5.24); 5.25 leaves the experts to the ep plan, so tp keeps them whole."""
    from transformers import CONFIG_MAPPING

    return "moe_tp_experts" in (getattr(CONFIG_MAPPING[model_type](), "base_model_tp_plan", None) or {}).values()


def needs_expert_tp_rules(model_type: str) -> None:
    """Skip the calling test where the installed transformers' tp plan keeps ``model_type``'s experts whole."""
    if not splits_experts_over_tp(model_type):
        pytest.skip(f"transformers {INSTALLED}'s tp plan for {model_type!r} leaves its experts whole (the suite pins "
                    f"{RECORDED_WITH})")


def needs_model_type(model_type: str) -> None:
    """Skip the calling test where the installed transformers has no ``model_type`` at all."""
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {INSTALLED} has no model type {model_type!r} (the suite pins {RECORDED_WITH})")


def needs_tp_plan(model_type: str) -> None:
    """Skip the calling test where the installed transformers lacks ``model_type``'s tp plan."""
    reason = tp_plan_missing(model_type)
    if reason is not None:
        pytest.skip(reason)


def with_tp_plan(preferred: str, stand_in: str) -> str:
    """``preferred`` where the installed transformers ships its tp plan, else ``stand_in`` (a type of
    the same kind that older releases plan)."""
    return preferred if tp_plan_missing(preferred) is None else stand_in
