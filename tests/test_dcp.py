"""torch.distributed.checkpoint (DCP) in and out: a run of torch's own FSDP2 (``fsdp2_cases``) saved as torch's
recipe, torchtitan's flattened optimizer or accelerate's two directories loads into qn_hf at any mesh with its
optimizer state, and qn_hf's ``format="dcp"`` loads back into FSDP2; the next step equals the run that never
stopped (loss 1e-5 relative, every weight 2e-5)."""

from __future__ import annotations

import os

import pytest
import torch

import qn_hf
from tests import fsdp2_cases
from tests.cases import mesh_for
from tests.models import dp_slice, load, make_batch

LR = fsdp2_cases.LR
# (dp, tp, pp, dp_shard, zero): the meshes an FSDP2 checkpoint resumes at, each on 2 ranks
MESHES = {"tp2": (1, 2, 1, 1, False), "pp2": (1, 1, 2, 1, False), "dp_shard2": (2, 1, 1, 2, False),
          "zero2": (2, 1, 1, 1, True), "tp2-pp2-dp_shard2": (2, 2, 2, 2, False)}
TWO_RANKS = [m for m, (dp, tp, pp, _, _) in MESHES.items() if dp * tp * pp == 2]


def _optimizer(pm, zero: bool, lr: float):
    if zero:
        return qn_hf.optimizer(pm, torch.optim.AdamW, zero=True, lr=lr, weight_decay=0.01)
    return torch.optim.AdamW(pm.parameters(), lr=lr, weight_decay=0.01)


def _step(pm, opt, kind: str, seed: int) -> float:
    """One step on the global batch the FSDP2 reference takes (unpadded, so every rank's mean is equal-weighted)."""
    opt.zero_grad()
    batch = dp_slice(make_batch(kind, size=8, seed=seed, padded=False), dp=pm.dims.dp, dp_rank=pm.coords["dp"])
    loss = pm.train_step(batch)
    opt.step()
    return loss.item()


def _parallel(kind: str, model_dir: str, dp: int, tp: int, pp: int, dp_shard: int):
    return qn_hf.parallelize(load(kind, model_dir), dp=dp, tp=tp, pp=pp, dp_shard=dp_shard, microbatches=2,
                             mesh=mesh_for(dp, tp, pp))


def case_qn_resume(*, kind: str, model_dir: str, ckpt: str, out: str, dp: int, tp: int, pp: int, dp_shard: int,
                   zero: bool) -> dict:
    pm = _parallel(kind, model_dir, dp, tp, pp, dp_shard)
    # another learning rate: the saved hyperparameters must replace it
    opt = _optimizer(pm, zero, lr=LR * 7)
    meta = pm.load_checkpoint(ckpt, optimizer=opt)
    loss = _step(pm, opt, kind, seed=2)
    pm.save_pretrained(out)
    return {"meta": meta, "loss": loss}


def case_qn_save_dcp(*, kind: str, model_dir: str, ckpt: str, out: str, dp: int, tp: int, pp: int, dp_shard: int,
                     zero: bool, asynchronous: bool = False) -> dict:
    """Step 1, a DCP checkpoint (written in the background while step 2 runs, if ``asynchronous``), step 2; the
    weights after step 2 exported."""
    pm = _parallel(kind, model_dir, dp, tp, pp, dp_shard)
    opt = _optimizer(pm, zero, lr=LR)
    _step(pm, opt, kind, seed=1)
    directory = pm.save_checkpoint(ckpt, optimizer=opt, step=1, format="dcp", asynchronous=asynchronous)
    loss = _step(pm, opt, kind, seed=2)
    assert pm.wait_checkpoint() in (None, directory)
    pm.save_pretrained(out)
    return {"directory": directory, "loss": loss}


def _max_error(kind: str, a: str, b: str) -> float:
    got, expected = dict(load(kind, a).named_parameters()), dict(load(kind, b).named_parameters())
    assert got.keys() == expected.keys()
    return max((got[n] - p).abs().max().item() for n, p in expected.items())


