"""Data-parallel traffic per step, and gradient accumulation with ``no_sync``."""

from __future__ import annotations

import math

import pytest
import torch

import qn_hf
from tests import cases
from tests.cases import mesh_for, reference_grad
from tests.models import dp_slice, load, make_batch

BUCKET_MB = 0.02


def case_dp_traffic(*, kind: str, model_dir: str, dp: int, tp: int, pp: int, microbatches: int,
                    schedule: str = "1f1b", virtual_stages: int = 1) -> dict:
    pm = qn_hf.parallelize(load(kind, model_dir), dp=dp, tp=tp, pp=pp, microbatches=microbatches, schedule=schedule,
                           virtual_stages=virtual_stages, bucket_mb=BUCKET_MB, mesh=mesh_for(dp, tp, pp))
    batch = dp_slice(make_batch(kind, size=dp * 2 * microbatches, seed=5), dp=dp, dp_rank=pm.coords["dp"])
    pm.train_step(batch)  # warm-up: the first step binds gradients into the buckets
    for p in pm.parameters():
        p.grad = None  # as optimizer.zero_grad() does by default
    pm.executor.events = []
    with qn_hf.CommMeter(pm) as meter:
        pm.train_step(batch)
    events = pm.executor.events
    # a chunk's gradients are final from its last backward on (and its last weight pass under
    # zb_h1): nothing may cross dp before the earliest of those
    last_bwd = {e.chunk: e.start for e in events if e.op == "bwd"}
    first_final_start = min(last_bwd.values())
    first_fwd_start = min(e.start for e in events if e.op == "fwd")
    dp_events = [e for e in meter.events if e.group == "dp"]
    grads = [e for e in dp_events if e.numel > 1]
    grad_bytes = sum(p.numel() * p.element_size() for p in pm.parameters() if p.requires_grad)
    return {
        "grad_bytes": grad_bytes,
        "dp_grad_bytes": sum(e.nbytes for e in grads),
        "dp_grad_calls": len(grads),
        "max_calls": math.ceil(grad_bytes / (BUCKET_MB * 1024 * 1024)),
        "dp_scalar_calls": len(dp_events) - len(grads),
        "dp_during_early_microbatches": sum(first_fwd_start <= e.time < first_final_start for e in dp_events),
        "dp_overlapped_with_last_backward": sum(e.time < events[-1].stop for e in grads),
        "table": meter.table(),
    }


@pytest.mark.parametrize(("kind", "dp", "tp", "pp", "microbatches", "schedule", "virtual_stages"), [
    ("gpt2", 2, 1, 2, 3, "1f1b", 1), ("llama", 2, 2, 1, 2, "1f1b", 1), ("vit", 4, 1, 1, 2, "1f1b", 1),
    ("gpt2_deep", 2, 1, 2, 4, "interleaved_1f1b", 2), ("llama_deep", 2, 1, 2, 4, "zb_h1", 1),
])
def test_dp_traffic_per_step(worlds, model_dirs, kind, dp, tp, pp, microbatches, schedule, virtual_stages):
    """Every gradient byte crosses dp once, in buckets launched once gradients are final (a chunk's
    last backward, or under zb_h1 its last weight pass) and before the step's last action ends."""
    for rank, r in enumerate(worlds.run(dp * tp * pp, case_dp_traffic, kind=kind,
                                        model_dir=model_dirs[kind], dp=dp, tp=tp, pp=pp, microbatches=microbatches,
                                        schedule=schedule, virtual_stages=virtual_stages)):
        assert r["dp_grad_bytes"] == r["grad_bytes"], (rank, r)  # every local gradient byte, exactly once
        assert 1 < r["dp_grad_calls"] <= r["max_calls"], (rank, r)
        assert r["dp_scalar_calls"] == 2, (rank, r)  # the target count and the loss
        assert r["dp_during_early_microbatches"] == 0, (rank, r)
        # buckets start while the last backward runs, not after it
        assert r["dp_overlapped_with_last_backward"] >= 1, (rank, r)


def case_no_sync(*, kind: str, model_dir: str, dp: int, tp: int, pp: int, schedule: str = "1f1b",
                 virtual_stages: int = 1) -> dict:
    ref = load(kind, model_dir)
    pm = qn_hf.parallelize(load(kind, model_dir), dp=dp, tp=tp, pp=pp, microbatches=2, bucket_mb=BUCKET_MB,
                           mesh=mesh_for(dp, tp, pp), schedule=schedule, virtual_stages=virtual_stages)
    batches = [make_batch(kind, size=4 * dp, seed=s) for s in (21, 22)]
    with qn_hf.CommMeter(pm) as meter:
        with pm.no_sync():
            pm.train_step(dp_slice(batches[0], dp=dp, dp_rank=pm.coords["dp"]))
    unsynced_dp = sum(e.numel > 1 for e in meter.events if e.group == "dp")
    pm.train_step(dp_slice(batches[1], dp=dp, dp_rank=pm.coords["dp"]))
    ref.train()
    for batch in batches:
        ref(**batch).loss.backward()
    params = dict(ref.named_parameters(remove_duplicate=False))
    err = max((p.grad - reference_grad(params, n, pm)).abs().max().item() for n, p in pm.named_parameters())
    return {"grad_err": err, "unsynced_dp_grad_calls": unsynced_dp}


