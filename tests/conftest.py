import os

# Before torch is imported anywhere (spawned ranks inherit the environment): one thread per rank,
# since every test world oversubscribes two cores already, and no network.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402

from tests import suite_time  # noqa: E402
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
                  "test_elastic", "test_checkpoint_async"}


def pytest_addoption(parser):
    group = parser.getgroup("qn_hf suite time (tests/suite_time.py)")
    group.addoption("--budget", type=float, default=None, metavar="SECONDS",
                    help="stop before running when the selected tests' recorded time exceeds SECONDS")
    group.addoption("--long-slice", type=int, default=None, metavar="N",
                    help="run slice N mod K of the long tier, cut into K slices of about --slice-budget seconds")
    group.addoption("--slice-budget", type=float, default=600.0, metavar="SECONDS",
                    help="the recorded time of one slice of the long tier (default 600)")
    group.addoption("--record-durations", action="store_true",
                    help="write the executed tests' times into tests/durations.json")


def _tier(item) -> Tier:
    module = item.module.__name__.rpartition(".")[2] if item.module is not None else ""
    if module in _OWN_PROCESSES or item.get_closest_marker("processes"):  # the marker: a test that says so
        return Tier.PROCESSES
    return Tier.WORLD if "worlds" in getattr(item, "fixturenames", ()) else Tier.UNIT


def pytest_collection_modifyitems(config, items):
    """Every test's tier as a marker (``-m unit`` is ``make test-unit``: no process, about a minute)."""
    for item in items:
        item.add_marker(getattr(pytest.mark, _tier(item).value))


def pytest_collection_finish(session):
    """The long tier's slice (--long-slice) and the budget (--budget), before any test runs."""
    config, items = session.config, session.items
    recorded = suite_time.load()
    tiers = {item.nodeid: _tier(item) for item in items}
    if config.getoption("--long-slice") is not None:
        long = [item.nodeid for item in items if item.get_closest_marker("long")]
        times = suite_time.estimates(long, tiers, recorded)
        count = suite_time.slice_count(times, config.getoption("--slice-budget"))
        k = config.getoption("--long-slice") % count
        keep = set(suite_time.slices(times, count)[k])
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid not in keep])
        items[:] = [item for item in items if item.nodeid in keep]
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"the long tier's slice {k} of {count} (--long-slice {config.getoption('--long-slice')})")
    seconds = suite_time.estimates([item.nodeid for item in items], tiers, recorded)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and items:
        reporter.write_line(f"{len(items)} tests, {sum(seconds.values()) / 60:.1f} min expected from "
                            f"tests/durations.json ({sum(n not in recorded for n in seconds)} not recorded there: "
                            f"their tier's median or nominal time)")
    budget = config.getoption("--budget")
    if budget is not None:
        message = suite_time.over_budget(seconds, budget, recorded)
        if message:
            raise pytest.UsageError(message)


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
