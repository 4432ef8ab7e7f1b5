"""``qn-hf-convert`` on a checkpoint of more than 1 GB: seconds against a plain copy of the same bytes,
and peak memory against the largest tensor.

    python benchmarks/convert.py [--layers 16] [--keep DIR]

A ~254M-parameter Llama (1.02 GB in fp32) is written as a Hugging Face directory, then converted
from-hf (tp=2, pp=2), resharded (tp=4, pp=1) and converted back to-hf, each in a fresh process that
reports its own peak resident memory; the baseline is the same process importing torch,
transformers and qn_hf and converting nothing. The copy is ``shutil.copytree`` of the source.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

# Linux keeps a process's peak RSS across fork and exec, so this parent process never imports
# torch or holds the model: the model is written by a child too.
CREATE = """
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=int(sys.argv[2]), num_attention_heads=16,
                     num_key_value_heads=8, vocab_size=32000, max_position_embeddings=512)
model = LlamaForCausalLM(config)
model.save_pretrained(sys.argv[1], max_shard_size="5GB")
print("LARGEST", max(p.numel() * p.element_size() for p in model.parameters()))
"""

PROBE = """
import resource, sys, time
from qn_hf.convert import main
start = time.perf_counter()
rc = main(sys.argv[1:]) if len(sys.argv) > 1 else 0
print("RESULT", rc, time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def run(argv: list[str]) -> tuple[float, int]:
    proc = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, check=True)
    line = next(out for out in proc.stdout.splitlines() if out.startswith("RESULT"))
    _, rc, seconds, rss = line.split()
    if rc != "0":
        raise SystemExit(f"{argv}: exit {rc}\n{proc.stderr[-2000:]}")
    return float(seconds), int(rss)


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--keep", default=None, help="work in this directory and keep it")
    args = parser.parse_args()

    work = args.keep or tempfile.mkdtemp(prefix="qn_hf_convert_")
    hf = os.path.join(work, "hf")
    made = subprocess.run([sys.executable, "-c", CREATE, hf, str(args.layers)], capture_output=True, text=True, check=True)
    largest = int(next(out for out in made.stdout.splitlines() if out.startswith("LARGEST")).split()[1])
    size = dir_bytes(hf)

    _, baseline = run([])
    rows = []
    start = time.perf_counter()
    shutil.copytree(hf, os.path.join(work, "copy"), dirs_exist_ok=True)
    copy_s = time.perf_counter() - start
    rows.append(("plain copy of the HF directory", copy_s, None))
    for label, argv in (
        ("from-hf --tp 2 --pp 2", ["from-hf", hf, os.path.join(work, "ckpt"), "--tp", "2", "--pp", "2"]),
        ("reshard --tp 4 --pp 1", ["reshard", os.path.join(work, "ckpt"), os.path.join(work, "ckpt4"), "--tp", "4", "--pp", "1"]),
        ("to-hf", ["to-hf", os.path.join(work, "ckpt4"), os.path.join(work, "back")]),
    ):
        seconds, rss = run(argv)
        rows.append((label, seconds, rss))
    mib = 2**20
    print(f"Llama {args.layers} layers: {size / 1e9:.2f} GB of fp32 weights; largest tensor {largest / mib:.0f} MiB; "
          f"process baseline (imports only) {baseline / mib:.0f} MiB")
    print(f"{'step':<34}{'seconds':>9}{'x copy':>8}{'peak RSS - baseline (MiB)':>28}{'/ largest':>11}")
    for label, seconds, rss in rows:
        extra = "" if rss is None else f"{(rss - baseline) / mib:>28.0f}{(rss - baseline) / largest:>11.2f}"
        print(f"{label:<34}{seconds:>9.2f}{seconds / copy_s:>8.1f}{extra}")
    if args.keep is None:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
