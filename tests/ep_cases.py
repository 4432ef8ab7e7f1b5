"""Code that runs inside test worlds for expert parallelism (every rank)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from transformers import CONFIG_MAPPING

import qn_hf
from qn_hf.check.run import build, model_class
from qn_hf.check.shrink import shrink_config
from qn_hf.expert_parallel.apply import experts_modules
from qn_hf.tensor_parallel.shard import over_experts
from tests.cases import mesh_for, optimizer_step, whole

SEQ = 12
ROWS = 2  # per dp rank and microbatch


def moe_config(model_type: str, **overrides):
    config = shrink_config(CONFIG_MAPPING[model_type]())
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def _skew(model: torch.nn.Module, skew: str) -> None:
    """Routing far from even: ``empty_rank`` sends every token to experts 0 and 1 (DeepSeek's
    selection bias), so at ep=2 the second rank receives nothing; ``uneven`` adds one direction u to
    every token embedding and makes each router score mostly (2, 1, 0, -1) times u, so experts 0
    and 1 take most tokens and expert 3 few or none."""
    gen = torch.Generator().manual_seed(5)
    u = torch.randn(model.config.hidden_size, generator=gen)
    with torch.no_grad():
        if skew == "uneven":
            model.get_input_embeddings().weight.add_(u)
        for name, module in model.named_modules():
            if skew == "empty_rank" and hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.copy_(torch.tensor([8.0, 8.0, -8.0, -8.0]))
            if skew == "uneven" and name.endswith("mlp.gate"):
                scores = torch.outer(torch.tensor([2.0, 1.0, 0.0, -1.0]), u / u.norm())
                module.weight.copy_(scores * 4 + module.weight * 0.1)


def _expert_counts(model: torch.nn.Module) -> list[int]:
    """A hook on every experts module of the plain model: tokens routed to each expert (all layers)."""
    counts = torch.zeros(next(iter(experts_modules(model).values())).num_experts, dtype=torch.int64)

    def count(_module, args):
        counts.add_(torch.bincount(args[1].reshape(-1), minlength=counts.numel()))

    for module in experts_modules(model).values():
        module.register_forward_pre_hook(count)
    return counts


def ep_parity(*, model_type: str, out_dir: str, dp: int, tp: int, pp: int, ep: int, microbatches: int = 1,
              skew: str | None = None, overrides: dict | None = None, padded: bool = False,
              recompute: str | None = None, per_rank: int = ROWS, seq: int = SEQ, schedule: str = "1f1b",
              virtual_stages: int = 1, cp: int = 1, sequence_parallel: bool = False, dp_shard: int = 1,
              expert_dispatch: str = "all_to_all", loss_chunk_tokens: int | None = None,
              offload: str | None = None) -> dict:
    """One SGD step at (dp, tp, pp, ep) against the plain model: loss, every gradient, the grad norm,
    and every weight after the step read back through ``save_pretrained``. ``padded``: every other
    row ends in padding (attention_mask 0, labels -100)."""
    config = moe_config(model_type, **(overrides or {}))
    model = build(config, seed=0)
    if skew:
        _skew(model, skew)
    ref = copy.deepcopy(model)
    counts = _expert_counts(ref)
    pm = qn_hf.parallelize(model, dp=dp, tp=tp, pp=pp, ep=ep, cp=cp, microbatches=microbatches,
                           mesh=mesh_for(dp, tp, pp, cp), recompute=recompute, schedule=schedule,
                           virtual_stages=virtual_stages, sequence_parallel=sequence_parallel, dp_shard=dp_shard,
                           expert_dispatch=expert_dispatch, loss_chunk_tokens=loss_chunk_tokens, offload=offload)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, config.vocab_size, (dp * per_rank * microbatches, seq), generator=gen)
    batch = {"input_ids": ids, "labels": ids.clone()}
    if padded:
        batch["attention_mask"] = torch.ones_like(ids)
        batch["attention_mask"][::2, -5:] = 0
        batch["labels"][batch["attention_mask"] == 0] = -100
    rows = ids.shape[0] // dp
    local = {k: v[pm.coords["dp"] * rows : (pm.coords["dp"] + 1) * rows] for k, v in batch.items()}
    with qn_hf.CommMeter(pm) as meter:
        loss = pm.train_step(local).item()
    # the dispatch the step ran: the all-gather's gathers on "ep", or the all-to-all's count exchanges there
    gathers = sum(1 for e in meter.events if e.group == "ep" and e.op == "all_gather_into_tensor")
    ref.train()
    ref_loss = ref(**batch, use_cache=False).loss
    ref_loss.backward()

    ref_params = dict(ref.named_parameters())
    grad_err, worst = 0.0, ""
    for name, p in pm.named_parameters():
        ref_grad = ref_params[name].grad
        ref_grad = torch.zeros_like(ref_params[name]) if ref_grad is None else ref_grad
        err = (whole(p.grad) - _as_held(pm, name, ref_grad)).abs().max().item()
        if err > grad_err:
            grad_err, worst = err, name
    norm = qn_hf.clip_grad_norm_(pm, 1e9).item()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9).item()

    before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    for params in (list(pm.parameters()), list(ref.parameters())):
        torch.optim.SGD(params, lr=1.0).step()
    pm.save_pretrained(out_dir)
    dist.barrier()
    weight_err = moved = 0.0
    if dist.get_rank() == 0:
        reloaded = dict(model_class(config).from_pretrained(out_dir).named_parameters())
        weight_err = max((reloaded[n] - p).abs().max().item() for n, p in ref.named_parameters())
        moved = max((before[n] - p).abs().max().item() for n, p in ref.named_parameters())
    experts = [n for n, s in pm.specs.items() if over_experts(s)]
    params = dict(pm.named_parameters())
    return {
        "loss": loss, "ref_loss": ref_loss.item(), "grad_err": grad_err, "worst_grad": worst, "norm": norm,
        "ref_norm": ref_norm, "weight_err": weight_err, "moved": moved, "expert_counts": counts.tolist(),
        "expert_params": len(experts),
        "expert_rows": sorted({params[n].shape[0] for n in experts}), "ep_gathers": gathers,
    }


def ep_checkpoint_run(*, model_dir: str, dp: int, tp: int, pp: int, ep: int, load: str | None, steps: list[int],
                      save: str | None, export: str, zero: bool | None = None, schedule: str = "1f1b",
                      virtual_stages: int = 1, precision: str | None = None, dp_shard: int = 1) -> list[float]:
    """Load ``load`` (a checkpoint saved at any mesh), run ``steps``, export after each (``export-N``)
    and save a checkpoint after the first when asked. ``zero``: a ``qn_hf.optimizer`` with it (None:
    torch's AdamW over the parameters)."""
    from transformers import AutoConfig

    model = model_class(AutoConfig.from_pretrained(model_dir)).from_pretrained(model_dir).float()
    pm = qn_hf.parallelize(model, dp=dp, tp=tp, pp=pp, ep=ep, microbatches=max(pp, 1), mesh=mesh_for(dp, tp, pp),
                           schedule=schedule, virtual_stages=virtual_stages, mixed_precision=precision,
                           dp_shard=dp_shard)
    kwargs = dict(lr=1e-3, weight_decay=0.01)
    opt = (torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], **kwargs) if zero is None
           else qn_hf.optimizer(pm, torch.optim.AdamW, zero=zero, **kwargs))
    if load is not None:
        assert pm.load_checkpoint(load, optimizer=opt)["step"] == steps[0] - 1
    losses = []
    for i, step in enumerate(steps):
        losses.append(optimizer_step(pm, opt, seed=100 + step))
        pm.save_pretrained(f"{export}-{step}")
        if i == 0 and save is not None:
            pm.save_checkpoint(save, optimizer=opt, step=step)
    return losses


