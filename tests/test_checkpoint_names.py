"""A checkpoint is named by the training step it holds, also after qn-hf-convert."""

from __future__ import annotations

import json
import os

import qn_hf
from qn_hf import convert
from qn_hf.checkpoint import checkpoint_dir
from qn_hf.checkpoint.lock import LOCK_FILE
from tests.cases import error_message, mesh_for
from tests.models import load


def case_saves(*, model_dir: str, ckpt: str) -> list[str]:
    pm = qn_hf.parallelize(load("gpt2", model_dir), tp=2, mesh=mesh_for(1, 2))
    names = [os.path.basename(pm.save_checkpoint(ckpt, step=20))]
    names.append(os.path.basename(pm.save_checkpoint(ckpt, step=20)))  # the same step again
    names.append(os.path.basename(pm.save_checkpoint(ckpt)))  # no step: the number after the current one
    names.append(os.path.basename(pm.save_checkpoint(ckpt, step=30)))
    names.append(error_message(lambda: pm.save_checkpoint(ckpt, step=-1)))
    return names


def test_checkpoints_are_named_by_their_step(worlds, model_dirs, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    names = worlds.run(2, case_saves, model_dir=model_dirs["gpt2"], ckpt=ckpt)[0]
    assert names[:4] == ["ckpt-000020", "ckpt-000020.1", "ckpt-000021", "ckpt-000030"], names
    assert names[4].startswith("step=-1 must be a non-negative integer"), names[3]
    # the default retention (keep_last=3) keeps the newest three; older ones only are removed
    assert sorted(os.listdir(ckpt)) == [LOCK_FILE, "ckpt-000020.1", "ckpt-000021", "ckpt-000030", "latest"]

    assert convert.main(["reshard", ckpt, str(tmp_path / "resharded"), "--tp", "1", "--pp", "1"]) == 0
    resharded = checkpoint_dir(str(tmp_path / "resharded"))
    assert os.path.basename(resharded) == "ckpt-000030"
    assert convert.main(["from-hf", model_dirs["gpt2"], str(tmp_path / "from-hf"), "--tp", "1", "--pp", "1"]) == 0
    started = checkpoint_dir(str(tmp_path / "from-hf"))
    assert os.path.basename(started) == "ckpt-000000"
    steps = [json.load(open(os.path.join(d, "index.json")))["step"] for d in (resharded, started)]
    assert steps == [30, 0]


def test_convert_help_explains_every_argument():
    parser = convert.build_parser()
    subcommands = next(a for a in parser._actions if a.dest == "command").choices  # argparse has no public view
    assert sorted(subcommands) == ["from-hf", "reshard", "to-hf"]
    for command, sub in subcommands.items():
        for action in sub._actions:
            assert action.help, f"qn-hf-convert {command}: {action.dest} has no help text"
