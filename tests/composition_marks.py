"""The tests' ``composes`` marks: which pairs of features (qn_hf/config/features.py) a test compares with the plain
model. ``@pytest.mark.composes((Feature.TP, Feature.SP), case="llama-1-2-1-1-False")`` on a test function says
that its case with that id (every case, without ``case=``) compares tp with sp; ``status=Status.EQUIVALENT`` that it
compares them with a configuration that is itself compared with the plain model, ``Status.RUNS`` that it only runs
them. tests/conftest.py reads the marks of the collected tests: ``make test`` runs a test for every pair they cover
(``--cover``: every pair composition_coverage.py says a test compares), and ``make composition-table`` writes what
they cover into qn_hf/config/composition_coverage.py, which the runtime warns from (``--composition-table PATH``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from qn_hf.config.features import Feature, Status, ordered, pair_name

MARK = "composes"
_BEST_FIRST = (Status.PLAIN, Status.EQUIVALENT, Status.RUNS)  # what a mark may say, the strongest first
_COMPARED = (Status.PLAIN, Status.EQUIVALENT)  # what make test must run: a pair only run is warned about anyway


@dataclass(frozen=True)
class Covers:
    """One ``composes`` mark: its pairs, the case it names (None: every case), what it says of them."""

    pairs: tuple[frozenset[Feature], ...]
    case: str | None
    status: Status

    @classmethod
    def of(cls, args: tuple, kwargs: dict) -> Covers:
        unknown = set(kwargs) - {"case", "status"}
        if unknown or not args:
            raise ValueError(f"@pytest.mark.composes takes pairs of Feature, then case= and status=; got {args!r}, "
                             f"{sorted(unknown)}")
        pairs = []
        for pair in args:
            if not (isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(f, Feature) for f in pair)
                    and pair[0] is not pair[1]):
                raise ValueError(f"@pytest.mark.composes: {pair!r} is not a pair of two Feature members")
            pairs.append(frozenset(pair))
        status = kwargs.get("status", Status.PLAIN)
        if status not in _BEST_FIRST:
            raise ValueError(f"@pytest.mark.composes: status={status!r}; a test says one of {_BEST_FIRST} (a refusal "
                             f"is a row of qn_hf/config/composition.py)")
        return cls(tuple(pairs), kwargs.get("case"), status)


@dataclass(frozen=True)
class Marked:
    """One collected test as its marks see it: its node id, its case's id (None: not parametrized), its
    ``composes`` marks, and whether it is marked long itself."""

    nodeid: str
    case: str | None
    covers: tuple[Covers, ...]
    long: bool

    @classmethod
    def of(cls, item) -> Marked:
        callspec = getattr(item, "callspec", None)
        return cls(item.nodeid, callspec.id if callspec is not None else None,
                   tuple(Covers.of(m.args, m.kwargs) for m in item.iter_markers(MARK)),
                   item.get_closest_marker("long") is not None)

    @property
    def function(self) -> str:
        return self.nodeid.split("[", 1)[0]

    def matching(self) -> list[Covers]:
        return [c for c in self.covers if c.case is None or c.case == self.case]


def needed(test: Marked) -> bool:
    """Whether make test must run it for its marks that say it compares (``Status.RUNS`` ones need no run there: a
    run warns of the pair anyway): such a mark names its case, or such a mark without a case is on it and it is
    not one of its function's cases marked long (those repeat the others)."""
    matching = [c for c in test.matching() if c.status in _COMPARED]
    return any(c.case is not None for c in matching) or (bool(matching) and (test.case is None or not test.long))


def coverage(tests: Iterable[Marked]) -> dict[frozenset[Feature], Status]:
    """The pairs the tests' marks cover, each with the strongest status a mark gives it, in Feature's order."""
    best: dict[frozenset[Feature], Status] = {}
    for test in tests:
        for covers in test.matching():
            for pair in covers.pairs:
                if pair not in best or _BEST_FIRST.index(covers.status) < _BEST_FIRST.index(best[pair]):
                    best[pair] = covers.status
    order = list(Feature)
    return dict(sorted(best.items(), key=lambda kv: [order.index(f) for f in ordered(kv[0])]))


def unmatched(tests: Iterable[Marked]) -> list[str]:
    """A mark whose case is none of its function's cases (renamed, or the mark mistyped)."""
    cases: dict[str, set[str | None]] = {}
    named: dict[str, set[str]] = {}
    for test in tests:
        cases.setdefault(test.function, set()).add(test.case)
        named.setdefault(test.function, set()).update(c.case for c in test.covers if c.case is not None)
    return [f"{function}[{case}]: a composes mark names this case, which the function does not have"
            for function, names in named.items() for case in sorted(names - cases[function])]


def uncovered(selected: Iterable[Marked], covered: Mapping[frozenset[Feature], Status]) -> list[str]:
    """The pairs ``covered`` says are compared (qn_hf/config/composition_coverage.py's) that no selected test's
    mark compares as strongly."""
    have = coverage(selected)
    return [f"{pair_name(pair)}: no selected test's composes mark compares it ({status.value})"
            for pair, status in covered.items() if status in _COMPARED and have.get(pair) is not status]


def module_text(covered: dict[frozenset[Feature], Status]) -> str:
    """qn_hf/config/composition_coverage.py: the pairs the marks cover, as data."""
    lines = ['"""Which pairs of features a test compares with the plain model (``Status.PLAIN``), with a configuration',
             "that is (``EQUIVALENT``), or only runs (``RUNS``): written by `make composition-table` from the tests'",
             "``@pytest.mark.composes`` marks (tests/composition_marks.py); do not edit it by hand. A pair that is not",
             'here and not a row of composition.py is untested: a run that uses it is warned."""',
             "",
             "from __future__ import annotations",
             "",
             "from .features import Feature as F",
             "from .features import Status as S",
             "",
             "COVERED: dict[frozenset[F], S] = {"]
    for pair, status in covered.items():
        first, second = ordered(pair)
        lines.append(f"    frozenset((F.{first.name}, F.{second.name})): S.{status.name},")
    lines.append("}")
    return "\n".join(lines) + "\n"
