import os

# Before torch is imported anywhere (spawned ranks inherit the environment): one thread per rank,
# since every test world oversubscribes two cores already, and no network.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402

from tests.launcher import Worlds  # noqa: E402
from tests.models import save_tiny_models  # noqa: E402


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


def pytest_collection_modifyitems(config, items):
    """The unit tier (``make test-unit``, ``-m unit``): every test that starts no process, neither a
    gloo world (the ``worlds`` fixture) nor a command line, and is not a command line's end-to-end run
    (``*cli*``: the planner's searches take seconds each); it runs in about a minute."""
    for item in items:
        module = item.module.__name__.rpartition(".")[2] if item.module is not None else ""
        if ("worlds" not in getattr(item, "fixturenames", ()) and module not in _OWN_PROCESSES
                and "cli" not in item.name):
            item.add_marker(pytest.mark.unit)
