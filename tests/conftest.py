import atexit
import os
import shutil
import tempfile
import time

# Before torch is imported anywhere (spawned ranks inherit the environment): one thread per rank,
# since every test world oversubscribes two cores already, and no network.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# inductor compiles in each rank's own process: its default pool of compile workers per rank oversubscribes two
# cores (a compiled tp=2 case took 54 s from a cold cache with the pools, 20 s without)
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# mesh="auto" without a calibration keeps this machine's figures (planner/machine.py): the suite's own, not
# the user's home's
if "QN_HF_CACHE" not in os.environ:  # the suite's run's, removed when it ends (ranks inherit it, set)
    os.environ["QN_HF_CACHE"] = tempfile.mkdtemp(prefix="qn_hf_cache.")
    atexit.register(shutil.rmtree, os.environ["QN_HF_CACHE"], ignore_errors=True)

import pytest  # noqa: E402

from qn_hf.config.composition_coverage import COVERED  # noqa: E402
from tests import composition_marks, suite_time  # noqa: E402
from tests.launcher import Worlds  # noqa: E402
from tests.models import save_tiny_models  # noqa: E402
from tests.suite_time import Tier  # noqa: E402


@pytest.fixture(scope="session")
def worlds():
    pool = Worlds()
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """Tiny GPT-2, Llama (GQA) and ViT checkpoints written once with ``save_pretrained``."""
    return save_tiny_models(tmp_path_factory.mktemp("models"))


# Modules whose tests start processes of their own (scripts, command lines, crashes on purpose).
_OWN_PROCESSES = {"test_scripts", "test_check_cli", "test_checkpoint_safety", "test_checkpoint_faults", "test_gpu_check",
                  "test_fail_together", "test_host_syncs", "test_trainer", "test_user_errors", "test_checkpoint_lock",
                  "test_elastic", "test_checkpoint_async", "test_multi_node"}


def pytest_addoption(parser):
    group = parser.getgroup("qn_hf suite time (tests/suite_time.py)")
    group.addoption("--budget", type=float, default=None, metavar="SECONDS",
                    help="stop before running when the selected tests' recorded time exceeds SECONDS")
    group.addoption("--long-slice", type=int, default=None, metavar="N",
                    help="run slice N mod K of the long tier, cut into K slices of about --slice-budget seconds")
    group.addoption("--slice-budget", type=float, default=600.0, metavar="SECONDS",
                    help="the recorded time of one slice of the long tier (default 600)")
    group.addoption("--slice-deadline", type=float, default=None, metavar="SECONDS",
                    help="with --long-slice: tests not started SECONDS after the session began are skipped, "
                         "named in the summary (default: twice --slice-budget), so the slice's time is bounded")
    group.addoption("--cover", action="store_true",
                    help="stop before running unless the selected tests run every user-facing script and cover "
                         "every pair of features the tests' composes marks cover (make test)")
    group.addoption("--composition-table", default=None, metavar="PATH",
                    help="write the pairs the tests' composes marks cover to PATH (make composition-table: "
                         "qn_hf/config/composition_coverage.py); with --collect-only")
    group.addoption("--record-durations", action="store_true",
                    help="write the executed tests' times into tests/durations.json")


def _tier(item) -> Tier:
    module = item.module.__name__.rpartition(".")[2] if item.module is not None else ""
    if module in _OWN_PROCESSES or item.get_closest_marker("processes"):  # the marker: a test that says so
        return Tier.PROCESSES
    return Tier.WORLD if "worlds" in getattr(item, "fixturenames", ()) else Tier.UNIT


_MARKED = pytest.StashKey[list]()  # every collected test as its composes marks see it (tests/composition_marks.py)


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m selection reads the marks
def pytest_collection_modifyitems(config, items):
    """Every test's tier as a marker (``-m unit`` is ``make test-unit``: no process, about a minute), and the
    ``long`` mark on every test that starts processes and is not one ``make test`` must run (``_needed``):
    what is not needed repeats ground those cover, and the long tier runs it in slices. A needed test loses a
    ``long`` mark of its own (a case a composes mark names among a function's long ones, a compiled run): the pair
    is covered in make test, or the table says it is not."""
    marked = [composition_marks.Marked.of(item) for item in items]
    config.stash[_MARKED] = marked
    for item, tested in zip(items, marked):
        tier = _tier(item)
        item.add_marker(getattr(pytest.mark, tier.value))
        if tier is Tier.UNIT:
            continue
        if _needed(item, tested):
            item.own_markers[:] = [mark for mark in item.own_markers if mark.name != "long"]
        elif item.get_closest_marker("long") is None:
            item.add_marker(pytest.mark.long)
    path = config.getoption("--composition-table")
    if path is not None:
        wrong = composition_marks.unmatched(marked)
        if wrong:
            raise pytest.UsageError("\n  ".join(["composes marks that name no test:", *wrong]))
        with open(path, "w") as out:
            out.write(composition_marks.module_text(composition_marks.coverage(marked)))


