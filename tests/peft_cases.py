"""World jobs for PEFT/LoRA and frozen parameters: one step against peft in one process."""

from __future__ import annotations

import torch
import torch.distributed as dist

import qn_hf
from tests.cases import mesh_for, reference_grad, whole
from tests.models import dp_slice, load, make_batch


def lora_model(kind: str, model_dir: str, *, targets: list[str], use_dora: bool = False, r: int = 4,
               dropout: float = 0.0):
    """peft's LoRA with random A and B (``init_lora_weights=False``: B = 0 would give A no gradient)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(11)
    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, lora_dropout=dropout, init_lora_weights=False,
                        use_dora=use_dora)
    return get_peft_model(load(kind, model_dir), config)


def lora_parity(*, kind: str, model_dir: str, out_dir: str, targets: list[str], dp: int = 1, tp: int = 1, pp: int = 1,
                microbatches: int = 1, schedule: str = "1f1b", sequence_parallel: bool = False,
                use_dora: bool = False, zero: bool = False, recompute: str | None = None, cp: int = 1,
                dp_shard: int = 1, loss_chunk_tokens: int | None = None, offload: str | None = None) -> dict:
    """One SGD step of LoRA: loss, every adapter gradient, the adapter written by save_pretrained and
    loaded by ``PeftModel.from_pretrained``, the merged model, and base weights untouched."""
    from peft import PeftModel

    ref = lora_model(kind, model_dir, targets=targets, use_dora=use_dora)
    pm = qn_hf.parallelize(lora_model(kind, model_dir, targets=targets, use_dora=use_dora), dp=dp, tp=tp, pp=pp,
                           microbatches=microbatches, schedule=schedule, mesh=mesh_for(dp, tp, pp, cp),
                           sequence_parallel=sequence_parallel, bucket_mb=0.001, recompute=recompute,
                           virtual_stages=2 if schedule == "interleaved_1f1b" else 1, cp=cp, dp_shard=dp_shard,
                           loss_chunk_tokens=loss_chunk_tokens, offload=offload)
    batch = make_batch(kind, size=dp * 2 * microbatches, seed=7, padded=True)
    local = dp_slice(batch, dp=dp, dp_rank=pm.coords["dp"])
    before = {n: whole(p.detach()).clone() for n, p in pm.named_parameters()}
    ref_before = {n: p.detach().clone() for n, p in ref.named_parameters() if "lora_" in n}
    opt = qn_hf.optimizer(pm, torch.optim.SGD, zero=zero, lr=0.5)
    loss = pm.train_step(local)
    ref_loss = ref(**batch).loss
    ref_loss.backward()

    ref_params = dict(ref.get_base_model().named_parameters())
    grad_err, frozen_with_grad, trained = 0.0, [], 0
    for name, p in pm.named_parameters():
        if not p.requires_grad:
            if p.grad is not None:
                frozen_with_grad.append(name)
            continue
        trained += 1
        if not pm.grads_split_over_dp:
            grad_err = max(grad_err, (whole(p.grad) - reference_grad(ref_params, name, pm)).abs().max().item())
    opt.step()
    torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.5).step()
    base_moved = max((whole(p.detach()) - before[n]).abs().max().item() for n, p in pm.named_parameters()
                     if not p.requires_grad)
    generated = None
    if schedule != "interleaved_1f1b" and cp == 1:  # evaluation samples from the trained adapter, as peft's model gives them
        prompt = batch["input_ids"][:2, :5]
        generated = (pm.generate(prompt, max_new_tokens=4, do_sample=False).tolist()
                     == ref.generate(input_ids=prompt, max_new_tokens=4, do_sample=False).tolist())
    pm.save_pretrained(out_dir)

    loaded = PeftModel.from_pretrained(load(kind, model_dir), out_dir)
    got = dict(loaded.named_parameters())
    lora_err = max((got[n] - p).abs().max().item() for n, p in ref.named_parameters() if "lora_" in n)
    lora_moved = max((p - ref_before[n]).abs().max().item() for n, p in ref.named_parameters() if "lora_" in n)
    merged = dict(loaded.merge_and_unload().named_parameters())
    ref_merged = dict(ref.merge_and_unload().named_parameters())
    merged_err = max((merged[n] - p).abs().max().item() for n, p in ref_merged.items())
    return {
        "rank": dist.get_rank(), "loss": loss.item(), "ref_loss": ref_loss.item(), "grad_err": grad_err,
        "frozen_with_grad": frozen_with_grad, "trained": trained, "base_moved": base_moved,
        "lora_err": lora_err, "lora_moved": lora_moved, "merged_err": merged_err, "generated": generated,
        "lora_saved": sum("lora_" in n for n in got), "lora_ref": sum("lora_" in n for n in ref_params),
    }


def peft_error(*, kind: str, model_dir: str, method: str, tp: int = 1, targets: list[str] | None = None) -> str:
    """The ValueError parallelize raises for a PEFT model it does not support (no collective runs)."""
    import peft

    model = load(kind, model_dir)
    if method == "prefix":
        wrapped = peft.get_peft_model(model, peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    elif method == "ia3":
        wrapped = peft.get_peft_model(model, peft.IA3Config(task_type="CAUSAL_LM", target_modules=targets,
                                                            feedforward_modules=[]))
    elif method == "dora":
        wrapped = lora_model(kind, model_dir, targets=targets, use_dora=True)
    elif method == "lora_head":
        wrapped = lora_model(kind, model_dir, targets=targets)
    else:
        raise AssertionError(method)
    try:
        qn_hf.parallelize(wrapped, tp=tp, mesh=mesh_for(1, tp))
    except ValueError as e:
        return str(e)
    return "no error"


def lora_steps(*, model_dir: str | None, ckpt: str, out: str, dp: int = 1, tp: int = 1, pp: int = 1, ep: int = 1,
               steps: int = 2, resume: bool = False, experts: str | None = None) -> dict:
    """AdamW steps of LoRA on Llama (or with ``experts``, the MoE model of that type with LoRA on its
    fused experts); the first run saves a checkpoint after step 1, a resumed run loads it (at its own
    mesh) and runs the rest. The adapter goes to ``out``."""
    model = (expert_lora_model(experts) if experts else
             lora_model("llama", model_dir, targets=["q_proj", "v_proj", "o_proj", "down_proj"]))
    pm = qn_hf.parallelize(model, dp=dp, tp=tp, pp=pp, ep=ep, microbatches=2 if pp > 1 else 1,
                           mesh=mesh_for(dp, tp, pp))
    opt = qn_hf.optimizer(pm, torch.optim.AdamW, lr=1e-2)
    first = 1
    if resume:
        first = pm.load_checkpoint(ckpt, optimizer=opt)["step"] + 1
    losses = []
    for step in range(first, steps + 1):
        batch = make_batch("llama", size=4, seed=100 + step)  # token ids below every vocabulary here
        opt.zero_grad()
        losses.append(pm.train_step(dp_slice(batch, dp=dp, dp_rank=pm.coords["dp"])).item())
        opt.step()
        if step == 1 and not resume:
            pm.save_checkpoint(ckpt, optimizer=opt, step=1)
    pm.save_pretrained(out)
    return {"losses": losses, "trainable": sorted(n for n, p in pm.named_parameters() if p.requires_grad)}


def lora_bf16(*, model_dir: str, tp: int, pp: int, precision: str = "bf16") -> dict:
    """LoRA under mixed_precision="bf16" (or "fp16", loss-scaled): float32 masters for the adapter only,
    none for the frozen base."""
    pm = qn_hf.parallelize(lora_model("llama", model_dir, targets=["q_proj", "v_proj", "o_proj", "down_proj"]), tp=tp,
                           pp=pp, microbatches=2, mesh=mesh_for(1, tp, pp), mixed_precision=precision)
    opt = qn_hf.optimizer(pm, torch.optim.AdamW, lr=1e-3)
    batch = make_batch("llama", size=4, seed=7)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        losses.append(pm.train_step(batch).item())
        opt.step()
    ref = lora_model("llama", model_dir, targets=["q_proj", "v_proj", "o_proj", "down_proj"])
    masters = sum(m.tensor.numel() for m in opt.masters)
    return {"losses": losses, "ref_loss": ref(**batch).loss.item(), "masters": masters,
            "trainable": sum(p.numel() for p in pm.parameters() if p.requires_grad),
            "dtypes": sorted({str(p.dtype) for p in pm.parameters()})}


def lora_dropout_masks(*, model_dir: str) -> dict:
    """lora_dropout=0.5 at tp=2: a column target's dropout sees the whole input on every rank and
    must draw the same mask there; a row target's sees this rank's slice and must draw its own."""
    pm = qn_hf.parallelize(lora_model("llama", model_dir, targets=["q_proj", "down_proj"], dropout=0.5), tp=2,
                           mesh=mesh_for(1, 2))
    masks: dict[str, torch.Tensor] = {}
    for name, module in pm.module.named_modules():
        if name.endswith("lora_dropout.default"):
            module.register_forward_hook(lambda m, args, out, name=name: masks.__setitem__(name, out == 0))
    pm.train()
    pm(input_ids=make_batch("llama", size=2, seed=3)["input_ids"])
    same = {}
    for name, mask in masks.items():
        other = [torch.zeros_like(mask, dtype=torch.uint8) for _ in range(2)]
        dist.all_gather(other, mask.to(torch.uint8), group=pm.groups.tp)
        same[name] = bool(torch.equal(other[0], other[1]))
    return same


def adapter_files(*, kind: str, model_dir: str, ref_dir: str, out_dir: str, task_type: str | None, dp: int = 1,
                  dp_shard: int = 1, tp: int = 1, pp: int = 1) -> dict:
    """One SGD step of LoRA at a mesh, then the adapter directory qn_hf writes against the one peft
    writes in one process after the same step, and the logits of every loader peft and transformers
    document on qn_hf's directory against the trained reference's."""
    import json
    import os

    from peft import AutoPeftModelForCausalLM, LoraConfig, PeftModel, get_peft_model

    def wrapped():
        torch.manual_seed(11)
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                            task_type=task_type)
        return get_peft_model(load(kind, model_dir), config)

    ref = wrapped()
    pm = qn_hf.parallelize(wrapped(), dp=dp, dp_shard=dp_shard, tp=tp, pp=pp, microbatches=pp,
                           mesh=mesh_for(dp, tp, pp))
    batch = make_batch(kind, size=dp * 2 * pp, seed=7, padded=True)
    opt = qn_hf.optimizer(pm, torch.optim.SGD, lr=0.5)
    pm.train_step(dp_slice(batch, dp=dp, dp_rank=pm.coords["dp"]))
    opt.step()
    ref(**batch).loss.backward()
    torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.5).step()
    pm.save_pretrained(out_dir)
    if dist.get_rank() != 0:
        return {}
    ref.save_pretrained(ref_dir)
    ours, theirs = (json.load(open(os.path.join(d, "adapter_config.json"))) for d in (out_dir, ref_dir))
    loaded = {
        "PeftModel.from_pretrained": PeftModel.from_pretrained(load(kind, model_dir), out_dir),
        "AutoPeftModelForCausalLM": AutoPeftModelForCausalLM.from_pretrained(out_dir),
    }
    base = load(kind, model_dir)
    base.load_adapter(out_dir)  # transformers' own PEFT integration
    loaded["load_adapter"] = base
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        want = ref(**inputs).logits
        errors = {how: (model(**inputs).logits - want).abs().max().item() for how, model in loaded.items()}
    return {"ours": ours, "theirs": theirs, "errors": errors}


def lora_dropout_runs(*, model_dir: str, targets: list[str]) -> dict:
    """LoRA with lora_dropout=0.1 at tp=2, with and without sequence parallelism (same seed): two SGD
    steps' losses and the adapter's gradients, and whether each column target's dropout mask was the
    same on both tp ranks (its input is whole on every rank)."""
    from qn_hf.comm import all_gather_tensors

    runs = {}
    for sp in (True, False):
        pm = qn_hf.parallelize(lora_model("llama", model_dir, targets=targets, dropout=0.1), tp=2, seed=7,
                               sequence_parallel=sp, mesh=mesh_for(1, 2))
        masks: list[torch.Tensor] = []
        q_dropout = pm.module.get_submodule("model.layers.0.self_attn.q_proj.lora_dropout.default")
        q_dropout.register_forward_hook(lambda _m, args, out: masks.append((out == 0) & (args[0] != 0)))
        opt = torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=0.5)
        losses = []
        for step in range(2):
            opt.zero_grad()
            losses.append(pm.train_step(make_batch("llama", size=2, seed=20 + step, seq=16)).item())
            grads = {n: p.grad.clone() for n, p in pm.named_parameters() if p.requires_grad}
            opt.step()
        mask = masks[0].float()
        gathered = all_gather_tensors(mask, group=pm.groups.tp)
        runs[sp] = (losses, grads, torch.equal(gathered[0], gathered[1]), mask.mean().item())
    (losses, grads, same_mask, dropped), (ref_losses, ref_grads, _, _) = runs[True], runs[False]
    return {"losses": losses, "ref_losses": ref_losses, "same_mask_over_tp": same_mask, "dropped": dropped,
            "grad_err": max((grads[n] - g).abs().max().item() for n, g in ref_grads.items())}


EXPERT_TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def expert_lora_model(model_type: str):
    """peft's LoRA on the fused expert weights (``target_parameters``, stacked factors of every expert)
    and on q/v, random A and B, on the shrunk MoE model of the ep tests."""
    from peft import LoraConfig, get_peft_model

    from qn_hf.check.run import build
    from tests.ep_cases import moe_config

    model = build(moe_config(model_type), seed=0)
    torch.manual_seed(11)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], target_parameters=EXPERT_TARGETS,
                        init_lora_weights=False)
    return get_peft_model(model, config)


def expert_lora_parity(*, model_type: str, out_dir: str, dp: int = 1, tp: int = 1, pp: int = 1, ep: int = 1,
                       cp: int = 1, microbatches: int = 1, sequence_parallel: bool = False, zero: bool = False,
                       schedule: str = "1f1b") -> dict:
    """One SGD step of LoRA on the experts against peft in one process: loss, every adapter gradient
    (cut as this rank holds it), the adapter written by save_pretrained and read by
    ``PeftModel.from_pretrained``, its merge, and generate."""
    from peft import PeftModel

    from qn_hf.check.run import build
    from tests.ep_cases import moe_config

    ref = expert_lora_model(model_type)
    pm = qn_hf.parallelize(expert_lora_model(model_type), dp=dp, tp=tp, pp=pp, ep=ep, cp=cp, microbatches=microbatches,
                           schedule=schedule, virtual_stages=2 if schedule == "interleaved_1f1b" else 1,
                           sequence_parallel=sequence_parallel, mesh=mesh_for(dp, tp, pp, cp), bucket_mb=0.001)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, ref.config.vocab_size, (dp * 2 * microbatches, 16), generator=gen)
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    batch["attention_mask"][::2, -5:] = 0
    batch["labels"][batch["attention_mask"] == 0] = -100
    local = dp_slice(batch, dp=dp, dp_rank=pm.coords["dp"])
    opt = qn_hf.optimizer(pm, torch.optim.SGD, zero=zero, lr=0.5)
    loss = pm.train_step(local)
    ref_loss = ref(**batch, use_cache=False).loss
    ref_loss.backward()

    ref_params = dict(ref.get_base_model().named_parameters())
    grad_err, worst, trained = 0.0, "", []
    for name, p in pm.named_parameters():
        if not p.requires_grad:
            continue
        trained.append(name)
        spec = pm.specs.get(name)
        full = ref_params[name].grad
        expected = full if spec is None else spec.shard(full, pm.placement.shard_rank(spec))
        if not pm.grads_split_over_dp and (err := (p.grad - expected).abs().max().item()) > grad_err:
            grad_err, worst = err, name
    opt.step()
    torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.5).step()
    generated = None
    if schedule != "interleaved_1f1b" and cp == 1:
        prompt = batch["input_ids"][:2, :5]
        generated = (pm.generate(prompt, max_new_tokens=4, do_sample=False).tolist()
                     == ref.generate(input_ids=prompt, max_new_tokens=4, do_sample=False).tolist())
    pm.save_pretrained(out_dir)
    dist.barrier()
    loaded = PeftModel.from_pretrained(build(moe_config(model_type), seed=0), out_dir)
    got = dict(loaded.named_parameters())
    lora = {n: p for n, p in ref.named_parameters() if "lora_" in n}
    lora_err = max((got[n] - p).abs().max().item() for n, p in lora.items())
    merged = dict(loaded.merge_and_unload().named_parameters())
    merged_err = max((merged[n] - p).abs().max().item() for n, p in ref.merge_and_unload().named_parameters())
    experts = [n for n in trained if ".mlp.experts." in n]
    return {"loss": loss.item(), "ref_loss": ref_loss.item(), "grad_err": grad_err, "worst": worst,
            "expert_factors": len(experts), "lora_err": lora_err, "merged_err": merged_err, "generated": generated,
            "lora_saved": sum("lora_" in n for n in got), "lora_ref": len(lora),
            "expert_shapes": sorted({tuple(dict(pm.named_parameters())[n].shape) for n in experts})}