def _fsdp2_run(worlds, model_dirs, tmp_path, kind: str, layout: str) -> tuple[str, str, float]:
    ckpt, out = str(tmp_path / f"fsdp2-{layout}"), str(tmp_path / f"fsdp2-{layout}-out")
    loss = worlds.run(2, fsdp2_cases.case_fsdp2_train_save, kind=kind, model_dir=model_dirs[kind], ckpt=ckpt, out=out,
                      layout=layout)[0]
    return ckpt, out, loss


def _resume_at(worlds, model_dirs, tmp_path, kind: str, ckpt: str, mesh: str) -> tuple[dict, str]:
    dp, tp, pp, dp_shard, zero = MESHES[mesh]
    out = str(tmp_path / f"qn-{mesh}-{os.path.basename(ckpt)}")
    r = worlds.run(dp * tp * pp, case_qn_resume, kind=kind, model_dir=model_dirs[kind], ckpt=ckpt, out=out, dp=dp,
                   tp=tp, pp=pp, dp_shard=dp_shard, zero=zero)[0]
    return r, out


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_fsdp2_checkpoint_resumes_in_qn_hf_at_any_mesh(worlds, model_dirs, tmp_path, kind):
    """torch's recipe (``get_state_dict`` + ``dcp.save``) after one FSDP2 step on 2 ranks: qn_hf at tp=2, at pp=2,
    at dp_shard=2 and at dp=2 with ZeRO-1 takes the next step as FSDP2 did."""
    ckpt, expected, loss = _fsdp2_run(worlds, model_dirs, tmp_path, kind, "torch")
    for mesh in TWO_RANKS:
        r, out = _resume_at(worlds, model_dirs, tmp_path, kind, ckpt, mesh)
        assert r["meta"]["step"] is None  # a foreign DCP records no training step
        assert abs(r["loss"] - loss) <= 1e-5 * abs(loss), (mesh, r["loss"], loss)
        err = _max_error(kind, out, expected)
        assert err <= 2e-5, (mesh, err)


@pytest.mark.long
def test_fsdp2_checkpoint_resumes_at_tp2_pp2_dp_shard2(worlds, model_dirs, tmp_path):
    """The three at once, on 8 ranks."""
    ckpt, expected, loss = _fsdp2_run(worlds, model_dirs, tmp_path, "llama", "torch")
    r, out = _resume_at(worlds, model_dirs, tmp_path, "llama", ckpt, "tp2-pp2-dp_shard2")
    assert abs(r["loss"] - loss) <= 1e-5 * abs(loss), (r["loss"], loss)
    assert _max_error("llama", out, expected) <= 2e-5


def test_fsdp2_moe_checkpoint_resumes_at_ep2(worlds, model_dirs, tmp_path):
    """A Qwen3-MoE FSDP2 run (its fused experts sharded by rows over the 2 ranks) resumes at dp=2 x ep=2, each rank
    reading the experts it holds."""
    kind = "qwen3_moe"
    ckpt, expected, loss = _fsdp2_run(worlds, model_dirs, tmp_path, kind, "torch")
    out = str(tmp_path / "qn-ep2")
    r = worlds.run(2, case_qn_resume_ep, kind=kind, model_dir=model_dirs[kind], ckpt=ckpt, out=out)[0]
    assert abs(r - loss) <= 1e-5 * abs(loss), (r, loss)
    assert _max_error(kind, out, expected) <= 2e-5


def case_qn_resume_ep(*, kind: str, model_dir: str, ckpt: str, out: str) -> float:
    pm = qn_hf.parallelize(load(kind, model_dir), dp=2, ep=2, mesh=mesh_for(2, 1, 1))
    opt = _optimizer(pm, False, lr=LR * 7)
    pm.load_checkpoint(ckpt, optimizer=opt)
    loss = _step(pm, opt, kind, seed=2)
    pm.save_pretrained(out)
    return loss


@pytest.mark.parametrize("layout, mesh", [("flat", "tp2"), ("accelerate", "pp2")])
def test_torchtitan_and_accelerate_layouts_resume(worlds, model_dirs, tmp_path, layout, mesh):
    """The optimizer flattened per parameter (torchtitan's ``flatten_optimizer_state_dict``), and accelerate's
    model and optimizer directories with its ``optimizer.`` prefix, resume the same way."""
    kind = "llama"
    ckpt, expected, loss = _fsdp2_run(worlds, model_dirs, tmp_path, kind, layout)
    r, out = _resume_at(worlds, model_dirs, tmp_path, kind, ckpt, mesh)
    assert abs(r["loss"] - loss) <= 1e-5 * abs(loss), (r["loss"], loss)
    assert _max_error(kind, out, expected) <= 2e-5


