"""Train an image classifier (ViTForImageClassification, ...) with qn_hf's 3D parallelism.

Run it under torchrun or accelerate; world size = dp * tp * pp:

    torchrun --standalone --nproc-per-node 8 scripts/train_vit.py --mesh 2 2 2 --microbatches 4
    accelerate launch --multi_gpu --num_processes 8 scripts/train_vit.py --config configs/vit_digits.yaml
    python scripts/train_vit.py --steps 100                # one process, dp=tp=pp=1

--model is a local Hugging Face directory or the tiny-vit preset. With no --data it trains offline
on scikit-learn's bundled 8x8 digits; --data takes an image folder (class per subdirectory) or
parquet files with image and label columns. Outputs as for train_lm.py, with validation accuracy.
"""

from __future__ import annotations

import transformers

from qn_hf.training.config import build_parser, load_config
from qn_hf.training.errors import run_cli
from qn_hf.training.loop import train


def main() -> None:
    args = build_parser(task="vit", description=__doc__).parse_args()
    transformers.logging.set_verbosity_error()
    train(load_config(args))


if __name__ == "__main__":
    run_cli(main)
