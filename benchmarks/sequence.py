"""Activation memory of long sequences: sequence parallelism at tp=2, counted from real tensors.

    python benchmarks/sequence.py sp          # one Llama microbatch at sequence 8,192, tp=2, SP off/on

A tiny-width Llama (2 blocks, hidden 64, 4 heads over 2 KV heads, SDPA attention) runs one
microbatch of 1 x 8,192 tokens, float32, on each tp rank. ``LiveAllocations`` records every
storage an op creates during the forward; what is still alive when the forward returns is what
backward will read (activations and this rank's vocabulary shard of the logits). Storages made inside the modules that run between
the tensor-parallel regions (the norms of each block and the final norm) are filed under
"between", so their share is reported too: under sequence parallelism it should fall to 1/tp.
tp communication per step is counted by ``CommMeter`` (calls and payload bytes by operation).
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from torch import nn
from world import run_world

from qn_hf.comm_meter import CommMeter
from qn_hf.live_allocations import LiveAllocations
from qn_hf.sequence_parallel import position_wise

LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128, max_position_embeddings=16384, bos_token_id=1, eos_token_id=2)


def _label_between(pm, tracker: LiveAllocations) -> None:
    """File what the norms outside the tp entries (those of each block, the final norm) allocate
    under "between"."""

    def enter(*_):
        tracker.label = "between"

    def leave(*_):
        tracker.label = ""

    for name, module in pm.module.named_modules():
        inside = any(name.startswith(entry + ".") for entry in pm.plan.tp_entries)
        if position_wise(module) and not isinstance(module, (nn.Dropout, nn.Identity)) and not inside:
            module.register_forward_pre_hook(enter)
            module.register_forward_hook(leave)


def sp_worker(rank: int, world: int, path: str, seq: int, sequence_parallel: bool) -> dict:
    from transformers import LlamaForCausalLM

    import qn_hf

    pm = qn_hf.parallelize(LlamaForCausalLM.from_pretrained(path), tp=world, seed=0, sequence_parallel=sequence_parallel)
    ids = torch.randint(3, LLAMA["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    pm.train()
    tracker = LiveAllocations()
    _label_between(pm, tracker)
    with tracker:  # no labels: HF's own loss cannot take vocabulary-sharded logits
        out = pm(input_ids=ids)
    live, between = tracker.alive_bytes(), tracker.alive_bytes("between")
    del out
    with CommMeter(pm) as meter:
        pm.train_step(batch)
    ops: dict[str, list[int]] = {}
    for event in meter.events:
        if event.group == "tp":
            calls, nbytes = ops.setdefault(event.op, [0, 0])
            ops[event.op] = [calls + 1, nbytes + event.nbytes]
    return {"live": live, "between": between, "tp_ops": ops}


def sp(args: argparse.Namespace) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tempfile.mkdtemp(prefix="qn_hf_seq_")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**LLAMA)).save_pretrained(path)
    print(f"Llama 2 blocks, hidden 64, one microbatch of 1 x {args.seq} tokens, float32, tp=2; bytes alive after the "
          f"forward on rank 0 (LiveAllocations); 'between' = made inside the norms between the tp regions")
    print(f"{'sequence_parallel':<19}{'activations MiB':>16}{'between MiB':>13}{'vs off':>8}   tp traffic per step (calls, payload MiB)")
    base = None
    for sequence_parallel in (False, True):
        r = run_world(sp_worker, world=2, extra=(path, args.seq, sequence_parallel))
        base = base or r
        traffic = ", ".join(f"{op} {c} x {b / 2**20:.1f}" for op, (c, b) in sorted(r["tp_ops"].items()))
        print(f"{str(sequence_parallel):<19}{r['live'] / 2**20:>16,.1f}{r['between'] / 2**20:>13,.2f}"
              f"{r['between'] / base['between']:>8.2f}   {traffic}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=("sp",))
    parser.add_argument("--seq", type=int, default=8192)
    args = parser.parse_args()
    sp(args)


if __name__ == "__main__":
    main()