@pytest.mark.parametrize("kind, mesh, asynchronous", [("gpt2", (1, 2, 2, 1, False), False),
                                                      ("llama", (1, 2, 2, 1, False), False),
                                                      ("llama", (2, 1, 1, 1, True), False),
                                                      ("gpt2", (2, 1, 2, 2, False), True)])
def test_qn_hf_dcp_loads_into_fsdp2(worlds, model_dirs, tmp_path, kind, mesh, asynchronous):
    """qn_hf at tp=2 x pp=2 (and at dp=2 with ZeRO-1, whose pieces are partial rows; and at dp_shard=2 x pp=2
    written in the background) saves ``format="dcp"`` after step 1; torch's FSDP2 on 2 ranks loads it with
    ``dcp.load`` + ``set_state_dict`` from the root (its ``.metadata`` names the newest checkpoint's files) and its
    step 2 equals qn_hf's. Then qn_hf loads its own DCP at another mesh
    (the step recorded) and takes the same step."""
    dp, tp, pp, dp_shard, zero = mesh
    ckpt, qn_out = str(tmp_path / "qn"), str(tmp_path / "qn-out")
    saved = worlds.run(dp * tp * pp, case_qn_save_dcp, kind=kind, model_dir=model_dirs[kind], ckpt=ckpt, out=qn_out,
                       dp=dp, tp=tp, pp=pp, dp_shard=dp_shard, zero=zero, asynchronous=asynchronous)[0]
    directory = saved["directory"]
    assert os.path.isfile(os.path.join(directory, ".metadata"))
    fsdp2_out = str(tmp_path / "fsdp2-out")
    assert os.path.isfile(os.path.join(ckpt, ".metadata"))  # torch is handed the root, as users hand it
    loss = worlds.run(2, fsdp2_cases.case_fsdp2_load_step, kind=kind, model_dir=model_dirs[kind], ckpt=ckpt,
                      out=fsdp2_out, seed=2)[0]
    assert abs(loss - saved["loss"]) <= 1e-5 * abs(saved["loss"]), (loss, saved["loss"])
    assert _max_error(kind, fsdp2_out, qn_out) <= 2e-5

    r, out = _resume_at(worlds, model_dirs, tmp_path, kind, ckpt, "dp_shard2")
    assert r["meta"]["step"] == 1 and r["meta"]["mesh"]["pp"] == pp
    assert abs(r["loss"] - saved["loss"]) <= 1e-5 * abs(saved["loss"])
    assert _max_error(kind, out, qn_out) <= 2e-5


def test_convert_takes_an_fsdp2_dcp_to_hf_and_to_a_qn_hf_checkpoint(worlds, model_dirs, tmp_path):
    """``qn-hf-convert to-hf DCP OUT --config HF_DIR``: the FSDP2 model's weights as ``from_pretrained`` loads them;
    ``reshard DCP OUT --tp 2`` resumes as the DCP itself does; without ``--config`` a clear refusal."""
    from qn_hf import convert

    kind = "gpt2"
    ckpt, expected, loss = _fsdp2_run(worlds, model_dirs, tmp_path, kind, "torch")
    assert convert.main(["to-hf", ckpt, str(tmp_path / "no-config")]) == 2
    out = str(tmp_path / "hf")
    assert convert.main(["to-hf", ckpt, out, "--config", model_dirs[kind]]) == 0
    exported, step1 = load(kind, out).state_dict(), load(kind, expected.removesuffix("-out") + "-out-step1").state_dict()
    assert exported.keys() == step1.keys() and all(torch.equal(exported[k], step1[k]) for k in step1)

    resharded = str(tmp_path / "resharded")
    assert convert.main(["reshard", ckpt, resharded, "--tp", "2", "--pp", "1", "--config", model_dirs[kind]]) == 0
    r, got = _resume_at(worlds, model_dirs, tmp_path, kind, resharded, "tp2")
    assert abs(r["loss"] - loss) <= 1e-5 * abs(loss)
    assert _max_error(kind, got, expected) <= 2e-5