def ep_meta_load(*, model_dir: str, dp: int, tp: int, ep: int) -> dict:
    """A meta-device model reads its experts from a Hugging Face directory in per-expert layout
    (what transformers' save_pretrained writes by default) at (dp, tp, ep): the first step equals
    the plain model loaded with from_pretrained."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    ref = model_class(config).from_pretrained(model_dir).float()
    with torch.device("meta"):
        model = model_class(config)(config)
    pm = qn_hf.parallelize(model, dp=dp, tp=tp, ep=ep, checkpoint=model_dir, mesh=mesh_for(dp, tp, 1))
    loss, ref_loss = _step_both(pm, ref, vocab=config.vocab_size, seed=3)
    ref_params = dict(ref.named_parameters())
    err = max((p.detach() - _as_held(pm, name, ref_params[name].detach())).abs().max().item()
              for name, p in pm.named_parameters())
    return {"loss": loss, "ref_loss": ref_loss, "weight_err": err}


def _step_both(pm, ref: torch.nn.Module, *, vocab: int, seed: int, seq: int = SEQ,
               rows: int = ROWS) -> tuple[float, float]:
    """One ``train_step`` on this dp rank's ``rows`` of a seeded random global batch, and the plain
    model's loss on the whole batch with its backward: (loss, reference loss)."""
    dp = pm.dims.dp
    ids = torch.randint(3, vocab, (dp * rows, seq), generator=torch.Generator().manual_seed(seed))
    local = ids[pm.coords["dp"] * rows : (pm.coords["dp"] + 1) * rows]
    loss = pm.train_step({"input_ids": local, "labels": local.clone()}).item()
    ref_loss = ref(input_ids=ids, labels=ids, use_cache=False).loss
    ref_loss.backward()
    return loss, ref_loss.item()


