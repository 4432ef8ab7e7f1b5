"""The one home of the plain argument checks (a positive integer, a name from a list, a positive
size), so every caller raises the same ``ValueError`` naming the value, before any collective."""

from __future__ import annotations

import difflib
import enum
import inspect
from collections.abc import Callable, Sequence


class Choice(str, enum.Enum):
    """A closed set of names an argument takes (a schedule, a loss kind, a collective). A member
    equals and hashes as its string, so callers may pass either and dictionaries keyed either way
    agree; it prints, and messages quote it, as that string (``schedule='zb_h1'``)."""

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return repr(self.value)

    @classmethod
    def values(cls) -> tuple[str, ...]:
        return tuple(member.value for member in cls)


def plural(count: int, noun: str) -> str:
    """``count`` and ``noun``, its last word plural unless ``count`` is 1, as messages say them:
    ``plural(1, "microbatch") == "1 microbatch"``, ``plural(2, "CPU process") == "2 CPU processes"``."""
    if count != 1:
        noun += "es" if noun.endswith(("s", "x", "ch", "sh")) else "s"
    return f"{count:,} {noun}"


def check_positive_int(name: str, value: object, *, fix: str = "") -> None:
    """``value`` must be an int >= 1 (``True`` is not a count)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer" + (f"; {fix}" if fix else ""))


def check_non_negative_int(name: str, value: object, *, what: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}={value!r} must be a non-negative integer" + (f" ({what})" if what else ""))


def check_choice(name: str, value: object, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is unknown; use one of {tuple(choices)}")


def check_positive(name: str, value: object) -> None:
    """A positive real number (a size in MiB, a rate)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}={value!r} must be positive")


def unknown_keywords(given: dict, function: Callable, more: Sequence[str] = ()) -> str:
    """The message for keywords ``function`` does not take, with the close matches it does (its keyword-only
    parameters and ``more``, the names its ``**`` parameter takes)."""
    known = [n for n, p in inspect.signature(function).parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    known += [n for n in more if n not in known]
    parts = []
    for name in sorted(given):
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        parts.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return (f"{function.__name__}() got unexpected keyword argument{'s' if len(parts) > 1 else ''} {', '.join(parts)}; "
            f"it takes {', '.join(known)}")
