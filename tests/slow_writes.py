"""scripts/train_lm.py with every checkpoint shard's write delayed by QN_HF_TEST_WRITE_DELAY_S seconds,
so that a test can kill a rank by signal while a checkpoint is being written (tests/test_elastic.py).
Only the timing changes: what is written, and how, is the library's."""

from __future__ import annotations

import os
import runpy
import sys
import time
from pathlib import Path

from qn_hf.checkpoint import save

SCRIPT = str(Path(__file__).resolve().parent.parent / "scripts" / "train_lm.py")
real_write = save.ShardSnapshot.write


def slow_write(self, directory: str) -> None:
    time.sleep(float(os.environ.get("QN_HF_TEST_WRITE_DELAY_S", "3")))
    real_write(self, directory)


if __name__ == "__main__":
    save.ShardSnapshot.write = slow_write
    sys.argv = [SCRIPT, *sys.argv[1:]]
    runpy.run_path(SCRIPT, run_name="__main__")