def _as_held(pm, name: str, full: torch.Tensor) -> torch.Tensor:
    """``full`` (a tensor of the plain model) cut as this rank holds parameter ``name``."""
    spec = pm.specs.get(name)
    return full if spec is None else spec.shard(full, pm.placement.shard_rank(spec))


def ep_bf16_losses(*, model_type: str, ep: int, precision: str = "bf16", expert_dispatch: str = "all_to_all") -> dict:
    """Three AdamW steps in bf16 (or fp16, loss-scaled) with float32 masters at dp=2 and ``ep``: the
    losses, and the dtypes of the experts' gradients and masters."""
    model = build(moe_config(model_type), seed=0)
    pm = qn_hf.parallelize(model, dp=2, ep=ep, mixed_precision=precision, mesh=mesh_for(2, 1, 1),
                           **({"expert_dispatch": expert_dispatch} if ep > 1 else {}))
    opt = qn_hf.optimizer(pm, torch.optim.AdamW, lr=1e-3)
    ids = torch.randint(3, 100, (4, SEQ), generator=torch.Generator().manual_seed(0))
    local = ids[pm.coords["dp"] * 2 : (pm.coords["dp"] + 1) * 2]
    losses = []
    for _ in range(3):
        opt.zero_grad()
        losses.append(pm.train_step({"input_ids": local, "labels": local.clone()}).item())
        opt.step()
    experts = {n for n, s in pm.specs.items() if over_experts(s)}
    dtypes = {str(p.grad_dtype) for n, p in pm.named_parameters() if n in experts}
    masters = {str(m.tensor.dtype) for m in opt.masters if m.name in experts}
    return {"losses": losses, "grad_dtypes": sorted(dtypes), "master_dtypes": sorted(masters)}


def ep_zero_parity(*, model_type: str, dp: int, tp: int, pp: int, ep: int, precision: str | None = None,
                   steps: int = 2, recompute: str | None = None, schedule: str = "1f1b",
                   virtual_stages: int = 1, expert_dispatch: str = "all_to_all") -> dict:
    """``steps`` AdamW steps with clipping and ZeRO-1 at (dp, tp, pp, ep) against the same steps in
    one process (float32: torch's AdamW on the plain model; ``precision``: the same mesh without
    ZeRO): every loss and every local weight, and the bytes of the experts' optimizer state against
    the experts' local elements."""
    microbatches = max(pp * virtual_stages, 1)
    model = build(moe_config(model_type), seed=0)
    ref = copy.deepcopy(model)
    kwargs = dict(lr=1e-3, weight_decay=0.01)
    mesh = mesh_for(dp, tp, pp)
    gen = torch.Generator().manual_seed(7)
    batches = [torch.randint(3, model.config.vocab_size, (dp * ROWS * microbatches, SEQ), generator=gen)
               for _ in range(steps)]
    runs = {}
    for zero in ((True, False) if precision else (True,)):
        pm = qn_hf.parallelize(copy.deepcopy(model), dp=dp, tp=tp, pp=pp, ep=ep, microbatches=microbatches,
                               mesh=mesh, mixed_precision=precision, recompute=recompute, schedule=schedule,
                               virtual_stages=virtual_stages, expert_dispatch=expert_dispatch)
        opt = qn_hf.optimizer(pm, torch.optim.AdamW, zero=zero, **kwargs)
        losses, norms = [], []
        rows = batches[0].shape[0] // dp
        for ids in batches:
            local = ids[pm.coords["dp"] * rows : (pm.coords["dp"] + 1) * rows]
            opt.zero_grad()
            losses.append(pm.train_step({"input_ids": local, "labels": local.clone()}).item())
            norms.append(qn_hf.clip_grad_norm_(pm, 1.0).item())
            opt.step()
        weights = {n: p.detach().float().clone() for n, p in pm.named_parameters()}
        experts = {n for n, s in pm.specs.items() if over_experts(s)}
        state = sum(t.numel() * t.element_size() for m in opt.masters if m.name in experts
                    for t in opt.state[m.tensor].values() if isinstance(t, torch.Tensor) and t.ndim > 0)
        local_elements = sum(p.numel() for n, p in pm.named_parameters() if n in experts)
        runs[zero] = (losses, norms, weights, state, local_elements)
        pm.close()
    losses, norms, weights, state, local_elements = runs[True]
    out = {"losses": losses, "norms": norms, "expert_state_bytes": state, "expert_elements": local_elements,
           "expert_replicas": dp * tp // ep}
    if precision:  # against the unsharded optimizer at the same mesh
        ref_losses, ref_norms, ref_weights = runs[False][:3]
        out["weight_err"] = max((weights[n] - w).abs().max().item() for n, w in ref_weights.items())
    else:  # against the plain model in one process
        ref_opt = torch.optim.AdamW(ref.parameters(), **kwargs)
        ref_losses, ref_norms = [], []
        for ids in batches:
            ref_opt.zero_grad()
            loss = ref(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0).item())
            ref_opt.step()
            ref_losses.append(loss.item())
        named = dict(ref.named_parameters())
        out["weight_err"] = max((w - _shard(pm, n, named[n].detach())).abs().max().item() for n, w in weights.items())
    out["ref_losses"], out["ref_norms"] = ref_losses, ref_norms
    return out


