"""``make gpu-check`` stays alive on machines without a GPU: its quick run, on gloo, runs every section's code
(the CPU's kernels, syncs counted by dispatch, dynamo with the aot_eager backend) and prints its table; the
pieces that decide what a GPU run reports are checked here without one. What has run on a GPU, when, on
which card and versions, is recorded in docs/gpu-check.md ("Runs"): nothing yet (2026-11-27: no session has
been lent a device)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check  # noqa: E402
from gpu_checks import speed, syncs  # noqa: E402


@pytest.mark.long  # the suite's time (issue 65): two minutes; its parts have tests of their own in this file
def test_gpu_check_runs_on_cpu(tmp_path):
    out = tmp_path / "rows.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the script finds qn_hf itself
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--quick", "--json", str(out)],
                          cwd=tmp_path, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert Path(report["environment"]["qn_hf"]) == ROOT / "qn_hf"  # this checkout's, not an installed copy
    rows = {(r["section"], r["case"]): r for r in report["rows"]}
    streamed = [line for line in done.stdout.splitlines() if line.startswith("GPU_CHECK_JSON ")]
    assert len(streamed) == len(report["rows"])  # one JSON line per row, as measured
    assert {rows["parity", c]["result"] for c in gpu_check.QUICK} == {"equal"}
    ring = [r for (section, _), r in rows.items() if section == "ring kernels"]
    assert len(ring) == 2 * 3 * 2 and {r["result"] for r in ring} == {"ok"}  # cp 2/4 x 3 cases x 2 dtypes
    assert rows["dp_shard", "FSDP2 groups on a 1-rank mesh, float32"]["result"] == "equal"
    assert rows["dp_shard", "parallelize(dp_shard=2) in a world of 1"]["result"] == "skipped"
    waits = [r for (section, _), r in rows.items() if section == "host syncs"]
    assert len(waits) == 4 and all(isinstance(r["syncs"], int) for r in waits)
    eager, compiled = rows["speed", "bf16 tp=1, eager, AdamW"], rows["compile", "bf16 tp=1, compiled, AdamW"]
    assert eager["result"] == compiled["result"] == "measured" and "tokens/s" in eager["detail"]
    # tp=1 without dropout: qn_hf's compiled blocks break no more than the plain model's, and never on its own hooks
    assert compiled["metrics"]["qn_hf"]["graph_breaks"] <= compiled["metrics"]["plain"]["graph_breaks"], compiled
    assert rows["speed", "first losses agree"]["result"] == "equal"
    for case in ("async save holds the state it was called with", "async save without optimizer=, a step at once"):
        assert rows["checkpoint", case]["result"] == "equal", rows["checkpoint", case]
    assert rows["checkpoint", "what asynchronous saves keep"]["result"] == "ok"
    assert rows["long", "recompute + offload + loss chunks, float32"]["result"] == "equal"
    long = [r for (section, _), r in rows.items() if section == "long"]
    assert len(long) == 6 and {r["result"] for r in long[1:]} == {"measured", "skipped"}, long  # (HF's offload: CUDA)
    assert "syncs/step" in done.stdout and "could not test" in done.stdout  # the table and what it left out


def test_one_gpu_lists_the_meshes_it_cannot_run():
    listed = gpu_check.parity_cases(1, quick=False, unit="GPUs")
    assert [c.name for c, needs in listed if needs is None] == ["plain mesh (1 process)"]
    assert {needs for _, needs in listed if needs} == {"needs 2 GPUs", "needs 4 GPUs", "needs 8 GPUs"}
    assert all(needs is None for _, needs in gpu_check.parity_cases(8, quick=False, unit="GPUs"))


def _warn_here():
    warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)


def test_sync_sites_charges_each_warning_to_its_frame():
    """The sync debug mode's warnings, counted by site: the script's frame (or qn_hf's) wins over the frames
    above it; other warnings still show."""
    with syncs.SyncSites(debug_mode=False) as sites:
        _warn_here()
        _warn_here()
        with pytest.warns(UserWarning, match="not a sync"):
            warnings.warn("not a sync", UserWarning, stacklevel=1)
    line = _warn_here.__code__.co_firstlineno + 1
    assert dict(sites.sites) == {f"test_gpu_check.py:{line}": 2}


def test_graph_breaks_are_charged_to_qn_hf_only_for_its_own_code():
    swap = "Attempted to call function marked as skipped\n  Developer context: module: torch.random, `get_rng_state`"
    assert speed.break_name(swap) == "qn_hf: get_rng_state"
    assert speed.break_name("Unsupported: data dependent operator\n  at /x/transformers/y.py") == \
        "Unsupported: data dependent operator"
