"""Peak memory per rank of ``parallelize(meta model, checkpoint=HF dir)`` against the rank's shard.

    python benchmarks/convert.py --keep /tmp/qn_hf_1gb        # writes /tmp/qn_hf_1gb/hf (1.02 GB Llama)
    torchrun --standalone --nproc-per-node 4 benchmarks/meta_init.py /tmp/qn_hf_1gb/hf --tp 2 --pp 2

Each rank builds the model on the meta device, then parallelizes with ``checkpoint=``; it reports
its peak resident memory above what it held before (imports, meta model) and the bytes of the
parameters it ends up holding. A rank that loaded the full model first would need the whole
checkpoint (1.02 GB) on top.
"""

from __future__ import annotations

import argparse
import os
import resource

import torch
import torch.distributed as dist
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

import qn_hf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("hf_dir")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.hf_dir))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    pm = qn_hf.parallelize(model, tp=args.tp, pp=args.pp, checkpoint=args.hf_dir)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    shard = sum(p.numel() * p.element_size() for p in pm.parameters())
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, (pm.coords, shard, peak - before))
    if dist.get_rank() == 0:
        total = sum(os.path.getsize(os.path.join(args.hf_dir, f)) for f in os.listdir(args.hf_dir) if f.endswith(".safetensors"))
        print(f"checkpoint {total / 2**20:.0f} MiB; tp={args.tp} pp={args.pp}")
        for coords, shard, grew in rows:
            print(f"rank {coords}: shard {shard / 2**20:.0f} MiB, peak RSS growth {grew / 2**20:.0f} MiB ({grew / shard:.2f}x shard)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
