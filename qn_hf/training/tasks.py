"""What differs between language modelling and image classification: data, model config, batches
and validation metrics. The loop in ``loop.py`` is the same for both.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch
from datasets import Dataset
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageClassification, PretrainedConfig

from ..arguments import plural
from ..config.options import IGNORE_INDEX
from ..config.sequence import sequence_split
from ..parallel_model import ParallelModel
from .config import TrainConfig
from .data_images import DIGITS_CHANNELS, DIGITS_SIZE, check_image_data, load_image_data
from .data_text import check_text_files, load_lm_data, tokenizer_source
from .errors import UsageError
from .presets import LM_PRESETS, PRESETS, lm_preset, vit_preset
from .sampler import eval_batches


def model_directory(model: str) -> str | None:
    """The model directory, or None for a preset; a clear error for anything else."""
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise UsageError(f"model directory {model} has no config.json (is it a Hugging Face model directory?)")
        return model
    if model in PRESETS:
        return None
    raise UsageError(f"model {model!r} is neither a directory with config.json nor a preset ({', '.join(PRESETS)})")


@dataclass
class Prepared:
    config: PretrainedConfig
    train: Dataset
    val: Dataset
    description: str  # data and tokenizer, for the log


class LmTask:
    name = "lm"
    auto_class = AutoModelForCausalLM
    unit = "tokens_per_s"

    def check(self, cfg: TrainConfig, model_dir: str | None) -> None:
        if model_dir is None and cfg.model not in LM_PRESETS:
            raise UsageError(f"{cfg.model} is not a language-model preset; choose one of {LM_PRESETS} or a model directory")
        if cfg.data:
            check_text_files(cfg.data)
        tokenizer_source(tokenizer=cfg.tokenizer, model_dir=model_dir)
        if cfg.auto:
            return  # the planner chooses only splits seq_len allows, and train() checks its choice here again
        tp = cfg.mesh[1] if cfg.mesh is not None else 1
        # the library's rule for how cp and sequence parallelism cut a sequence, checked before any step
        multiple, why = sequence_split(cp=cfg.cp, tp=tp, sequence_parallel=cfg.sequence_parallel)
        if cfg.seq_len % multiple:
            raise UsageError(f"seq_len={cfg.seq_len} is not a multiple of {multiple} ({why}); use a --seq-len that is")

    def prepare(self, cfg: TrainConfig, model_dir: str | None) -> Prepared:
        tok_dir = tokenizer_source(tokenizer=cfg.tokenizer, model_dir=model_dir)
        data = load_lm_data(data=cfg.data, text_column=cfg.text_column, seq_len=cfg.seq_len,
                            val_fraction=cfg.val_fraction, tokenizer_dir=tok_dir)
        if model_dir is None:
            config = lm_preset(cfg.model, vocab_size=data.vocab_size, seq_len=cfg.seq_len, eos_token_id=data.eos_token_id)
        else:
            config = AutoConfig.from_pretrained(model_dir)
            if data.vocab_size > config.vocab_size:
                raise UsageError(f"the tokenizer ({data.tokenizer}) has {data.vocab_size} tokens but the model's "
                                 f"vocab_size is {config.vocab_size}; pass the model's own --tokenizer")
            positions = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
            if positions is not None and cfg.seq_len > positions:
                raise UsageError(f"seq_len={cfg.seq_len} exceeds the model's {positions} positions; use --seq-len {positions} or less")
        return Prepared(config=config, train=data.train, val=data.val,
                        description=f"{data.source}; tokenizer {data.tokenizer}; {plural(len(data.train), 'training block')} "
                                    f"and {plural(len(data.val), 'validation block')} of {cfg.seq_len} tokens")

    def positions(self, cfg: TrainConfig, config: PretrainedConfig) -> int:
        """The sequence length the planner prices (mesh auto)."""
        return cfg.seq_len

    def batch(self, rows: dict[str, Any]) -> dict[str, torch.Tensor]:
        ids = rows["input_ids"]
        return {"input_ids": ids, "labels": ids.clone()}

    def units(self, batch: dict[str, torch.Tensor]) -> int:
        return batch["input_ids"].numel()

    def evaluate(self, pm: ParallelModel, val: Dataset, *, cfg: TrainConfig) -> dict[str, float]:
        loss, _ = _evaluate(pm, val, cfg=cfg, task=self, count_correct=False)
        return {"val_loss": loss, "val_perplexity": math.exp(min(loss, 50.0))}


class VitTask:
    name = "vit"
    auto_class = AutoModelForImageClassification
    unit = "images_per_s"

    def check(self, cfg: TrainConfig, model_dir: str | None) -> None:
        if model_dir is None and cfg.model != "tiny-vit":
            raise UsageError(f"{cfg.model} is not an image-classification preset; use tiny-vit or a model directory")
        if cfg.data:
            check_image_data(cfg.data)

    def prepare(self, cfg: TrainConfig, model_dir: str | None) -> Prepared:
        if model_dir is not None:
            config = AutoConfig.from_pretrained(model_dir)
            size, channels = config.image_size, config.num_channels
        else:
            config = None
            size, channels = (DIGITS_SIZE, DIGITS_CHANNELS) if not cfg.data else (32, 3)
        data = load_image_data(data=cfg.data, image_column=cfg.image_column, label_column=cfg.label_column,
                               image_size=size, num_channels=channels, val_fraction=cfg.val_fraction, seed=cfg.seed)
        if config is None:
            config = vit_preset(image_size=size, num_channels=channels, labels=data.labels)
        elif config.num_labels != len(data.labels):
            raise UsageError(f"the model has num_labels={config.num_labels} but the data has {plural(len(data.labels), 'class')}")
        return Prepared(config=config, train=data.train, val=data.val,
                        description=f"{data.source}; {plural(len(data.labels), 'class')}; images {channels}x{size}x{size}")

    def positions(self, cfg: TrainConfig, config: PretrainedConfig) -> int:
        """The sequence length the planner prices (mesh auto): the patches and the class token."""
        return (config.image_size // config.patch_size) ** 2 + 1

    def batch(self, rows: dict[str, Any]) -> dict[str, torch.Tensor]:
        return {"pixel_values": rows["pixel_values"], "labels": rows["labels"]}

    def units(self, batch: dict[str, torch.Tensor]) -> int:
        return batch["labels"].numel()

    def evaluate(self, pm: ParallelModel, val: Dataset, *, cfg: TrainConfig) -> dict[str, float]:
        loss, accuracy = _evaluate(pm, val, cfg=cfg, task=self, count_correct=True)
        return {"val_loss": loss, "val_accuracy": accuracy}


TASK_TYPES = {"lm": LmTask, "vit": VitTask}


def _evaluate(pm: ParallelModel, val: Dataset, *, cfg: TrainConfig, task: Any, count_correct: bool) -> tuple[float, float]:
    """Mean validation loss over every example (padding rows masked) and, for classification, the
    fraction classified correctly. Every dp rank evaluates its slice of each global batch."""
    dp, rank = pm.dims.dp, pm.coords.dp
    per = cfg.batch_size // dp
    loss_sum = correct = seen = 0.0
    for rows, real in eval_batches(len(val), batch_size=cfg.batch_size, limit=cfg.eval_batches):
        local = rows[rank * per : (rank + 1) * per]
        batch = task.batch(val[local])
        padded = torch.arange(rank * per, (rank + 1) * per) >= real
        batch["labels"] = batch["labels"].masked_fill(padded.view(-1, *([1] * (batch["labels"].dim() - 1))), IGNORE_INDEX)
        loss_sum += pm.eval_step(batch).item() * real
        if count_correct:
            # loss_fn values are averaged over microbatches and dp ranks: scale back to a count.
            hits = pm.eval_step(batch, loss_fn=lambda out, mb: (out.logits.argmax(-1) == mb["labels"]).sum().float())
            correct += round(hits.item() * pm.microbatches * dp)
        seen += real
    return loss_sum / seen, correct / seen
