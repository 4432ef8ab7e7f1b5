"""torch's own gradient norm on a parallel model's parameters: the true norm, or refused with one line naming
qn_hf.clip_grad_norm_ (issue 66); and gradients accumulated over synchronized train_step calls, summed once."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import qn_hf
from tests.cases import reference_grad, whole
from tests.models import dp_slice, load, make_batch


def _degrees_world(degrees: dict) -> int:
    size = 1
    for axis in ("dp", "tp", "pp", "cp"):
        size *= degrees.get(axis, 1)
    return size


def torch_clip(*, kind: str, model_dir: str, degrees: dict, zero: bool) -> dict:
    """One step; torch's clip_grad_norm_ and get_total_norm on pm.parameters()' gradients (what they return or
    say), qn_hf's norm and the plain model's; then a torch optimizer steps and a second step runs."""
    torch.manual_seed(0)
    ref, pm = load(kind, model_dir), qn_hf.parallelize(load(kind, model_dir), **degrees)
    opt = qn_hf.optimizer(pm, torch.optim.AdamW, zero=True, lr=1e-3) if zero else torch.optim.AdamW(pm.parameters())
    dp = pm.dims.dp
    batches = [make_batch(kind, size=2 * dp, seed=seed) for seed in (3, 4)]
    pm.train_step(dp_slice(batches[0], dp=dp, dp_rank=pm.coords["dp"]))
    ref(**batches[0]).loss.backward()
    out = {"ref": torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9).item()}
    for name, call in (("clip", lambda: torch.nn.utils.clip_grad_norm_(pm.parameters(), 1e9)),
                       ("clip_foreach", lambda: torch.nn.utils.clip_grad_norm_(pm.parameters(), 1e9, foreach=True)),
                       ("total", lambda: torch.nn.utils.get_total_norm(
                           [p.grad for p in pm.parameters() if p.grad is not None]))):
        try:
            norm = call()
            out[name] = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        except ValueError as e:
            out[name] = str(e)
    out["qn_hf"] = qn_hf.clip_grad_norm_(pm, 1e9).item()
    for name in ("get_input_embeddings", "num_parameters"):  # the HF model's own surface, reached on pm
        try:
            getattr(pm, name)
            out[name] = "no error"
        except AttributeError as e:
            out[name] = str(e)
    out["hasattr"] = hasattr(pm, "get_input_embeddings") or hasattr(pm, "no_such_thing")
    opt.step()
    opt.zero_grad()
    pm.train_step(dp_slice(batches[1], dp=dp, dp_rank=pm.coords["dp"]))
    out["second"] = qn_hf.clip_grad_norm_(pm, 1e9).item()
    out["finite"] = all(torch.isfinite(whole(p.detach())).all().item() for p in pm.parameters())
    pm.close()
    return out


REFUSED = [("gpt2", {"tp": 2}, False, "tp=2"), ("gpt2", {"pp": 2}, False, "pp=2"),
           ("llama", {"dp": 2, "dp_shard": 2, "tp": 2}, False, "tp=2"),
           ("llama", {"dp": 2, "dp_shard": 2, "pp": 2}, False, "pp=2"),
           ("gpt2", {"dp": 2}, True, "zero=True"), ("qwen3_moe", {"dp": 2, "ep": 2}, False, "ep=2")]


@pytest.mark.core
@pytest.mark.parametrize(("kind", "degrees", "zero", "named"), REFUSED,
                         ids=["gpt2-tp2", "gpt2-pp2", "llama-dpshard2-tp2", "llama-dpshard2-pp2", "gpt2-zero",
                              "moe-ep2"])
def test_torch_norm_over_a_part_of_the_gradients_is_refused(worlds, model_dirs, kind, degrees, zero, named):
    """At tp, pp (with or without dp_shard), ep and under ZeRO-1 each rank holds part of the gradients: torch's
    clip_grad_norm_ (either implementation) and get_total_norm stop on every rank with one line naming the mesh
    and qn_hf.clip_grad_norm_ (they returned 0.85x the norm at tp=2, 0 under ZeRO-1), and nothing else about
    the gradients changes: a torch optimizer steps them and the next step runs."""
    for r in worlds.run(_degrees_world(degrees), torch_clip, kind=kind, model_dir=model_dirs[kind], degrees=degrees,
                        zero=zero):
        for name in ("clip", "clip_foreach", "total"):
            assert isinstance(r[name], str), r
            assert named in r[name] and "qn_hf.clip_grad_norm_(pm, max_norm)" in r[name], r[name]
        assert r["qn_hf"] == pytest.approx(r["ref"], rel=1e-5), r
        assert r["second"] > 0 and r["finite"], r
        # pm.get_input_embeddings(), pm.num_parameters(): refused in qn_hf's words, naming pm.module's and the mesh
        for name in ("get_input_embeddings", "num_parameters"):
            assert r[name].startswith(f"ParallelModel has no {name!r}: pm.module.{name} is the Hugging Face model's, "
                                      f"which on this rank holds its part of the model ("), r[name]
            assert named.split("=")[0] in r[name] or named == "zero=True", r[name]
        assert r["hasattr"] is False


@pytest.mark.core
@pytest.mark.parametrize(("kind", "degrees"), [("gpt2", {"dp": 2}), ("llama", {"dp": 2, "dp_shard": 2}),
                                               ("llama", {"cp": 2})], ids=["dp2", "dpshard2", "cp2"])
def test_torch_norm_where_each_rank_holds_the_whole_is_the_true_norm(worlds, model_dirs, kind, degrees):
    """Plain dp and cp hold every gradient whole, dp_shard as DTensors whose norm torch reduces: torch's own
    functions give the plain model's norm there, and are left alone."""
    for r in worlds.run(_degrees_world(degrees), torch_clip, kind=kind, model_dir=model_dirs[kind], degrees=degrees,
                        zero=False):
        for name in ("clip", "clip_foreach", "total", "qn_hf"):
            assert r[name] == pytest.approx(r["ref"], rel=1e-5), (name, r)