def _needed(item, tested: composition_marks.Marked) -> bool:
    """A test make test runs though it starts processes: one whose composes marks it must run for
    (``composition_marks.needed``), one that runs a user-facing script (``script``) and is not marked long, or one
    marked ``core`` (a promise's one check no pair needs: golden losses, old checkpoints, the zoos' samples)."""
    if composition_marks.needed(tested) or item.get_closest_marker("core"):
        return True
    # a script's run marked long is another run of it (resumed, under the other launcher)
    return item.get_closest_marker("long") is None and item.get_closest_marker("script") is not None


def _skipped(item) -> bool:
    """A test its own marks skip whatever happens (a sweep's unrecorded case): it takes no time."""
    if item.get_closest_marker("skip") is not None:
        return True
    return any(mark.args and mark.args[0] is True for mark in item.iter_markers("skipif"))


def pytest_collection_finish(session):
    """The long tier's slice (--long-slice) and the budget (--budget), before any test runs."""
    config, items = session.config, session.items
    recorded = suite_time.load()
    skipped = {item.nodeid for item in items if _skipped(item)}
    tiers = {item.nodeid: _tier(item) for item in items}

    def estimates(nodeids: list[str]) -> dict[str, float]:
        return {n: 0.0 if n in skipped else s for n, s in suite_time.estimates(nodeids, tiers, recorded).items()}

    if config.getoption("--long-slice") is not None:
        long = [item.nodeid for item in items if item.get_closest_marker("long")]
        times = estimates(long)
        count = suite_time.slice_count(times, config.getoption("--slice-budget"))
        k = config.getoption("--long-slice") % count
        keep = set(suite_time.slices(times, count)[k])
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid not in keep])
        items[:] = [item for item in items if item.nodeid in keep]
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"the long tier's slice {k} of {count} (--long-slice {config.getoption('--long-slice')}): "
                                f"every long test runs once in {count} consecutive slices")
        deadline = config.getoption("--slice-deadline") or 2 * config.getoption("--slice-budget")
        config.pluginmanager.register(_Deadline(deadline), "qn_hf_slice_deadline")
    seconds = estimates([item.nodeid for item in items])
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and items:
        reporter.write_line(f"{len(items)} tests, {sum(seconds.values()) / 60:.1f} min expected from "
                            f"tests/durations.json ({sum(n not in recorded and n not in skipped for n in seconds)} not recorded there: "
                            f"their tier's median or nominal time)")
    if config.getoption("--cover"):
        runs = {mark.args[0] for item in items for mark in item.iter_markers("script")}
        marked = config.stash[_MARKED]
        chosen = {item.nodeid for item in items}
        missing = (suite_time.unrun_scripts(runs) + composition_marks.unmatched(marked)
                   + composition_marks.uncovered([t for t in marked if t.nodeid in chosen], COVERED))
        if missing:
            raise pytest.UsageError("the selection leaves out what make test must cover:\n  " + "\n  ".join(missing))
    budget = config.getoption("--budget")
    if budget is not None:
        message = suite_time.over_budget(seconds, budget, recorded)
        if message:
            raise pytest.UsageError(message)


class _Deadline:
    """--long-slice: a test not started ``seconds`` after the session began is skipped, saying so (its
    slice took longer than its recorded times: `make durations` re-records them)."""

    def __init__(self, seconds: float):
        self.seconds, self.start, self.late = seconds, time.monotonic(), []

    def pytest_runtest_setup(self, item):
        if time.monotonic() - self.start > self.seconds:
            self.late.append(item.nodeid)
            pytest.skip(f"the slice's deadline ({self.seconds:.0f} s) passed: its tests took longer than "
                        f"tests/durations.json says (`make durations`)")

    def pytest_terminal_summary(self, terminalreporter):
        if self.late:
            terminalreporter.write_line(f"{len(self.late)} tests of this slice not run: its deadline passed")


class _Recorder:
    """--record-durations: each executed test's setup, call and teardown, merged into tests/durations.json."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report):
        if not (report.when == "setup" and report.outcome == "skipped"):
            self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration

    def pytest_sessionfinish(self, session):
        if self.seconds:
            suite_time.save(self.seconds, note=f"seconds per test (setup + call + teardown) on {os.cpu_count()} "
                                               f"cores, OMP_NUM_THREADS=1; `make durations` refreshes it")


def pytest_configure(config):
    if config.getoption("--record-durations"):
        config.pluginmanager.register(_Recorder(), "qn_hf_durations")
