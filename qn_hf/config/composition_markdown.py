"""docs/composition-table.md: every pair of features as a matrix of what the table says of it (its refused and
exclusive rows, ``composition.py``; what the tests' marks cover, ``composition_coverage.py``), then each refusal's
reason (``make composition-table`` writes it; tests/test_composition.py checks it is current)."""

from __future__ import annotations

from .composition import ROWS, status
from .features import Feature, Status


class _Placeholder(str):
    def __repr__(self) -> str:
        return self


class _Placeholders(dict):
    """Formats a message's values as their names (``cp=<cp>``) for docs/composition-table.md."""

    def __missing__(self, key: str) -> str:
        return _Placeholder(f"<{key}>")


_SYMBOL = {Status.PLAIN: "✓", Status.EQUIVALENT: "≈", Status.RUNS: "r", Status.UNTESTED: "·", Status.REFUSED: "✗",
           Status.EXCLUSIVE: "—"}


def markdown() -> str:
    """The composition table (docs/composition-table.md): a matrix of the pairs, then each refusal's reason."""
    order = list(Feature)
    lines = ["| | " + " | ".join(f.value.removeprefix("pp ") if f.value.startswith("pp ") else f.value
                                   for f in order) + " |",
             "|---" * (len(order) + 1) + "|"]
    for a in order:
        cells = ["" if a is b else _SYMBOL[status(frozenset((a, b)))] for b in order]
        lines.append(f"| **{a.value}** | " + " | ".join(cells) + " |")
    lines += ["", "✓ compared with the plain model, ≈ compared with a configuration that is, r runs in a test "
                  "without a numerical comparison, · not tested yet (a warning says so), ✗ refused, — cannot both "
                  "be set. Refused:", ""]
    for row in ROWS:
        if row.status is Status.REFUSED:
            lines.append(f"- {row.first} x {row.second}: " + row.message.format_map(_Placeholders()))
    return "\n".join(lines) + "\n"
