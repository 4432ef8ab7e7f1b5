"""Everything qn_hf writes gets the mode a plain ``open(path, "w")`` gives under the user's umask,
so a serving process running as another user can read an export or a checkpoint."""

from __future__ import annotations

import json
import os
import stat

import qn_hf
from qn_hf import convert
from tests.cases import mesh_for
from tests.models import load


def case_save_everything(*, model_dir: str, out: str, ckpt: str) -> None:
    pm = qn_hf.parallelize(load("gpt2", model_dir), tp=2, mesh=mesh_for(1, 2))
    pm.save_pretrained(out, max_shard_size=20_000)  # several files and an index
    pm.save_checkpoint(ckpt, step=3)


def _modes(root: str) -> dict[str, int]:
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            found[os.path.relpath(path, root)] = stat.S_IMODE(os.stat(path).st_mode)
    return found


def unusual_modes(root: str) -> list[str]:
    """Every file or directory under ``root`` whose mode differs from what open/mkdir give."""
    umask = os.umask(0o022)
    os.umask(umask)
    out = []
    for name, mode in _modes(root).items():
        expected = (0o777 if os.path.isdir(os.path.join(root, name)) else 0o666) & ~umask
        if mode != expected:
            out.append(f"{name}: mode {oct(mode)}, a plain open/mkdir gives {oct(expected)}")
    return out


def test_exports_and_checkpoints_are_readable_like_any_file(worlds, model_dirs, tmp_path):
    out, ckpt = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    worlds.run(2, case_save_everything, model_dir=model_dirs["gpt2"], out=out, ckpt=ckpt)
    assert convert.main(["to-hf", ckpt, str(tmp_path / "to-hf")]) == 0
    assert convert.main(["from-hf", out, str(tmp_path / "from-hf"), "--tp", "1", "--pp", "1"]) == 0
    # to-hf writes the generation config save_pretrained writes (GPT-2 generates)
    assert json.loads((tmp_path / "to-hf" / "generation_config.json").read_text()) == \
        json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    for root in ("hf", "ckpt", "to-hf", "from-hf"):
        assert unusual_modes(str(tmp_path / root)) == [], root
    # exports are staged inside the output directory and moved into place: nothing of the staging is left
    assert sorted(os.listdir(tmp_path / "to-hf")) == ["config.json", "generation_config.json", "model.safetensors"]
