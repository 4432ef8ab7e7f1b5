"""What checkpoint writers and converters must never do (issue 31): drop a tensor (a head, when the
config names no class), invent values (shapes the config does not give), delete checkpoints they did
not write, write through a link left in the output directory, leave a half-replaced export, or let
a hostile index cost unbounded memory and time or fail with anything but a one-line error."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GPT2LMHeadModel, LlamaForCausalLM

from qn_hf import convert
from qn_hf.checkpoint import VERSION, CheckpointError, checkpoint_dir, read_index
from qn_hf.checkpoint.files import file_digest
from qn_hf.checkpoint.lock import LOCK_FILE
from qn_hf.checkpoint.seal import seal, write_index
from tests.cases import mesh_for
from tests.models import CONFIGS

ROOT = Path(__file__).resolve().parent.parent
VICTIM = b"not yours\n"


def _hf_dir(path: Path, kind: str, *, architectures: bool = False, rows: int | None = None, **config) -> Path:
    """A tiny model's HF directory as training-script presets leave it: config.json without
    ``architectures`` (a model built with ``from_config``); ``rows`` cuts the vocabulary tensors."""
    torch.manual_seed(0)
    conf = type(CONFIGS[kind])(**{**CONFIGS[kind].to_dict(), **config})
    model = AutoModelForCausalLM.from_config(conf)
    path.mkdir(parents=True)
    conf.architectures = [type(model).__name__] if architectures else None
    conf.save_pretrained(path)
    state = {n: (t[:rows] if rows and t.shape[0] == conf.vocab_size else t).contiguous()
             for n, t in model.state_dict().items() if not (n == "lm_head.weight" and conf.tie_word_embeddings)}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _first_in_suite(count: int, cases: list[tuple]) -> list:
    """The first ``count`` cases in make test, the others long (the suite's time, issue 65): each case is a
    process of qn-hf-convert's, seconds each, and every case meets the same one-line error path."""
    return [case if i < count else pytest.param(*case, marks=pytest.mark.long) for i, case in enumerate(cases)]


def _run(*args: str) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-m", "qn_hf.convert", *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    return proc.returncode, proc.stderr.strip()


def _index(ckpt: str) -> dict:
    with open(os.path.join(checkpoint_dir(ckpt), "index.json")) as f:
        return json.load(f)


def _victim(path: Path) -> Path:
    path.write_bytes(VICTIM)
    return path


# -- 1: every tensor kept, the class recorded ---------------------------------------------------------
def test_converters_keep_the_head_of_a_config_without_architectures(tmp_path):
    hf = _hf_dir(tmp_path / "hf", "llama")
    saved = load_file(str(hf / "model.safetensors"))
    assert "lm_head.weight" in saved and len(saved) == 39
    ckpt = str(tmp_path / "ckpt")
    assert convert.main(["from-hf", str(hf), ckpt, "--tp", "2", "--pp", "2"]) == 0
    index = _index(ckpt)
    assert index["config"]["architectures"] == ["LlamaForCausalLM"]
    assert len(index["tensors"]) == 39 and "lm_head.weight" in index["tensors"]
    # reshard into the same directory: the source stays, the new one keeps the head too
    assert convert.main(["reshard", ckpt, ckpt, "--tp", "1", "--pp", "1"]) == 0
    assert sorted(os.listdir(ckpt)) == [LOCK_FILE, "ckpt-000000", "ckpt-000000.1", "latest"]
    assert len(_index(ckpt)["tensors"]) == 39
    assert convert.main(["to-hf", ckpt, str(tmp_path / "out")]) == 0
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert exported.keys() == saved.keys() and all(torch.equal(exported[n], saved[n]) for n in saved)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_a_tied_head_without_architectures_round_trips(tmp_path):
    hf = _hf_dir(tmp_path / "hf", "gpt2")  # lm_head tied to wte: one tensor on disk
    assert convert.main(["from-hf", str(hf), str(tmp_path / "ckpt"), "--tp", "2", "--pp", "1"]) == 0
    assert _index(str(tmp_path / "ckpt"))["config"]["architectures"] == ["GPT2LMHeadModel"]
    assert convert.main(["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    back, original = GPT2LMHeadModel.from_pretrained(tmp_path / "out"), load_file(str(hf / "model.safetensors"))
    assert all(torch.equal(back.state_dict()[n], t) for n, t in original.items())


def test_tensors_no_class_holds_are_refused_not_dropped(tmp_path, capsys):
    for architectures in (False, True):
        hf = _hf_dir(tmp_path / f"hf-{architectures}", "llama", architectures=architectures)
        state = load_file(str(hf / "model.safetensors"))
        save_file({**state, "value_head.weight": torch.zeros(1, 32)}, str(hf / "model.safetensors"))
        assert convert.main(["from-hf", str(hf), str(tmp_path / f"ckpt-{architectures}"), "--tp", "1", "--pp", "1"]) == 2
        err = capsys.readouterr().err
        assert ("has no place for 1 of its tensors (value_head.weight)" if architectures
                else "no 'llama' class has exactly its tensors") in err, err
        assert not os.path.exists(tmp_path / f"ckpt-{architectures}" / "latest")


# -- 2: publishing touches only what it writes; pruning is explicit --------------------------------
def test_publishing_keeps_every_other_checkpoint(tmp_path):
    hf = _hf_dir(tmp_path / "hf", "llama")
    assert convert.main(["from-hf", str(hf), str(tmp_path / "src"), "--tp", "1", "--pp", "1"]) == 0
    out = tmp_path / "out"
    assert convert.main(["from-hf", str(hf), str(out), "--tp", "1", "--pp", "1"]) == 0  # step 0
    (out / "ckpt-000005").mkdir()  # a newer one, as a longer run left it
    (out / "ckpt-000005" / "index.json").write_text("{}")
    assert convert.main(["reshard", str(tmp_path / "src"), str(out), "--tp", "2", "--pp", "1"]) == 0
    assert sorted(os.listdir(out)) == [LOCK_FILE, "ckpt-000000", "ckpt-000000.1", "ckpt-000005", "latest"]


def test_prune_removes_only_older_checkpoints(tmp_path):
    from qn_hf.checkpoint.files import prune

    for name in ["ckpt-000001", "ckpt-000002", "ckpt-000003", "ckpt-000005", "ckpt-000000.partial", "ckpt-000007.partial",
                 "ckpt-000002.removing", "notes"]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "index.json").write_text("{}")
    outside = tmp_path / "notes"
    os.symlink(outside, tmp_path / "ckpt-000004")  # removing a link never touches what it points to
    (tmp_path / "latest").write_text('"ckpt-000002"')
    removed = prune(str(tmp_path), keep_last=2)  # keeps 4 and 5, and 2 (latest); a newer partial may be in progress
    assert sorted(removed) == ["ckpt-000000.partial", "ckpt-000001", "ckpt-000002.removing", "ckpt-000003"]
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000002", "ckpt-000004", "ckpt-000005", "ckpt-000007.partial",
                                            "latest", "notes"]
    assert prune(str(tmp_path), keep_last=1) == ["ckpt-000004"] and (outside / "index.json").is_file()
    with pytest.raises(ValueError, match="keep_last=0 must be a positive integer"):
        prune(str(tmp_path), keep_last=0)


def test_a_kill_while_pruning_leaves_no_half_checkpoint(tmp_path):
    for name in ["ckpt-000001", "ckpt-000002"]:
        (tmp_path / name).mkdir()
        for i in range(3):
            (tmp_path / name / f"f{i}").write_text("x")
    (tmp_path / "latest").write_text('"ckpt-000002"')
    script = ("import os, shutil, signal, sys\nfrom qn_hf.checkpoint.files import prune\n"
              "shutil.rmtree = lambda path, *a, **k: (os.unlink(os.path.join(path, 'f0')), os.kill(os.getpid(), 9))\n"
              "prune(sys.argv[1], keep_last=1)\n")
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == -9
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000001.removing", "ckpt-000002", "latest"]  # not a checkpoint name
    from qn_hf.checkpoint.files import prune

    assert prune(str(tmp_path), keep_last=1) == ["ckpt-000001.removing"]


# -- 4: shapes are the config's ------------------------------------------------------------------------
def test_source_shapes_must_match_the_config(tmp_path, capsys):
    hf = _hf_dir(tmp_path / "hf", "llama", architectures=True, rows=96, vocab_size=300)
    assert convert.main(["from-hf", str(hf), str(tmp_path / "a"), "--tp", "1", "--pp", "1"]) == 2
    assert "model.embed_tokens.weight has shape [96, 32], the config (LlamaForCausalLM) gives" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()  # nothing written, not even a partial directory
    good = str(tmp_path / "good")
    assert convert.main(["from-hf", str(_hf_dir(tmp_path / "hf2", "llama")), good, "--tp", "1", "--pp", "1"]) == 0
    _edit_index(good, lambda index: index["config"].update(vocab_size=120))
    for command in (["reshard", good, str(tmp_path / "b"), "--tp", "1", "--pp", "1"], ["to-hf", good, str(tmp_path / "c")]):
        assert convert.main(command) == 2
        assert "has shape [101, 32], the config (LlamaForCausalLM) gives" in capsys.readouterr().err


def _edit_index(ckpt: str, edit) -> None:
    """Edit a checkpoint's index and seal it again, as a hostile writer could: the checks behind the
    index's digest must hold on their own."""
    path = os.path.join(checkpoint_dir(ckpt), "index.json")
    with open(path) as f:
        index = json.load(f)
    edit(index)
    write_index(index, path)


# -- 6: no write follows a link; to-hf replaces a directory whole -----------------------------------
def test_conversions_never_write_through_a_planted_link(tmp_path):
    hf = _hf_dir(tmp_path / "hf", "llama")
    ckpt, out, resharded = tmp_path / "ckpt", tmp_path / "out", tmp_path / "resharded"
    assert convert.main(["from-hf", str(hf), str(ckpt), "--tp", "1", "--pp", "1"]) == 0
    out.mkdir()
    resharded.mkdir()
    (tmp_path / "elsewhere").mkdir()
    plants = {out / "config.json": _victim(tmp_path / "v1"), out / "model.safetensors.tmp": _victim(tmp_path / "v2"),
              out / ".qn_hf-export.partial": tmp_path / "elsewhere", resharded / "latest.tmp": _victim(tmp_path / "v3"),
              resharded / "ckpt-000000.partial": tmp_path / "elsewhere"}
    for link, target in plants.items():
        os.symlink(target, link)
    assert convert.main(["to-hf", str(ckpt), str(out), "--overwrite"]) == 0
    assert convert.main(["reshard", str(ckpt), str(resharded), "--tp", "2", "--pp", "1"]) == 0
    assert all((tmp_path / v).read_bytes() == VICTIM for v in ("v1", "v2", "v3")) and os.listdir(tmp_path / "elsewhere") == []
    assert not (out / "config.json").is_symlink() and LlamaForCausalLM.from_pretrained(out) is not None
    assert os.path.isdir(checkpoint_dir(str(resharded))) and not os.path.islink(checkpoint_dir(str(resharded)))


def test_a_failed_to_hf_leaves_the_previous_export(tmp_path, capsys):
    ckpt, other, out = str(tmp_path / "ckpt"), str(tmp_path / "other"), tmp_path / "out"
    assert convert.main(["from-hf", str(_hf_dir(tmp_path / "hf", "llama")), ckpt, "--tp", "1", "--pp", "1"]) == 0
    assert convert.main(["from-hf", str(_hf_dir(tmp_path / "hf2", "llama", vocab_size=150)), other, "--tp", "1",
                         "--pp", "1"]) == 0
    assert convert.main(["to-hf", ckpt, str(out)]) == 0
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    os.unlink(os.path.join(checkpoint_dir(other), "shard-pp0-tp0.safetensors"))
    assert convert.main(["to-hf", other, str(out), "--overwrite"]) == 2
    assert "shard-pp0-tp0.safetensors is missing" in capsys.readouterr().err
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before  # no staging left either


def test_atomic_writes_replace_links_instead_of_following_them(tmp_path):
    from qn_hf.checkpoint.atomic import write_text_atomic

    target = _victim(tmp_path / "victim")
    os.symlink(target, tmp_path / "latest")
    os.symlink(target, tmp_path / "latest.tmp")
    write_text_atomic(str(tmp_path / "latest"), '"ckpt-000001"')
    assert target.read_bytes() == VICTIM and not (tmp_path / "latest").is_symlink()
    assert (tmp_path / "latest").read_text() == '"ckpt-000001"'


def case_save_into_planted_links(*, root: str) -> list[bool]:
    import torch.distributed as dist

    import qn_hf

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS["llama"])  # a config without architectures
    pm = qn_hf.parallelize(model, tp=2, mesh=mesh_for(1, 2))
    export, ckpt = os.path.join(root, "export"), os.path.join(root, "ckpt")
    if dist.get_rank() == 0:
        for directory in (export, ckpt):
            os.makedirs(directory)
        os.symlink(_victim(Path(root) / "v-config"), os.path.join(export, "config.json"))
        os.symlink(_victim(Path(root) / "v-latest"), os.path.join(ckpt, "latest.tmp"))
    dist.barrier()
    pm.save_pretrained(export)
    pm.save_checkpoint(ckpt, step=1)
    return [(Path(root) / v).read_bytes() == VICTIM for v in ("v-config", "v-latest")]


