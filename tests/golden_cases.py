"""The golden-loss cases (tests/test_golden.py): a handful of (model, mesh, schedule) runs whose losses
over a few AdamW steps are kept, bit for bit, in ``tests/golden_losses.json``.

Every case runs on 4 ranks (one persistent world) and spans one dimension or schedule the others do not:
dp, dp_shard, tp with sequence parallelism, each pipeline schedule, cp and ep. The cases are data; the
one function below runs any of them."""

from __future__ import annotations

import platform
from pathlib import Path

import torch
import transformers

import qn_hf
from tests.cases import mesh_for
from tests.models import dp_slice, load, make_batch

STEPS = 3
WORLD = 4
ROWS = 8  # the global batch: 8 sequences of 12 tokens, the same at every mesh

# name -> (model kind, parallelize's keywords)
CASES: dict[str, tuple[str, dict]] = {
    "llama-dp4": ("llama", dict(dp=4)),
    "llama-dp4-shard2": ("llama", dict(dp=4, dp_shard=2)),
    "llama-dp2-tp2-sp": ("llama", dict(dp=2, tp=2, sequence_parallel=True)),
    "llama-dp2-pp2-1f1b": ("llama", dict(dp=2, pp=2, microbatches=4, schedule="1f1b")),
    "llama-dp2-pp2-gpipe": ("llama", dict(dp=2, pp=2, microbatches=4, schedule="gpipe")),
    "llama-dp2-pp2-interleaved": ("llama", dict(dp=2, pp=2, microbatches=4, schedule="interleaved_1f1b",
                                                virtual_stages=2)),
    "llama-dp2-pp2-zb_h1": ("llama", dict(dp=2, pp=2, microbatches=4, schedule="zb_h1")),
    "llama-dp2-cp2": ("llama", dict(dp=2, cp=2)),
    "qwen3_moe-dp2-tp2-ep4": ("qwen3_moe", dict(dp=2, tp=2, ep=4)),
}


def _processor() -> str:
    """The CPU's family and model: two AVX512 generations differ in the last bit of a float32 loss (the qwen3_moe
    case's first loss on an Emerald Rapids is one ulp from the one recorded elsewhere, same torch and code), so
    the capability alone does not name the kernels' bits."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.processor()
    return f"{fields.get('vendor_id', '?')} family {fields.get('cpu family', '?')} model {fields.get('model', '?')}"


def environment() -> dict[str, str]:
    """What decides the bits of a float32 CPU run besides qn_hf's code (recorded beside exact numbers)."""
    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "machine": platform.machine(),
            "processor": _processor()}


def golden_run(*, name: str, model_dir: str) -> list[str]:
    """The case's losses (every rank reports the global loss) as ``float.hex`` strings."""
    kind, settings = CASES[name]
    dims = {d: settings.get(d, 1) for d in ("dp", "tp", "pp", "cp")}
    assert dims["dp"] * dims["tp"] * dims["pp"] * dims["cp"] == WORLD, name
    torch.manual_seed(0)
    pm = qn_hf.parallelize(load(kind, model_dir), **settings, seed=0,
                           mesh=mesh_for(dims["dp"], dims["tp"], dims["pp"], dims["cp"]))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, weight_decay=0.01)
    losses = []
    for step in range(STEPS):
        batch = dp_slice(make_batch(kind, size=ROWS, seed=40 + step), dp=dims["dp"], dp_rank=pm.coords["dp"])
        opt.zero_grad()
        losses.append(pm.train_step(batch).item().hex())
        opt.step()
    return losses
