"""bf16 mixed precision against float32 on the LM results config: the same GPT-2 run at (dp, tp, pp)
= (2, 2, 2) on 8 processes, once in float32 and once with ``--mixed-precision bf16 --zero`` (bf16
compute, float32 gradients, float32 master weights and AdamW moments, 1/dp of them per rank).

    python scripts/precision_results.py        # about 10 minutes on 2 CPU cores

Writes results/gpt2_tiny_bf16.png (both loss curves) and results/precision.md (the end-of-run gap).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from qn_hf.training.metrics import read_metrics  # noqa: E402
from qn_hf.training.plots import loss_curve  # noqa: E402
from results import run  # noqa: E402

CONFIG = "configs/gpt2_tiny.yaml"
RUNS = {"fp32": [], "bf16": ["--mixed-precision", "bf16", "--zero"]}


def main() -> None:
    out, runs = ROOT / "results", ROOT / "runs" / "results"
    out.mkdir(exist_ok=True)
    runs.mkdir(parents=True, exist_ok=True)
    records = {}
    for name, extra in RUNS.items():
        where = runs / f"gpt2_tiny-{name}"
        if "--report-only" not in sys.argv:
            run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "8",
                 "scripts/train_lm.py", "--config", CONFIG, "--no-progress", "--output-dir", str(where), *extra],
                log=runs / f"gpt2_tiny-{name}.log")
        records[name] = read_metrics(str(where / "metrics.jsonl"))
    loss_curve(str(out / "gpt2_tiny_bf16.png"), title="gpt2_tiny at (2,2,2): bf16 + ZeRO-1 vs float32",
               runs=[("float32", records["fp32"]), ("bf16 mixed precision, zero=True", records["bf16"])])
    tail = max(1, len(records["fp32"]) // 10)
    mean = {k: sum(r["loss"] for r in v[-tail:]) / tail for k, v in records.items()}
    val = {k: next(r["val_loss"] for r in reversed(v) if "val_loss" in r) for k, v in records.items()}
    gap, val_gap = abs(mean["bf16"] - mean["fp32"]) / mean["fp32"], abs(val["bf16"] - val["fp32"]) / val["fp32"]
    table = ("| run | mean training loss, last 10% of steps | final validation loss |\n|---|---|---|\n"
             + "".join(f"| {k} | {mean[k]:.4f} | {val[k]:.4f} |\n" for k in records)
             + f"| relative gap | {100 * gap:.2f}% | {100 * val_gap:.2f}% |\n")
    (out / "precision.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