@pytest.mark.parametrize(("kind", "dp", "tp", "pp", "schedule", "virtual_stages"), [
    ("gpt2", 2, 1, 2, "1f1b", 1), ("llama", 2, 2, 1, "1f1b", 1),
    ("gpt2_deep", 2, 1, 2, "interleaved_1f1b", 2), ("llama_deep", 2, 1, 2, "zb_h1", 1),
])
def test_no_sync_accumulates_over_steps(worlds, model_dirs, kind, dp, tp, pp, schedule, virtual_stages):
    for rank, r in enumerate(worlds.run(dp * tp * pp, case_no_sync, kind=kind,
                                        model_dir=model_dirs[kind], dp=dp, tp=tp, pp=pp, schedule=schedule,
                                        virtual_stages=virtual_stages)):
        assert r["unsynced_dp_grad_calls"] == 0, (rank, r)
        assert r["grad_err"] < 2e-6, (rank, r)


def case_copies_stay_equal(*, model_dir: str) -> dict:
    """Three AdamW steps at (2, 2, 2) with dropout: every copy that must be equal stays bitwise equal."""
    import torch.distributed as dist

    from qn_hf.comm import all_gather_tensors

    model = load("gpt2", model_dir, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    pm = qn_hf.parallelize(model, dp=2, tp=2, pp=2, microbatches=2, bucket_mb=BUCKET_MB, mesh=mesh_for(2, 2, 2))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    for seed in range(3):
        opt.zero_grad()
        pm.train_step(dp_slice(make_batch("gpt2", size=8, seed=seed), dp=2, dp_rank=pm.coords["dp"]))
        qn_hf.clip_grad_norm_(pm, 0.5)
        opt.step()
    params = dict(pm.named_parameters())
    flat = torch.cat([p.detach().reshape(-1) for _, p in sorted(params.items())])
    dp_copies = all_gather_tensors(flat, group=pm.groups.dp)
    replicated = torch.cat([p.detach().reshape(-1) for n, p in sorted(params.items()) if pm.specs.get(n) is None])
    tp_copies = all_gather_tensors(replicated, group=pm.groups.tp)
    tied = params.get("transformer.wte.weight", params.get("lm_head.weight"))
    tie_copies = all_gather_tensors(tied.detach(), group=pm.groups.tie)
    return {
        "rank": dist.get_rank(),
        "dp replicas equal": all(torch.equal(dp_copies[0], c) for c in dp_copies),
        "tp-replicated parameters equal": all(torch.equal(tp_copies[0], c) for c in tp_copies),
        "tied wte / lm_head equal": torch.equal(tie_copies[0], tie_copies[1]),
    }


def test_copies_stay_equal(worlds, model_dirs):
    for r in worlds.run(8, case_copies_stay_equal, model_dir=model_dirs["gpt2"]):
        failed = [k for k, v in r.items() if v is False]
        assert not failed, r


def case_disarm() -> dict:
    """A step that failed after arming its buckets (one parameter's gradient arrived, the other's
    never did), then a clean step of two microbatches: nothing is reduced before the last one."""
    import torch.distributed as dist

    from qn_hf.data_parallel.buckets import GradBuckets

    a, b = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4))
    buckets = GradBuckets([a, b], group=dist.group.WORLD, bucket_bytes=16)  # one parameter per bucket
    buckets.arm()
    (a * 1.0).sum().backward()  # the failed step's last backward, cut short
    a.grad = b.grad = None
    buckets.disarm()  # what train_step does before each step
    (a * 1.0).sum().backward()  # microbatch 0: not final
    (b * 1.0).sum().backward()
    early = sum(bucket.work is not None for bucket in buckets.buckets)
    buckets.arm()  # the last microbatch
    (a * 10.0).sum().backward()
    (b * 10.0).sum().backward()
    buckets.finish()
    return {"launched_early": early, "grads": [a.grad.tolist(), b.grad.tolist()]}


def test_a_failed_step_leaves_no_bucket_armed(worlds):
    result = worlds.run(1, case_disarm)[0]
    assert result["launched_early"] == 0, result  # a partial sum would have crossed dp
    assert result["grads"] == [[11.0] * 4] * 2, result


@pytest.mark.parametrize(("dp", "dp_shard", "tp", "pp", "with_loss_fn"), [
    (2, 1, 1, 1, False), (2, 2, 1, 1, True), (1, 1, 1, 2, False), (1, 1, 2, 1, True),
])
def test_accumulation_with_num_items_equals_the_whole_batch(worlds, model_dirs, dp, dp_shard, tp, pp, with_loss_fn):
    """Accumulating two half-batches of unequal target counts with ``num_items_in_batch`` gives the
    whole batch's gradients and loss (each half's own mean would weigh the halves alike: at dp=2 the
    gradient norm doubles)."""
    for rank, r in enumerate(worlds.run(dp * tp * pp, cases.accumulation_full_batch, kind="llama",
                                        model_dir=model_dirs["llama"], dp=dp, dp_shard=dp_shard, tp=tp, pp=pp,
                                        with_loss_fn=with_loss_fn)):
        assert r["count"] == r["targets"], (rank, r)
        assert abs(r["loss"] - r["ref_loss"]) <= 1e-5 * abs(r["ref_loss"]), (rank, r)
        assert r["grad_err"] < 2e-6, (rank, r)


@pytest.mark.parametrize(("dp", "pp"), [(2, 1), (1, 2)])
def test_a_batch_without_targets_is_nan_as_the_plain_model(worlds, model_dirs, dp, pp):
    """Labels all -100: NaN loss and zero gradients on every rank, as the plain model gives; targets
    on one dp rank only: the plain model's mean over them."""
    for rank, r in enumerate(worlds.run(dp * pp, cases.no_targets, kind="llama", model_dir=model_dirs["llama"],
                                        dp=dp, pp=pp)):
        assert math.isnan(r["ref_loss"]) and math.isnan(r["loss"]), (rank, r)
        assert r["zero_grad_err"] == 0.0, (rank, r)
        assert abs(r["half_loss"] - r["ref_half_loss"]) <= 1e-5 * r["ref_half_loss"], (rank, r)
