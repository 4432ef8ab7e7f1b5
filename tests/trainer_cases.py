"""``qn_hf.Trainer`` jobs (every rank) and the one-process ``transformers.Trainer`` run they are compared with."""

from __future__ import annotations

import os

import torch

from tests.cases import error_message, mesh_for
from tests.models import CONFIGS, load

SEQ = 16
TRAIN_ROWS = 40  # not a multiple of every global batch: epochs turn over inside the 12 steps
EVAL_ROWS = 10  # the last eval batch is short, so it is padded with rows that carry no loss


def token_dataset(rows: int, *, seed: int):
    """Equal-length sequences of the tiny Llama's tokens (no padding), labels = input_ids."""
    import datasets

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, CONFIGS["llama"].vocab_size, (rows, SEQ), generator=gen).tolist()
    return datasets.Dataset.from_dict({"input_ids": ids, "labels": ids})


def training_args(out_dir: str, *, batch: int, eval_batch: int, accumulation: int, max_grad_norm: float,
                  steps: int = 12, save_steps: int = 0, eval_steps: int = 0):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=batch, per_device_eval_batch_size=eval_batch,
        gradient_accumulation_steps=accumulation, max_steps=steps, learning_rate=3e-3, warmup_steps=3,
        lr_scheduler_type="linear", weight_decay=0.01, max_grad_norm=max_grad_norm, logging_steps=1, seed=7,
        report_to="none", disable_tqdm=True, save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500, eval_strategy="steps" if eval_steps else "no", eval_steps=eval_steps or None,
        use_cpu=True,
    )


def history(state) -> dict:
    logs = state.log_history
    return {"loss": [r["loss"] for r in logs if "loss" in r], "grad_norm": [r["grad_norm"] for r in logs if "loss" in r],
            "lr": [r["learning_rate"] for r in logs if "loss" in r], "step": [r["step"] for r in logs if "loss" in r],
            "eval_loss": [r["eval_loss"] for r in logs if "eval_loss" in r]}


LORA_TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]


def model_for(model_dir: str, *, lora: bool):
    """The tiny Llama, or it under peft's LoRA (random A and B, the same on every rank and in one process)."""
    from tests.peft_cases import lora_model

    return lora_model("llama", model_dir, targets=LORA_TARGETS) if lora else load("llama", model_dir)


def reference(*, model_dir: str, out_dir: str, batch: int, accumulation: int, max_grad_norm: float,
              eval_steps: int = 0, lora: bool = False, steps: int = 12) -> dict:
    """``transformers.Trainer`` in this (one) process with the global batch sizes."""
    import transformers

    model = model_for(model_dir, lora=lora)
    args = training_args(out_dir, batch=batch, eval_batch=4, accumulation=accumulation, max_grad_norm=max_grad_norm,
                         eval_steps=eval_steps, steps=steps)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=token_dataset(TRAIN_ROWS, seed=1),
                                   eval_dataset=token_dataset(EVAL_ROWS, seed=2))
    trainer.train()
    out = history(trainer.state)
    out["final_eval"] = trainer.evaluate()["eval_loss"]
    trainer.save_model(out_dir + "/model")
    out["model_dir"] = out_dir + "/model"
    return out


def parallel_train(*, model_dir: str, out_dir: str, dp: int, tp: int, pp: int, microbatches: int, batch: int,
                   accumulation: int, max_grad_norm: float, save_steps: int = 0, eval_steps: int = 0,
                   resume: str | None = None, zero: bool = False, lora: bool = False,
                   extra: dict | None = None, cp: int = 1, steps: int = 12) -> dict:
    """``qn_hf.Trainer`` at (dp, tp, pp, cp): per-device batch ``batch`` (global ``batch * dp``); ``extra``:
    more ``parallel=`` keywords (a schedule, recompute, sequence_parallel)."""
    import qn_hf

    args = training_args(out_dir, batch=batch, eval_batch=4 // dp, accumulation=accumulation,
                         max_grad_norm=max_grad_norm, save_steps=save_steps, eval_steps=eval_steps, steps=steps)
    trainer = qn_hf.Trainer(model=model_for(model_dir, lora=lora), args=args,
                            train_dataset=token_dataset(TRAIN_ROWS, seed=1),
                            eval_dataset=token_dataset(EVAL_ROWS, seed=2),
                            parallel=dict(dp=dp, tp=tp, pp=pp, microbatches=microbatches, zero=zero, cp=cp,
                                          mesh=mesh_for(dp, tp, pp, cp), **(extra or {})))
    trainer.train(resume_from_checkpoint=resume)
    out = history(trainer.state)
    out["final_eval"] = trainer.evaluate()["eval_loss"]
    out["total_batch"] = trainer.get_total_train_batch_size(args)
    trainer.save_model(out_dir + "/model")
    return out


