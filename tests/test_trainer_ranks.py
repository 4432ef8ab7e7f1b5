"""qn_hf.Trainer's TrainingArguments answer the job's ranks (issue 66 item 4): on a CPU without use_cpu=True, or under
srun without torchrun, accelerate takes every rank for a lone process 0, and every rank drew the progress bar, printed
the logs and wrote rank 0's files (``rng_state_0.pth`` from both ranks, measured under torchrun at 2 processes)."""

from __future__ import annotations

import dataclasses
import io
import pickle

import pytest
import torch
import transformers

from qn_hf.integrations.hf_trainer import args as trainer_args


@dataclasses.dataclass
class OwnArgs(transformers.TrainingArguments):  # as TRL's configs subclass it
    own: int = 3


@pytest.mark.parametrize("cls", [transformers.TrainingArguments, OwnArgs])
def test_the_arguments_answer_the_jobs_ranks(monkeypatch, tmp_path, cls):
    args = cls(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    assert (args.process_index, args.world_size) == (0, 1)  # accelerate saw no launch
    monkeypatch.setattr(trainer_args.dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(trainer_args.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(trainer_args, "local_rank", lambda: 1)
    job = trainer_args.job_args(args)
    assert isinstance(job, cls) and job is not args
    assert (job.process_index, job.local_process_index, job.world_size) == (1, 1, 2)
    assert not job.should_save and not job.should_log  # rank 0 alone writes and logs
    assert (args.process_index, args.world_size) == (0, 1)  # the caller's own object is left as it was
    for saved in (pickle.dumps(job), _torch_saved(job)):  # Trainer saves training_args.bin with torch.save
        back = pickle.loads(saved) if isinstance(saved, bytes) else torch.load(saved, weights_only=False)
        assert type(back) is cls and back.to_dict() == args.to_dict()
    if cls is OwnArgs:
        assert job.own == 3


def test_arguments_that_agree_are_kept(monkeypatch, tmp_path):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    monkeypatch.setattr(trainer_args.dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(trainer_args.dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(trainer_args, "local_rank", lambda: 0)
    assert trainer_args.job_args(args) is args


def _torch_saved(value) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return buffer