def _shard(pm, name: str, full: torch.Tensor) -> torch.Tensor:
    spec = pm.specs.get(name)
    return full if spec is None else spec.shard(full, pm.placement.shard_rank(spec))


def ep_lora_parity(*, model_type: str, dp: int, tp: int, ep: int, targets: list[str],
                   expert_dispatch: str = "all_to_all") -> dict:
    """peft LoRA on an MoE model's attention with experts over ep (the base frozen, experts too): one
    step's loss and every adapter gradient against peft in one process."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(11)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    wrapped = get_peft_model(build(moe_config(model_type), seed=0), config)
    ref = copy.deepcopy(wrapped)
    pm = qn_hf.parallelize(wrapped, dp=dp, tp=tp, ep=ep, mesh=mesh_for(dp, tp, 1), expert_dispatch=expert_dispatch)
    ids = torch.randint(3, 100, (dp * ROWS, SEQ), generator=torch.Generator().manual_seed(4))
    local = ids[pm.coords["dp"] * ROWS : (pm.coords["dp"] + 1) * ROWS]
    loss = pm.train_step({"input_ids": local, "labels": local.clone()}).item()
    ref_loss = ref(input_ids=ids, labels=ids, use_cache=False).loss
    ref_loss.backward()
    ref_params = {n.removeprefix("base_model.model."): p for n, p in ref.named_parameters()}
    trained = [(n, p) for n, p in pm.named_parameters() if p.requires_grad]
    err = max((p.grad - _shard(pm, n, ref_params[n].grad)).abs().max().item() for n, p in trained)
    return {"loss": loss, "ref_loss": ref_loss.item(), "grad_err": err, "trained": len(trained),
            "experts_frozen": all(not p.requires_grad for n, p in pm.named_parameters() if ".experts." in n)}


def stacked_ep_parity(*, model_type: str, dp: int, tp: int, ep: int, expert_dispatch: str = "all_to_all",
                      seq: int = SEQ, rows: int = ROWS) -> dict:
    """One SGD step of a model whose experts take every token once per expert (Llama 4) at (dp, tp,
    ep) against the plain model: loss, every gradient cut as this rank holds it, and the local experts."""
    from qn_hf.expert_parallel.apply import sharded_experts

    config = moe_config(model_type)
    model = build(config, seed=0)
    ref = copy.deepcopy(model)
    pm = qn_hf.parallelize(model, dp=dp, tp=tp, ep=ep, mesh=mesh_for(dp, tp, 1), expert_dispatch=expert_dispatch)
    loss, ref_loss = _step_both(pm, ref, vocab=config.get_text_config().vocab_size, seed=1, seq=seq,
                                rows=rows)
    ref_params = dict(ref.named_parameters())
    grad_err = max((p.grad - _as_held(pm, name, ref_params[name].grad)).abs().max().item()
                   for name, p in pm.named_parameters())
    return {"loss": loss, "ref_loss": ref_loss, "grad_err": grad_err,
            "local_experts": sorted({m.gate_up_proj.shape[0] for m in sharded_experts(pm.module).values()}),
            "experts": next(iter(sharded_experts(ref).values())).num_experts}


def ep_unequal_batches() -> dict:
    """dp=2 x ep=2 with the all-gather dispatch: rank 1's batch one token longer (refused on both ranks),
    then a step of equal shapes (it trains: the refusal left no collective behind)."""
    model = build(moe_config("mixtral"), seed=0)
    pm = qn_hf.parallelize(model, dp=2, ep=2, expert_dispatch="all_gather")
    ids = torch.randint(3, 64, (2, SEQ + pm.coords["dp"]))
    try:
        pm.train_step({"input_ids": ids, "labels": ids})
        error = "no error"
    except ValueError as refused:
        error = str(refused)
    ids = ids[:, :SEQ]
    loss = pm.train_step({"input_ids": ids, "labels": ids})
    return {"error": error, "after": "trained" if torch.isfinite(loss) else "failed"}