def test_saves_never_write_through_a_planted_link_and_record_the_class(worlds, tmp_path):
    assert worlds.run(2, case_save_into_planted_links, root=str(tmp_path))[0] == [True, True]
    assert json.loads((tmp_path / "export" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert _index(str(tmp_path / "ckpt"))["config"]["architectures"] == ["LlamaForCausalLM"]
    assert convert.main(["reshard", str(tmp_path / "ckpt"), str(tmp_path / "r"), "--tp", "1", "--pp", "1"]) == 0
    assert "lm_head.weight" in _index(str(tmp_path / "r"))["tensors"]


def case_keep_last(*, ckpt: str) -> list[str]:
    import qn_hf
    from qn_hf.checkpoint.save import save_checkpoint

    pm = qn_hf.parallelize(AutoModelForCausalLM.from_config(CONFIGS["gpt2"]), tp=2, mesh=mesh_for(1, 2))
    for step in (1, 2, 3):
        save_checkpoint(pm.module, ckpt, placement=pm.placement, config=pm.config, step=step, keep_last=2)
    return sorted(os.listdir(ckpt))


def test_save_checkpoint_prunes_only_when_asked(worlds, tmp_path):
    left = worlds.run(2, case_keep_last, ckpt=str(tmp_path / "ckpt"))[0]
    assert left == [LOCK_FILE, "ckpt-000002", "ckpt-000003", "latest"]


# -- 7: hostile checkpoints ------------------------------------------------------------------------------
def test_to_hf_memory_is_bounded_whatever_the_index_declares(tmp_path):
    rows = 2 << 20  # a 256 MiB embedding in a sparse file: 4 KiB on disk
    ckpt = str(tmp_path / "ckpt")
    assert convert.main(["from-hf", str(_hf_dir(tmp_path / "hf", "gpt2")), ckpt, "--tp", "1", "--pp", "1"]) == 0
    directory = checkpoint_dir(ckpt)
    header = json.dumps({"wte": {"dtype": "F32", "shape": [rows, 32], "data_offsets": [0, rows * 128]}}).encode()
    with open(os.path.join(directory, "big.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + rows * 128)

    def sparse(index):
        index["config"]["vocab_size"] = rows
        index["tensors"]["transformer.wte.weight"] = {"shape": [rows, 32], "dtype": "float32", "pieces": [
            {"file": "big.safetensors", "key": "wte", "box": [[0, rows], [0, 32]]}]}
        index["files"]["big.safetensors"] = file_digest(os.path.join(directory, "big.safetensors"))

    _edit_index(ckpt, sparse)
    peak = ("import resource, sys\nfrom qn_hf import convert\nrc = convert.main(sys.argv[1:]) if sys.argv[1:] else 0\n"
            "print(rc, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    rss = [subprocess.run([sys.executable, "-c", peak, *args], env=env, capture_output=True, text=True, timeout=300)
           for args in ([], ["to-hf", ckpt, str(tmp_path / "out")])]
    (_, baseline), (rc, used) = (map(int, r.stdout.split()[-2:]) for r in rss)  # to-hf prints its path first
    assert rc == 0, rss[1].stderr[-2000:]
    assert used - baseline < 200, f"to-hf of a 256 MiB tensor held {used - baseline} MiB"  # before: 492; after: 114


def _bare(tensors: dict, **fields) -> dict:
    """An index (sealed when written) recording its file ``a.safetensors`` larger than any piece needs."""
    return {"format": "qn_hf.checkpoint", "version": VERSION, "step": 1, "config": {"model_type": "gpt2"},
            "tensors": tensors, "files": {"a.safetensors": {"bytes": 1 << 40, "crc32": 0}}, **fields}


def _entry(shape: list[int], file: str = "a.safetensors") -> dict:
    return {"shape": shape, "dtype": "float32", "pieces": [{"file": file, "key": "k", "box": [[0, n] for n in shape]}]}


@pytest.mark.parametrize(("fields", "message"), _first_in_suite(4, [
    ({"tensors": {"w": _entry([4]), "optimizer/w/bogus": _entry([1 << 28])}}, "larger than its tensor's [4]"),
    ({"tensors": {"w": _entry([4]), "optimizer/v/exp_avg": _entry([4])}}, "belongs to no tensor of the checkpoint"),
    ({"tensors": {"w": _entry([64])}, "files": {"a.safetensors": {"bytes": 100, "crc32": 0}}}, "records it as 100 bytes"),
    ({"config": [1]}, "'config' is '[1]'"),
    ({"config": {"hidden": 3}}, "a mapping with its model_type"),
    ({"step": "../../x"}, "'step' is '../../x'"),
    ({"step": -5}, "'step' is '-5'"),
    ({"step": True}, "'step' is 'True'"),
    ({"optimizer": 5}, "'optimizer' is '5'"),
    ({"optimizer": [{"params": "w"}]}, "'optimizer' is"),
    ({"optimizer": [{"params": ["w"], "lr": {"x": 1}}]}, "'optimizer' is"),
    ({"generation_config": [1]}, "'generation_config' is '[1]'"),
    ({"mesh": {"tp": "2"}}, "'mesh' is"),
    ({"files": ["a"]}, "'files' is"),
    ({"tensors": [1]}, "'tensors' is '[1]'"),
    ({"loss_scaler": {"scale": 2.0}}, "'loss_scaler' is .*the fields must be"),
    ({"loss_scaler": {"scale": -1.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2,
                      "good_steps": 0, "skipped_steps": 0}}, "scale -1.0 must be positive"),
]))
def test_malformed_indexes_are_checkpoint_errors(tmp_path, fields, message):
    (tmp_path / "a.safetensors").write_bytes(b"\0" * 300)
    (tmp_path / "index.json").write_bytes(seal(_bare({"w": _entry([4])}) | fields))
    with pytest.raises(CheckpointError, match=message.replace("[", r"\[").replace("]", r"\]")):
        read_index(str(tmp_path))


def test_pieces_larger_than_their_file_are_refused_before_reading(tmp_path):
    (tmp_path / "a.safetensors").write_bytes(b"\0" * 4096)
    (tmp_path / "index.json").write_bytes(seal(_bare({"w": _entry([1 << 30])})))
    with pytest.raises(CheckpointError, match="is corrupt: the index places 4,294,967,296 bytes of tensors in it, the file has 4,096"):
        read_index(str(tmp_path))


def test_the_tiling_check_is_linear(tmp_path):
    pieces = [{"file": "a.safetensors", "key": f"k{i}", "box": [[i, i + 1], [0, 4]]} for i in range(20_000)]
    (tmp_path / "index.json").write_bytes(seal(_bare({"w": {"shape": [20_000, 4], "dtype": "uint8", "pieces": pieces}})))
    (tmp_path / "a.safetensors").write_bytes(b"\0" * 80_000)
    began = time.perf_counter()
    assert read_index(str(tmp_path))["tensors"]["w"]["shape"] == [20_000, 4]
    assert time.perf_counter() - began < 10  # pairwise: 10k pieces took minutes


def test_an_index_dtype_the_file_does_not_hold_is_refused(tmp_path, capsys):
    ckpt = str(tmp_path / "ckpt")
    assert convert.main(["from-hf", str(_hf_dir(tmp_path / "hf", "llama")), ckpt, "--tp", "1", "--pp", "1"]) == 0
    _edit_index(ckpt, lambda index: index["tensors"]["model.norm.weight"].update(dtype="int32"))
    assert convert.main(["to-hf", ckpt, str(tmp_path / "out")]) == 2
    assert "model.norm.weight#0 is stored as F32, the index says int32" in capsys.readouterr().err


@pytest.mark.parametrize(("damage", "message"), _first_in_suite(2, [
    (lambda hf: (hf / "config.json").write_text("[1]"), "config.json is not a model config"),
    (lambda hf: (hf / "config.json").write_text('{"model_type": "no-such-model"}'), "config cannot be built"),
    (lambda hf: (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "/etc/passwd"}})),
     "weight file '/etc/passwd' is not a .safetensors name inside"),
    (lambda hf: (hf / "model.safetensors.index.json").write_text('{"weight_map": [1]}'), "'weight_map' must map"),
    (lambda hf: (hf / "model.safetensors").write_bytes(b"\xff" * 64), "model.safetensors cannot be read"),
    (lambda hf: (hf / "generation_config.json").write_text("[1]"), "is not a generation config"),
]))
def test_malformed_hf_directories_are_one_line_errors(tmp_path, damage, message):
    hf = _hf_dir(tmp_path / "hf", "llama")
    damage(hf)
    rc, err = _run("from-hf", str(hf), str(tmp_path / "ckpt"), "--tp", "1", "--pp", "1")
    assert rc == 2 and message in err and err.count("\n") == 0 and "Traceback" not in err, err


def test_to_hf_refuses_a_non_empty_directory_unless_told_and_says_what_it_wrote(tmp_path, capsys):
    ckpt, out = str(tmp_path / "ckpt"), tmp_path / "out"
    assert convert.main(["from-hf", str(_hf_dir(tmp_path / "hf", "llama")), ckpt, "--tp", "1", "--pp", "1"]) == 0
    capsys.readouterr()
    assert convert.main(["to-hf", ckpt, str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)  # as from-hf and reshard, the path it wrote
    (out / "notes.txt").write_text("mine")
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    assert convert.main(["to-hf", ckpt, str(out)]) == 2
    err = capsys.readouterr().err
    assert "is not empty" in err and "--overwrite" in err, err
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before
    assert convert.main(["to-hf", ckpt, str(out), "--overwrite"]) == 0
    assert (out / "notes.txt").read_text() == "mine" and LlamaForCausalLM.from_pretrained(out) is not None
