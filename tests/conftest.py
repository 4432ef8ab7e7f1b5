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