def test_convert_writes_a_dcp_torch_reads(model_dirs, tmp_path):
    """``from-hf --format dcp``: torch's own ``dcp.load`` (one process) reads every weight of the HF model under its
    names, the tied head included; ``to-hf`` of it gives the model back."""
    import torch.distributed.checkpoint as dcp

    from qn_hf import convert

    kind = "gpt2"
    out = str(tmp_path / "dcp")
    assert convert.main(["from-hf", model_dirs[kind], out, "--tp", "2", "--pp", "1", "--format", "dcp"]) == 0
    directory = os.path.join(out, "ckpt-000000")
    original = load(kind, model_dirs[kind]).state_dict()
    targets = {"model": {k: torch.empty_like(v) for k, v in original.items()}}
    dcp.load(targets, checkpoint_id=directory, no_dist=True)
    assert all(torch.equal(targets["model"][k], original[k]) for k in original)
    # the root, as FSDP2 users hand it to torch (issue 66: torch's raw FileNotFoundError for root/.metadata)
    at_root = {"model": {k: torch.zeros_like(v) for k, v in original.items()}}
    dcp.load(at_root, checkpoint_id=out, no_dist=True)
    assert all(torch.equal(at_root["model"][k], original[k]) for k in original)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save  # rebuilds the recipe's nested dict

    dcp_to_torch_save(directory, str(tmp_path / "whole.pt"))
    nested = torch.load(str(tmp_path / "whole.pt"), weights_only=True)
    assert list(nested) == ["model"] and torch.equal(nested["model"]["lm_head.weight"], original["lm_head.weight"])
    back = str(tmp_path / "back")
    assert convert.main(["to-hf", out, back]) == 0
    again = load(kind, back).state_dict()
    assert all(torch.equal(again[k], original[k]) for k in original)
    # a later checkpoint of qn_hf's own format under the same root: torch's pointer to the older DCP goes
    assert convert.main(["from-hf", model_dirs[kind], out, "--tp", "1", "--pp", "1"]) == 0
    assert not os.path.exists(os.path.join(out, ".metadata"))