def auto_train(*, model_dir: str, out_dir: str, parallel, batch: int, accumulation: int, max_grad_norm: float,
               eval_steps: int = 0) -> dict:
    """``qn_hf.Trainer`` with ``parallel="auto"`` (or ``dict(mesh="auto", ...)``): per-device batch ``batch`` per
    process (global ``batch x processes x accumulation``); also what was chosen."""
    import torch.distributed as dist

    import qn_hf

    world = int(os.environ["WORLD_SIZE"])
    args = training_args(out_dir, batch=batch, eval_batch=4 // world, accumulation=accumulation,
                         max_grad_norm=max_grad_norm, eval_steps=eval_steps)
    trainer = qn_hf.Trainer(model=model_for(model_dir, lora=False), args=args,
                            train_dataset=token_dataset(TRAIN_ROWS, seed=1),
                            eval_dataset=token_dataset(EVAL_ROWS, seed=2), parallel=parallel)
    trainer.train()
    out = history(trainer.state)
    out["final_eval"] = trainer.evaluate()["eval_loss"]
    out["total_batch"] = trainer.get_total_train_batch_size(args)
    out["chosen"] = trainer.pm.parallel_config
    out["choice"] = trainer.auto_choice.config
    out["world"] = dist.get_world_size()
    trainer.save_model(out_dir + "/model")
    return out


def bad_inputs(*, model_dir: str, out_dir: str) -> dict[str, str]:
    """Each mistake's message on this rank (the same on every rank, before any training)."""
    import qn_hf

    def make(parallel=None, optimizers=(None, None), **overrides):
        args = training_args(out_dir, batch=2, eval_batch=2, accumulation=1, max_grad_norm=1.0)
        for key, value in overrides.items():
            setattr(args, key, value)
        return qn_hf.Trainer(model=load("llama", model_dir), args=args, train_dataset=token_dataset(8, seed=1),
                             optimizers=optimizers, parallel=parallel or dict(tp=2, pp=2, mesh=mesh_for(1, 2, 2)))

    def stale_optimizer():
        model = load("llama", model_dir)
        opt = torch.optim.AdamW(model.parameters())
        args = training_args(out_dir, batch=2, eval_batch=2, accumulation=1, max_grad_norm=1.0)
        qn_hf.Trainer(model=model, args=args, train_dataset=token_dataset(8, seed=1), optimizers=(opt, None),
                      parallel=dict(tp=2, pp=2, mesh=mesh_for(1, 2, 2)))

    def given_parallel_model():
        pm = qn_hf.parallelize(load("llama", model_dir), tp=2, pp=2, microbatches=2, mesh=mesh_for(1, 2, 2))
        args = training_args(out_dir, batch=2, eval_batch=2, accumulation=1, max_grad_norm=1.0)
        args.label_smoothing_factor = 0.1
        qn_hf.Trainer(model=pm, args=args, train_dataset=token_dataset(8, seed=1))

    def predict():
        make().predict(token_dataset(4, seed=3))

    return {
        "world": error_message(lambda: make(parallel=dict(dp=1, tp=1, pp=2))),
        "parallel_model": error_message(given_parallel_model),
        "predict": error_message(predict),
        "checkpointing": error_message(lambda: make(gradient_checkpointing=True)),
        "bf16": error_message(lambda: make(bf16=True)),
        "optimizer": error_message(stale_optimizer),
    }


