"""Code that runs inside test worlds for the optimizer, mixed precision and recomputation tests."""

from __future__ import annotations

import torch
import torch.distributed as dist

import qn_hf
from tests.cases import mesh_for
from tests.models import dp_slice, load, make_batch


def groups_of(named) -> list[dict]:
    """The usual two groups: weight decay on matrices, none on vectors (norms, biases)."""
    named = [(n, p) for n, p in named if p.requires_grad]
    return [{"params": [p for _, p in named if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0}]


def local_weights(pm) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in pm.named_parameters()}


def shard_of(pm, name: str, full: torch.Tensor) -> torch.Tensor:
    spec = pm.specs.get(name)
    return full if spec is None else spec.shard(full, pm.coords[spec.axis.value])  # tp's rank, or ep's


def train(pm, opt, *, kind: str, steps: int, microbatch_rows: int, clip: float | None = 1.0) -> list[float]:
    losses = []
    for step in range(steps):
        batch = make_batch(kind, size=pm.dims.dp * microbatch_rows * pm.microbatches, seed=100 + step,
                           padded=kind != "vit")
        opt.zero_grad()
        losses.append(pm.train_step(dp_slice(batch, dp=pm.dims.dp, dp_rank=pm.coords["dp"])).item())
        if clip is not None:
            qn_hf.clip_grad_norm_(pm, clip)
        opt.step()
    return losses


def virtual_for(schedule: str) -> int:
    """Chunks per rank in these cases: two under interleaved 1F1B (the 4-block models at pp=2)."""
    return 2 if schedule == "interleaved_1f1b" else 1