class _Runs:
    """A pickled object that runs ``touch`` when unpickled: what a planted checkpoint file may hold."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _plain_dcp(path: str, kind: str, model_dir: str, *, optimizer=torch.optim.AdamW, edit=None, **hyper) -> None:
    """One process: the plain model stepped once by ``optimizer``, saved as torch's recipe names it (what
    ``get_state_dict`` gives for an unsharded model), after ``edit(model_sd, optim_sd)``."""
    import torch.distributed.checkpoint as dcp

    model = load(kind, model_dir)
    opt = optimizer(model.parameters(), lr=LR, **hyper)
    model(**make_batch(kind, size=2, seed=1, padded=False)).loss.backward()
    opt.step()
    names = {id(p): n for n, p in model.named_parameters()}
    state = opt.state_dict()
    ids = [id(p) for g in opt.param_groups for p in g["params"]]
    osd = {"state": {names[ids[i]]: s for i, s in state["state"].items()},
           "param_groups": [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[ids[i]] for i in g["params"]]}
                            for g in state["param_groups"]]}
    msd = dict(model.state_dict())
    if edit is not None:
        edit(msd, osd)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path, no_dist=True)


def case_load_errors(*, kind: str, model_dir: str, paths: list[str]) -> list[str]:
    """Each path loaded at tp=2 with an AdamW: the error every rank raises (or "loaded")."""
    pm = _parallel(kind, model_dir, 1, 2, 1, 1)
    out = []
    for path in paths:
        opt = torch.optim.AdamW(pm.parameters(), lr=LR)
        try:
            pm.load_checkpoint(path, optimizer=opt)
            out.append("loaded")
        except ValueError as e:
            out.append(str(e).split(": ", 1)[1])  # less "rank N: "
    return out


def test_damaged_and_foreign_dcps_are_refused_on_every_rank(worlds, model_dirs, tmp_path):
    """What a DCP reader must not take: planted code (in .metadata and in a hyperparameter: refused unrun), a missing
    or unknown or misshapen tensor, SGD's or Adam's state for an AdamW, state an AdamW does not keep, metadata that
    declares more values than its file holds, a truncated file. Every
    rank raises the same ValueError, naming the problem."""
    import pickle

    kind, model_dir = "llama", model_dirs["llama"]
    marker = str(tmp_path / "ran")
    cases: dict[str, tuple[str, str]] = {}

    def make(name: str, expected: str, **kw) -> str:
        path = str(tmp_path / name)
        _plain_dcp(path, kind, model_dir, **kw)
        cases[name] = (path, expected)
        return path

    make("intact", "loaded", weight_decay=0.01)
    evil = make("evil-metadata", "refused unrun", weight_decay=0.01)
    with open(os.path.join(evil, ".metadata"), "wb") as f:
        pickle.dump(_Runs(marker), f)

    def evil_lr(msd, osd):
        osd["param_groups"][0]["lr"] = _Runs(marker)
    make("evil-value", "refused unrun", edit=evil_lr, weight_decay=0.01)
    make("missing", "has no tensor 'model.norm.weight'", weight_decay=0.01,
         edit=lambda msd, osd: msd.pop("model.norm.weight"))
    make("unknown", "name nothing in this model", weight_decay=0.01,
         edit=lambda msd, osd: msd.__setitem__("model.extra.weight", torch.zeros(2)))
    make("misshapen", "has shape", weight_decay=0.01,
         edit=lambda msd, osd: msd.__setitem__("model.norm.weight", torch.zeros(3)))
    make("sgd", "another kind of optimizer", optimizer=torch.optim.SGD, momentum=0.9)
    make("adam", "decoupled_weight_decay=False", optimizer=torch.optim.Adam, weight_decay=0.01)
    make("amsgrad", "loaded", weight_decay=0.01, amsgrad=True)  # amsgrad's groups and state: an AdamW with amsgrad

    def extra_state(msd, osd):
        state = next(iter(osd["state"].values()))
        state["momentum_buffer"] = torch.zeros_like(state["exp_avg"])
    make("extra-state", "does not keep", weight_decay=0.01, edit=extra_state)
    inflated = make("inflated", "fewer than its values need", weight_decay=0.01)
    with open(os.path.join(inflated, ".metadata"), "rb") as f:
        metadata = pickle.load(f)  # written just above by torch itself
    item = metadata.state_dict_metadata["model.model.norm.weight"]
    item.size, item.chunks[0].sizes = torch.Size([1 << 30]), torch.Size([1 << 30])
    with open(os.path.join(inflated, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    truncated = make("truncated", "truncated", weight_decay=0.01)
    data = os.path.join(truncated, next(f for f in os.listdir(truncated) if f.endswith(".distcp")))
    os.truncate(data, os.path.getsize(data) // 2)

    results = worlds.run(2, case_load_errors, kind=kind, model_dir=model_dir, paths=[p for p, _ in cases.values()])
    assert results[0] == results[1]
    for (name, (_, expected)), got in zip(cases.items(), results[0]):
        assert expected in got, (name, got)
    assert not os.path.exists(marker)


def _torchtitan_dcp(path: str, model_dir: str) -> tuple[float, str]:
    """A plain Llama stepped once by AdamW, saved as torchtitan saves a Llama 3 run: its own names at the top level,
    q and k rows in its rotary layout (the inverse of torchtitan's ``_permute`` to Hugging Face: a head's rows viewed
    as (2, head_dim/2) and transposed), the optimizer flattened per parameter under ``optimizer``, and its trainer's
    entries beside them. Then the plain model's second step: (its loss, its weights' HF directory)."""
    import torch.distributed.checkpoint as dcp

    model = load("llama", model_dir)
    config = model.config
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    model(**make_batch("llama", size=8, seed=1, padded=False)).loss.backward()
    opt.step()
    model.save_pretrained(path + "-step1")
    head_dim = config.hidden_size // config.num_attention_heads

    def to_titan(name: str, value: torch.Tensor) -> tuple[str, torch.Tensor]:
        for hf, titan in (("self_attn.q_proj", "attention.wq"), ("self_attn.k_proj", "attention.wk"),
                          ("self_attn.v_proj", "attention.wv"), ("self_attn.o_proj", "attention.wo"),
                          ("mlp.gate_proj", "feed_forward.w1"), ("mlp.down_proj", "feed_forward.w2"),
                          ("mlp.up_proj", "feed_forward.w3"), ("input_layernorm", "attention_norm"),
                          ("post_attention_layernorm", "ffn_norm")):
            if f".{hf}." in name:
                if hf in ("self_attn.q_proj", "self_attn.k_proj") and value.ndim == 2:
                    heads = value.shape[0] // head_dim
                    value = value.view(heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(value.shape)
                return name.removeprefix("model.").replace(hf, titan), value.contiguous()
        top = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
               "lm_head.weight": "output.weight"}
        return top[name], value

    sd = dict(to_titan(n, p.detach().clone()) for n, p in model.named_parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    for p, state in opt.state.items():
        titan = to_titan(names[id(p)], p)[0]
        for key, value in state.items():
            sd[f"optimizer.state.{titan}.{key}"] = to_titan(names[id(p)], value)[1] if value.ndim else value.clone()
        for key, value in opt.param_groups[0].items():
            if key != "params":
                sd[f"optimizer.param_groups.{titan}.{key}"] = value
    sd.update({"train_state.step": torch.tensor(1), "lr_scheduler.last_epoch": 1, "dataloader.rank0": b"state",
               "freqs_cis": torch.ones(12, head_dim // 2, dtype=torch.complex64)})  # a buffer releases before 0.2 saved
    dcp.save(sd, checkpoint_id=path, no_dist=True)
    opt.zero_grad()
    loss = model(**make_batch("llama", size=8, seed=2, padded=False)).loss
    loss.backward()
    opt.step()
    model.save_pretrained(path + "-expected")
    return loss.item(), path + "-expected"


def case_qn_resume_torchtitan(*, model_dir: str, ckpt: str, out: str) -> float:
    from qn_hf.checkpoint.dcp import torchtitan_llama

    pm = _parallel("llama", model_dir, 1, 2, 1, 1)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, weight_decay=0.01)
    pm.load_checkpoint(ckpt, optimizer=opt, key_map=torchtitan_llama(pm.config))
    loss = _step(pm, opt, "llama", seed=2)
    pm.save_pretrained(out)
    return loss


def test_torchtitan_llama_checkpoint_resumes_with_its_key_map(worlds, model_dirs, tmp_path):
    """torchtitan's Llama 3 names and rotary row order (weights and AdamW moments) through ``torchtitan_llama``: the
    next step at tp=2 equals the plain model's; without the map, a refusal naming the keys and ``key_map=``."""
    ckpt, out = str(tmp_path / "titan"), str(tmp_path / "qn")
    loss, expected = _torchtitan_dcp(ckpt, model_dirs["llama"])
    got = worlds.run(2, case_qn_resume_torchtitan, model_dir=model_dirs["llama"], ckpt=ckpt, out=out)[0]
    assert abs(got - loss) <= 1e-5 * abs(loss), (got, loss)
    assert _max_error("llama", out, expected) <= 2e-5
    [message] = worlds.run(2, case_load_errors, kind="llama", model_dir=model_dirs["llama"], paths=[ckpt])[0]
    assert "key_map=" in message and "tok_embeddings.weight" in message, message

    from qn_hf import convert

    hf = str(tmp_path / "hf")  # and offline: the weights after the saved step, as from_pretrained loads them
    assert convert.main(["to-hf", ckpt, hf, "--config", model_dirs["llama"], "--key-map", "torchtitan-llama"]) == 0
    assert _max_error("llama", hf, ckpt + "-step1") == 0


def test_an_unknown_format_is_refused_naming_the_choices():
    from qn_hf.checkpoint.errors import CheckpointFormat, checkpoint_format

    assert checkpoint_format("dcp") is CheckpointFormat.DCP
    with pytest.raises(ValueError, match=r"format='safetensors' is not a checkpoint format: use one of \['qn', 'dcp'\]"):
        checkpoint_format("safetensors")
