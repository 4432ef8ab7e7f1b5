"""Train a causal language model (GPT-2, Llama, ...) with qn_hf's 3D parallelism.

Run it under torchrun or accelerate; world size = dp * tp * pp * cp:

    torchrun --standalone --nproc-per-node 8 scripts/train_lm.py --model tiny-llama --mesh 2 2 2 --microbatches 4
    accelerate launch --multi_gpu --num_processes 8 scripts/train_lm.py --config configs/llama_tiny.yaml
    python scripts/train_lm.py --steps 50                  # one process, dp=tp=pp=1
    torchrun --standalone --nproc-per-node 2 scripts/train_lm.py --model tiny-qwen3-moe --mesh 2 1 1 --ep 2
    torchrun --standalone --nproc-per-node 4 scripts/train_lm.py --model tiny-llama --mesh 4 1 1 --dp-shard 2  # FSDP
    torchrun --standalone --nproc-per-node 4 scripts/train_lm.py --model tiny-llama --mesh 1 2 1 --cp 2 --sequence-parallel
    torchrun --standalone --nproc-per-node 4 scripts/train_lm.py --model tiny-llama --mesh auto --calibration machine.json

--dp-shard S shards weights, gradients and optimizer state over groups of S dp ranks (FSDP);
--cp C splits every sequence over C more ranks (ring attention); --sequence-parallel splits the
activations between tensor-parallel regions over tp. Each option is also a YAML key (dp_shard: 2).
--mesh auto lets the planner choose the mesh, schedule and microbatches (the fastest it predicts that
fits, at the machine's --calibration file from qn-hf-plan --calibrate, else at stated GPU figures),
keeping the parallel options given; config.yaml records its choice.

--model is a local Hugging Face directory (read shard by shard, never whole on one rank) or a
preset (tiny-gpt2, tiny-llama, tiny-qwen3-moe: a mixture of experts, whose
experts --ep shards). With no --data it trains offline on Python's reference manual.
Outputs in --output-dir: metrics.jsonl, loss.png, timeline.png (pp > 1), checkpoints/, model/
(a Hugging Face directory), summary.json, config.yaml (the effective options).
"""

from __future__ import annotations

import transformers

from qn_hf.training.config import build_parser, load_config
from qn_hf.training.errors import run_cli
from qn_hf.training.loop import train


def main() -> None:
    args = build_parser(task="lm", description=__doc__).parse_args()
    transformers.logging.set_verbosity_error()
    train(load_config(args))


if __name__ == "__main__":
    run_cli(main)
