"""Train a tiny Llama with ``qn_hf.Trainer`` (Hugging Face's ``Trainer`` loop over a dp x tp x pp mesh), offline.

Run it under torchrun or accelerate; world size = dp * tp * pp (default mesh 2 1 2: 4 processes):

    torchrun --standalone --nproc-per-node 4 scripts/train_trainer.py --output-dir runs/trainer
    accelerate launch --multi_gpu --num_processes 4 scripts/train_trainer.py --output-dir runs/trainer
    torchrun --standalone --nproc-per-node 8 scripts/train_trainer.py --mesh 2 2 2 --microbatches 2

The data is Python's reference manual (``pydoc_data.topics``, shipped with CPython) as UTF-8 bytes, cut into blocks
of ``--seq-len``; the model is the ``tiny-llama`` preset (random weights from ``--seed``). The Trainer logs every
step, evaluates at the end, writes a sharded checkpoint every ``--save-steps`` and a plain Hugging Face directory
(``OUTPUT/model``, loadable with ``from_pretrained``). Rank 0 prints one summary line.
"""

from __future__ import annotations

import argparse
import os
from pydoc_data.topics import topics

import datasets
import torch
import transformers

import qn_hf
from qn_hf.arguments import plural
from qn_hf.integrations.hf_trainer.trainer import last_complete_checkpoint
from qn_hf.training.presets import lm_preset

VOCAB, EOS = 257, 256  # bytes, and 256 ends a document


def byte_blocks(*, seq_len: int, rows: int, skip: int = 0) -> datasets.Dataset:
    """``rows`` blocks of ``seq_len`` bytes of the reference manual (after ``skip`` blocks), labels = input_ids."""
    ids = [b for text in sorted(topics.values()) for b in [*text.encode("utf-8"), EOS]]
    blocks = [ids[i:i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)][skip:skip + rows]
    return datasets.Dataset.from_dict({"input_ids": blocks, "labels": blocks})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mesh", type=int, nargs=3, default=(2, 1, 2), metavar=("DP", "TP", "PP"))
    parser.add_argument("--microbatches", type=int, default=2, help="per accumulation batch of a dp replica")
    parser.add_argument("--batch-size", type=int, default=4, help="per dp replica (per_device_train_batch_size)")
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--save-steps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default="runs/trainer")
    parser.add_argument("--no-resume", dest="resume", action="store_false",
                        help="start over, even where --output-dir holds checkpoints (by default the newest complete "
                             "one is resumed, so torchrun --max-restarts reruns this command unchanged)")
    opts = parser.parse_args()
    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))

    dp, tp, pp = opts.mesh
    torch.manual_seed(opts.seed)  # the same initial weights on every rank
    model = transformers.AutoModelForCausalLM.from_config(
        lm_preset("tiny-llama", vocab_size=VOCAB, seq_len=opts.seq_len, eos_token_id=EOS))
    args = transformers.TrainingArguments(
        output_dir=opts.output_dir, per_device_train_batch_size=opts.batch_size,
        per_device_eval_batch_size=opts.batch_size, gradient_accumulation_steps=opts.grad_accum,
        max_steps=opts.steps, learning_rate=opts.lr, warmup_steps=max(1, opts.steps // 4), lr_scheduler_type="linear",
        logging_steps=1, save_strategy="steps", save_steps=opts.save_steps, seed=opts.seed, report_to="none",
        disable_tqdm=True, use_cpu=not torch.cuda.is_available(),
    )
    global_batch = opts.batch_size * dp * opts.grad_accum
    trainer = qn_hf.Trainer(
        model=model, args=args, train_dataset=byte_blocks(seq_len=opts.seq_len, rows=global_batch * opts.steps),
        eval_dataset=byte_blocks(seq_len=opts.seq_len, rows=2 * opts.batch_size * dp, skip=global_batch * opts.steps),
        parallel=dict(dp=dp, tp=tp, pp=pp, microbatches=opts.microbatches),
    )
    # The newest checkpoint a save finished, at this mesh or another of the same world size
    trainer.train(resume_from_checkpoint=last_complete_checkpoint(opts.output_dir) if opts.resume else None)
    evaluation = trainer.evaluate()
    trainer.save_model(os.path.join(opts.output_dir, "model"))
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    if trainer.is_world_process_zero():
        print(f"done: mesh dp={dp} tp={tp} pp={pp}, {plural(len(losses), 'step')}, loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
              f"eval loss {evaluation['eval_loss']:.4f}, model in {os.path.join(opts.output_dir, 'model')}", flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
