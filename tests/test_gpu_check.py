"""``make gpu-check`` stays alive on machines without a GPU: its quick run, on gloo, prints its table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_runs_on_cpu(tmp_path):
    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--quick", "--json", str(out)],
                          cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    rows = {r["case"]: r for r in json.loads(out.read_text())}
    assert {rows[c]["result"] for c in ("plain mesh (1 process)", "tp=2", "pp=2 1f1b", "cp=2 (ring attention)")} == {"equal"}
    assert rows["throughput bf16 tp=1"]["result"] == "measured" and "tokens/s" in rows["throughput bf16 tp=1"]["detail"]
    assert "case" in done.stdout and "syncs/step" in done.stdout  # the table itself