def zero_parity(*, kind: str, model_dir: str, dp: int, tp: int, pp: int, microbatches: int, opt_name: str,
                steps: int = 3, schedule: str = "1f1b") -> dict:
    """zero=True against zero=False (the same optimizer over the same mesh) and, for SGD, against the
    plain model: losses and every local weight after ``steps`` steps with clipping."""
    cls = getattr(torch.optim, opt_name)
    kwargs = {"lr": 1e-2, "momentum": 0.9} if opt_name == "SGD" else {"lr": 1e-3}
    mesh = mesh_for(dp, tp, pp)
    results = {}
    for zero in (True, False):
        pm = qn_hf.parallelize(load(kind, model_dir), dp=dp, tp=tp, pp=pp, microbatches=microbatches, mesh=mesh,
                               schedule=schedule, virtual_stages=virtual_for(schedule))
        opt = qn_hf.optimizer(pm, cls, zero=zero, param_groups=groups_of(pm.named_parameters()), **kwargs)
        losses = train(pm, opt, kind=kind, steps=steps, microbatch_rows=2)
        state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                    if isinstance(t, torch.Tensor) and t.ndim > 0)
        results[zero] = (losses, local_weights(pm), state)
    diff = max((results[True][1][n] - w).abs().max().item() for n, w in results[False][1].items())
    out = {"losses": results[True][0], "losses_unsharded": results[False][0], "weight_diff_unsharded": diff,
           "state_bytes": results[True][2], "state_bytes_unsharded": results[False][2]}
    if opt_name == "SGD":  # against the plain model: one process, the global batch, torch's SGD
        ref = load(kind, model_dir)
        ref_opt = cls(groups_of(ref.named_parameters()), **kwargs)
        ref_losses = []
        for step in range(steps):
            batch = make_batch(kind, size=dp * 2 * microbatches, seed=100 + step, padded=kind != "vit")
            ref_opt.zero_grad()
            loss = ref(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            ref_opt.step()
            ref_losses.append(loss.item())
        named = dict(ref.named_parameters(remove_duplicate=False))
        out["ref_losses"] = ref_losses
        out["weight_diff_ref"] = max((shard_of(pm, n, named[n].detach()) - w).abs().max().item()
                                     for n, w in results[True][1].items())
    return out


DROPOUT = {"gpt2": dict(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1), "llama": dict(attention_dropout=0.1),
           "vit": dict(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)}


def recompute_parity(*, kind: str, model_dir: str, dp: int, tp: int, pp: int, microbatches: int, mode: str,
                     steps: int = 2, sequence_parallel: bool = False, cp: int = 1, schedule: str = "1f1b",
                     virtual_stages: int = 1) -> dict:
    """With dropout on, recomputation ``mode`` against none: losses, gradients and weights bit for bit."""
    mesh = mesh_for(dp, tp, pp, cp)
    # ring attention has no attention dropout (refused)
    dropout = DROPOUT[kind.removesuffix("_deep")] if cp == 1 else {}
    runs = {}
    for recompute in (mode, None):
        pm = qn_hf.parallelize(load(kind, model_dir, **dropout), dp=dp, tp=tp, pp=pp, cp=cp, microbatches=microbatches,
                               mesh=mesh, seed=5, recompute=recompute, sequence_parallel=sequence_parallel,
                               schedule=schedule, virtual_stages=virtual_stages)
        opt = qn_hf.optimizer(pm, torch.optim.SGD, lr=0.1)
        losses = train(pm, opt, kind=kind, steps=steps, microbatch_rows=2, clip=None)
        batch = make_batch(kind, size=dp * 2 * microbatches, seed=999, padded=kind != "vit", seq=16)
        opt.zero_grad()
        pm.train_step(dp_slice(batch, dp=dp, dp_rank=pm.coords["dp"]))
        runs[recompute] = (losses, {n: p.grad.clone() for n, p in pm.named_parameters()}, local_weights(pm))
    (losses, grads, weights), (ref_losses, ref_grads, ref_weights) = runs[mode], runs[None]
    return {"losses": losses, "ref_losses": ref_losses,
            "grads_equal": all(torch.equal(grads[n], g) for n, g in ref_grads.items()),
            "weights_equal": all(torch.equal(weights[n], w) for n, w in ref_weights.items()),
            "max_grad_diff": max((grads[n] - g).abs().max().item() for n, g in ref_grads.items())}


def reference_mixed(*, kind: str, model_dir: str, dtype: torch.dtype, rows: int, steps: int, opt_class, kwargs):
    """The plain model trained the way mixed precision promises, by hand: weights cast to ``dtype``
    for compute, float32 gradients, the optimizer on float32 master weights cast back after each step."""
    ref = load(kind, model_dir)
    masters = {n: p.detach().clone() for n, p in ref.named_parameters()}
    for p in ref.parameters():
        p.data = p.data.to(dtype)
        p.grad_dtype = torch.float32
    params = dict(ref.named_parameters())
    opt = opt_class(list(masters.values()), **kwargs)
    losses = []
    for step in range(steps):
        batch = make_batch(kind, size=rows, seed=100 + step, padded=kind != "vit")
        loss = ref(**batch).loss
        loss.backward()
        for n, m in masters.items():
            m.grad = params[n].grad
        opt.step()
        opt.zero_grad()
        for n, p in params.items():
            p.grad = None
            p.data.copy_(masters[n])
        losses.append(loss.item())
    for tied in set(dict(ref.named_parameters(remove_duplicate=False))) - set(params):  # GPT-2's lm_head
        masters[tied] = masters["transformer.wte.weight"]
    return losses, masters


def mixed_parity(*, kind: str, model_dir: str, dp: int, tp: int, pp: int, microbatches: int, zero: bool,
                 precision: str = "bf16", steps: int = 2, opt_name: str = "SGD", schedule: str = "1f1b",
                 recompute: str | None = None, sequence_parallel: bool = False, cp: int = 1,
                 loss_chunk_tokens: int | None = None, offload: str | None = None) -> dict:
    """Mixed precision at a mesh against the hand-made reference: losses, float32 masters (cut to this
    rank's shard), and what lives in which dtype."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    pm = qn_hf.parallelize(load(kind, model_dir), dp=dp, tp=tp, pp=pp, microbatches=microbatches,
                           mesh=mesh_for(dp, tp, pp, cp), mixed_precision=precision, schedule=schedule,
                           virtual_stages=virtual_for(schedule), recompute=recompute,
                           sequence_parallel=sequence_parallel, cp=cp, loss_chunk_tokens=loss_chunk_tokens,
                           offload=offload)
    cls = getattr(torch.optim, opt_name)
    kwargs = {"lr": 0.1, "momentum": 0.9} if opt_name == "SGD" else {"lr": 1e-3}
    opt = qn_hf.optimizer(pm, cls, zero=zero, **kwargs)
    losses = train(pm, opt, kind=kind, steps=steps, microbatch_rows=2, clip=None)
    ref_losses, masters = reference_mixed(kind=kind, model_dir=model_dir, dtype=dtype, rows=dp * 2 * microbatches,
                                          steps=steps, opt_class=cls, kwargs=kwargs)
    master_err = 0.0
    for m in opt.masters:
        want = shard_of(pm, m.name, masters[m.name]).reshape(-1)[m.start : m.start + m.tensor.numel()]
        master_err = max(master_err, (m.tensor.reshape(-1) - want).abs().max().item())
    params_are_masters = all(torch.equal(m.tensor.reshape(-1).to(dtype),
                                         m.param.detach().reshape(-1)[m.start : m.start + m.tensor.numel()])
                             for m in opt.masters)
    return {"losses": losses, "ref_losses": ref_losses, "master_err": master_err,
            "moved": max((masters[n] - p).abs().max().item()
                         for n, p in load(kind, model_dir).named_parameters()),
            "grad_dtypes": sorted({str(g.dtype) for _, g in pm.named_grads()}),
            "params_are_masters": params_are_masters,
            "param_dtypes": sorted({str(p.dtype) for p in pm.parameters()}),
            "master_dtypes": sorted({str(m.tensor.dtype) for m in opt.masters}),
            "state_dtypes": sorted({str(t.dtype) for s in opt.state.values() for t in s.values() if t.ndim > 0}),
            "skipped": opt.skipped_steps, "scale": pm.scaler.scale if pm.scaler is not None else None}


def _resume_step(pm, opt, kind: str, step: int) -> float:
    return train_from(pm, opt, kind=kind, first=step, steps=1)[0]


def train_from(pm, opt, *, kind: str, first: int, steps: int) -> list[float]:
    losses = []
    for step in range(first, first + steps):
        batch = make_batch(kind, size=8, seed=100 + step, padded=kind != "vit")
        opt.zero_grad()
        losses.append(pm.train_step(dp_slice(batch, dp=pm.dims.dp, dp_rank=pm.coords["dp"])).item())
        qn_hf.clip_grad_norm_(pm, 1.0)
        opt.step()
    return losses


def save_and_continue(*, kind: str, model_dir: str, ckpt: str, out: str, dp: int, tp: int, pp: int, zero: bool,
                      precision: str | None, dp_shard: int = 1) -> float:
    """Two steps, a checkpoint with the optimizer, a third step, the weights after it exported."""
    pm = qn_hf.parallelize(load(kind, model_dir), dp=dp, tp=tp, pp=pp, microbatches=2, mesh=mesh_for(dp, tp, pp),
                           mixed_precision=precision, dp_shard=dp_shard)
    opt = qn_hf.optimizer(pm, torch.optim.AdamW, zero=zero, param_groups=groups_of(pm.named_parameters()), lr=1e-3)
    train_from(pm, opt, kind=kind, first=0, steps=2)
    pm.save_checkpoint(ckpt, optimizer=opt, step=2)
    loss = train_from(pm, opt, kind=kind, first=2, steps=1)[0]
    pm.save_pretrained(out)
    return loss


def resume(*, kind: str, model_dir: str, ckpt: str, out: str, dp: int, tp: int, pp: int, zero: bool | None,
           precision: str | None, dp_shard: int = 1) -> dict:
    """Load at another mesh (``zero=None``: a plain torch AdamW over pm.parameters()) and take the third step."""
    pm = qn_hf.parallelize(load(kind, model_dir), dp=dp, tp=tp, pp=pp, microbatches=2, mesh=mesh_for(dp, tp, pp),
                           mixed_precision=precision, dp_shard=dp_shard)
    if zero is None:
        opt = torch.optim.AdamW(groups_of(pm.named_parameters()), lr=1e-3)
    else:
        opt = qn_hf.optimizer(pm, torch.optim.AdamW, zero=zero, param_groups=groups_of(pm.named_parameters()), lr=1e-3)
    meta = pm.load_checkpoint(ckpt, optimizer=opt)
    loss = train_from(pm, opt, kind=kind, first=2, steps=1)[0]
    pm.save_pretrained(out)
    return {"step": meta["step"], "loss": loss}


def fp16_overflow(*, kind: str, model_dir: str, dp: int) -> dict:
    """A loss scale too large for float16: the step is skipped on every rank and the scale halves;
    the next step (smaller scale) trains."""
    pm = qn_hf.parallelize(load(kind, model_dir), dp=dp, mesh=mesh_for(dp, 1, 1), mixed_precision="fp16")
    opt = qn_hf.optimizer(pm, torch.optim.SGD, zero=dp > 1, lr=0.1)
    pm.scaler.scale = 2.0**40
    before = local_weights(pm)
    train(pm, opt, kind=kind, steps=1, microbatch_rows=2, clip=1.0)
    unchanged = all(torch.equal(before[n], w) for n, w in local_weights(pm).items())
    skipped, scale = opt.skipped_steps, pm.scaler.scale
    pm.scaler.scale = 2.0**10
    train(pm, opt, kind=kind, steps=1, microbatch_rows=2, clip=1.0)
    moved = any(not torch.equal(before[n], w) for n, w in local_weights(pm).items())
    return {"unchanged": unchanged, "skipped": skipped, "scale": scale, "moved": moved,
            "skipped_after": opt.skipped_steps}


def bad_input(*, model_dir: str) -> dict:
    """Each misuse of the optimizer, mixed precision and recomputation, and what it raises."""
    from tests.cases import error_message
    mesh = mesh_for(2, 1, 1)
    pm = qn_hf.parallelize(load("llama", model_dir), dp=2, mesh=mesh)
    other = torch.nn.Parameter(torch.zeros(3))
    out = {
        "adafactor": error_message(lambda: qn_hf.optimizer(pm, torch.optim.Adafactor, zero=True)),
        "muon": error_message(lambda: qn_hf.optimizer(pm, torch.optim.Muon, zero=True)),
        "not_a_class": error_message(lambda: qn_hf.optimizer(pm, "adamw")),
        "foreign": error_message(lambda: qn_hf.optimizer(pm, torch.optim.SGD, param_groups=[{"params": [other]}], lr=1)),
        "precision": error_message(lambda: qn_hf.parallelize(load("llama", model_dir), dp=2, mesh=mesh,
                                                             mixed_precision="fp8")),
        "recompute": error_message(lambda: qn_hf.parallelize(load("llama", model_dir), dp=2, mesh=mesh,
                                                             recompute="some")),
    }
    opt = qn_hf.optimizer(pm, torch.optim.AdamW, zero=True, lr=1e-3)
    out["second"] = error_message(lambda: qn_hf.optimizer(pm, torch.optim.AdamW, lr=1e-3))
    batch = dp_slice(make_batch("llama", size=4, seed=1), dp=2, dp_rank=pm.coords["dp"])
    pm.train_step(batch)
    opt.step()
    out["no_zero_grad"] = error_message(lambda: pm.train_step(batch))
    mixed = qn_hf.parallelize(load("llama", model_dir), dp=2, mesh=mesh, mixed_precision="bf16")
    out["mixed_without_optimizer"] = error_message(lambda: mixed.train_step(batch))
    return out


def one_process_api(*, model_dir: str) -> dict:
    """zero=True at dp=1 says it is a no-op; LR schedulers drive the wrapped optimizer's groups;
    state_dict round-trips; a bfloat16 model without mixed_precision trains as is, with a warning."""
    import warnings
    pm = qn_hf.parallelize(load("llama", model_dir), mesh=mesh_for(1, 1, 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = qn_hf.optimizer(pm, torch.optim.AdamW, zero=True, lr=1e-3)
    zero_warning = any("zero=True with dp=1 shards nothing" in str(w.message) for w in caught)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    batch = make_batch("llama", size=2, seed=3)
    pm.train_step(batch)
    opt.step()
    sched.step()
    import copy
    saved = copy.deepcopy(opt.state_dict())  # state_dict() hands out the live tensors
    opt.zero_grad()
    pm.train_step(batch)
    opt.step()
    moved = not all(torch.equal(opt.state[p]["exp_avg"], s["exp_avg"])
                    for p, s in zip(opt.param_groups[0]["params"], saved["state"].values()))
    opt.load_state_dict(saved)
    restored = all(torch.equal(opt.state[p]["exp_avg"], s["exp_avg"])
                   for p, s in zip(opt.param_groups[0]["params"], saved["state"].values()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qn_hf.parallelize(load("llama", model_dir, dtype=torch.bfloat16), mesh=mesh_for(1, 1, 1))
    return {"zero_warning": zero_warning, "lr": opt.param_groups[0]["lr"], "inner_lr": opt.inner.param_groups[0]["lr"],
            "state_dict_keys": set(saved), "restored": restored and moved,
            "bf16_warning": any("trains as is" in str(w.message) for w in caught)}


def skip_nonfinite_case(*, kind: str, model_dir: str, dp: int, tp: int, zero: bool) -> dict:
    """One step with a NaN planted in one rank's gradients (skipped on every rank: weights and state
    unchanged), then a clean step (taken)."""
    import qn_hf
    from tests.cases import mesh_for
    from tests.models import dp_slice, load, make_batch

    torch.manual_seed(0)
    pm = qn_hf.parallelize(load(kind, model_dir), dp=dp, tp=tp, mesh=mesh_for(dp, tp))
    opt = qn_hf.optimizer(pm, torch.optim.AdamW, zero=zero, skip_nonfinite=True, lr=1e-2)
    batch = dp_slice(make_batch(kind, size=2 * dp, seed=1), dp=dp, dp_rank=pm.coords["dp"])
    before = {n: p.detach().clone() for n, p in pm.named_parameters()}
    pm.train_step(batch)
    if dist.get_rank() == dp * tp - 1:  # one rank's gradient only
        grad = next(g for _, g in pm.named_grads())
        grad.view(-1)[0] = float("nan")
    opt.step()
    unchanged = all(torch.equal(before[n], p) for n, p in pm.named_parameters())
    skipped, state = opt.skipped_steps, len(opt.state)
    opt.zero_grad()
    pm.train_step(batch)
    opt.step()
    moved = any(not torch.equal(before[n], p) for n, p in pm.named_parameters())
    return {"unchanged": unchanged, "skipped": skipped, "state_after_skip": state, "moved": moved,
            "skipped_after": opt.skipped_steps}