def sft(*, out_dir: str, parallel: dict | None = None) -> list[float]:
    """TRL's SFTTrainer, plain (``parallel`` None, one process) or through ``qn_hf.ParallelTrainerMixin``; returns
    the logged losses of 6 steps. SFTConfig defaults to gradient checkpointing and bf16, which the mixin refuses."""
    import transformers
    import trl
    from tokenizers import Tokenizer, models

    import qn_hf

    vocab = {f"t{i}": i for i in range(CONFIGS["llama"].vocab_size)}
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")), pad_token="t0", eos_token="t2")
    dataset = token_dataset(TRAIN_ROWS, seed=1).remove_columns("labels")
    args = trl.SFTConfig(output_dir=out_dir, per_device_train_batch_size=4 // (parallel or {}).get("dp", 1),
                         max_steps=6, learning_rate=3e-3, warmup_steps=2, logging_steps=1, seed=7, report_to="none",
                         disable_tqdm=True, use_cpu=True, max_length=None, gradient_checkpointing=False, bf16=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS["llama"])
    if parallel is None:
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    else:
        class ParallelSFT(qn_hf.ParallelTrainerMixin, trl.SFTTrainer):
            pass

        trainer = ParallelSFT(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                              parallel={**parallel, "mesh": mesh_for(parallel["dp"], parallel["tp"], parallel["pp"])})
    trainer.train()
    return [r["loss"] for r in trainer.state.log_history if "loss" in r]


def dropout_streams(*, model_dir: str, out_dir: str) -> dict:
    """The device generator (qn_hf's shared dropout stream) after the Trainer is built and after a
    checkpoint is resumed: Trainer seeds it with args.seed on every rank; qn_hf's differs per dp replica."""
    import hashlib

    import qn_hf

    def digest() -> str:
        return hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest()[:12]

    args = training_args(out_dir, batch=2, eval_batch=2, accumulation=1, max_grad_norm=1.0, steps=2, save_steps=1)
    trainer = qn_hf.Trainer(model=load("llama", model_dir), args=args, train_dataset=token_dataset(8, seed=1),
                            parallel=dict(dp=2, tp=2, mesh=mesh_for(2, 2)))
    built = digest()
    trainer.train()
    trainer._load_rng_state(f"{out_dir}/checkpoint-1")
    return {"dp": trainer.pm.coords["dp"], "built": built, "resumed": digest()}


def reward(*, out_dir: str, parallel: dict | None = None, margin: bool = False) -> list[float]:
    """TRL's RewardTrainer on a LlamaForSequenceClassification (one label: a reward model), plain (``parallel``
    None, one process) or through ``qn_hf.ParallelTrainerMixin``; returns the logged losses of 6 steps."""
    import datasets
    import transformers
    import trl
    from tokenizers import Tokenizer, models

    import qn_hf

    vocab = {f"t{i}": i for i in range(CONFIGS["llama"].vocab_size)}
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")), pad_token="t0", eos_token="t2")
    gen = torch.Generator().manual_seed(3)

    def text(length: int) -> str:
        return " ".join(f"t{i}" for i in torch.randint(3, CONFIGS["llama"].vocab_size, (length,), generator=gen).tolist())

    rows = {"chosen": [text(SEQ) for _ in range(24)], "rejected": [text(SEQ) for _ in range(24)]}
    if margin:
        rows["margin"] = torch.rand(24, generator=gen).tolist()
    dataset = datasets.Dataset.from_dict(rows)
    dp = (parallel or {}).get("dp", 1)
    args = trl.RewardConfig(output_dir=out_dir, per_device_train_batch_size=4 // dp, max_steps=6, learning_rate=3e-3,
                            warmup_steps=2, logging_steps=1, seed=7, report_to="none", disable_tqdm=True, use_cpu=True,
                            gradient_checkpointing=False, bf16=False, max_length=None, center_rewards_coefficient=0.01)
    config = transformers.LlamaConfig(**{**CONFIGS["llama"].to_dict(), "num_labels": 1, "pad_token_id": 0})
    torch.manual_seed(0)
    model = transformers.LlamaForSequenceClassification(config)
    if parallel is None:
        trainer = trl.RewardTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    else:
        class ParallelReward(qn_hf.ParallelTrainerMixin, trl.RewardTrainer):
            pass

        trainer = ParallelReward(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                                 parallel={**parallel, "mesh": mesh_for(parallel["dp"], parallel["tp"], parallel["pp"])})
    trainer.train()
    return [r["loss"] for r in trainer.state.log_history if "loss" in r]