def accumulated(*, kind: str, model_dir: str, degrees: dict, pattern: str) -> dict:
    """``train_step`` once per letter of ``pattern`` ("s": synchronized, "d": inside no_sync), never zeroing,
    against the plain model's backward on each of the global batches."""
    torch.manual_seed(0)
    ref, pm = load(kind, model_dir), qn_hf.parallelize(load(kind, model_dir), **degrees)
    dp = pm.dims.dp
    batches = [make_batch(kind, size=2 * dp, seed=seed) for seed in range(10, 10 + len(pattern))]
    for letter, batch in zip(pattern, batches):
        local = dp_slice(batch, dp=dp, dp_rank=pm.coords["dp"])
        if letter == "d":
            with pm.no_sync():
                pm.train_step(local)
        else:
            pm.train_step(local)
        ref(**batch).loss.backward()
    refs = dict(ref.named_parameters(remove_duplicate=False))
    err = max((whole(p.grad) - reference_grad(refs, n, pm)).abs().max().item() for n, p in pm.named_parameters()
              if p.requires_grad)
    scale = max(p.grad.abs().max().item() for p in ref.parameters() if p.grad is not None)
    pm.close()
    return {"rank": dist.get_rank(), "err": err, "scale": scale}


@pytest.mark.core
@pytest.mark.parametrize(("kind", "degrees", "pattern"), [
    ("gpt2", {"dp": 2}, "ss"), ("gpt2", {"pp": 2}, "ss"), ("llama", {"cp": 2}, "ss"), ("qwen3", {"tp": 2}, "ss"),
    ("llama", {"tp": 4}, "ss"), ("gpt2", {"dp": 2, "dp_shard": 2}, "ss"), ("gpt2", {"dp": 2}, "sds"),
], ids=["dp2", "pp2-tied", "cp2", "tp2-grad-sum", "tp4-kv-replicas", "dpshard2", "dp2-sync-defer-sync"])
def test_gradients_accumulated_over_synchronized_steps_are_summed_once(worlds, model_dirs, kind, degrees, pattern):
    """Accumulating over train_step calls without no_sync: each call's gradient counts once, as the plain
    model's backward passes accumulate (the sums over dp, cp, the tied pair and tp's partial gradients counted
    the gradient already in .grad again: 3x the first call's at dp=2)."""
    for r in worlds.run(_degrees_world(degrees), accumulated, kind=kind, model_dir=model_dirs[kind],
                        degrees=degrees, pattern=pattern):
        assert r["err"] <= 2e-5 * max(1.0, r["scale"]), r
