"""Code that runs inside test worlds (every rank), shared by several test files."""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

import qn_hf
from qn_hf.config.dims import ParallelDims
from qn_hf.mesh import build_mesh
from tests.models import dp_slice, load, make_batch

# One mesh per shape for the life of a worker: creating process groups is the slow part of a job.
_MESHES: dict[tuple[int, int, int, int], DeviceMesh] = {}


def mesh_for(dp: int, tp: int, pp: int = 1, cp: int = 1) -> DeviceMesh:
    key = (dp, pp, cp, tp)
    if key not in _MESHES:
        _MESHES[key] = build_mesh(ParallelDims(dp=dp, tp=tp, pp=pp, cp=cp), device=torch.device("cpu"))
    return _MESHES[key]


def pad_for_pooling(config, cls: str | None) -> None:
    """A shrunk config (or the part of it a class takes) without a pad token gets one, as checkpoints set it: a
    sequence classifier pools at the last token that is not padding, reading the text part's pad token (Qwen
    3.5's composite config keeps it there)."""
    parts = [config]
    if cls and cls.endswith("ForSequenceClassification") and hasattr(config, "get_text_config"):
        parts.append(config.get_text_config())
    for part in parts:
        if getattr(part, "pad_token_id", 0) is None:
            part.pad_token_id = 0


def mesh_groups() -> list:
    """The process groups of the meshes kept above (the launcher destroys every other after a job)."""
    return [mesh.get_group(name) for mesh in _MESHES.values() if mesh.get_coordinate() is not None
            for name in mesh.mesh_dim_names]


def parallelize_as_launched(model, **settings):
    """``qn_hf.parallelize(model, **settings)`` as a launch of the mesh's world size runs it (WORLD_SIZE
    set as torchrun sets it), so that its checks of the model and the degrees are reached: the world
    size is checked first. Used for refusals, which come before any process group is needed."""
    size = 1
    for name in ("dp", "tp", "pp", "cp"):
        size *= settings.get(name, 1)
    saved = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(size)
    try:
        return qn_hf.parallelize(model, **settings)
    finally:
        if saved is None:
            del os.environ["WORLD_SIZE"]
        else:
            os.environ["WORLD_SIZE"] = saved


def error_message(fn) -> str:
    """The message of the ValueError ``fn()`` raises, or "no error"."""
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "no error"


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in batch.items() if k != "labels"}


def reference_grad(ref_params: dict[str, torch.nn.Parameter], name: str, pm: qn_hf.ParallelModel) -> torch.Tensor:
    """The reference gradient cut to this rank's shard (zero rows where the vocabulary is padded)."""
    param = ref_params[name]
    grad = param.grad if param.grad is not None else torch.zeros_like(param)  # unused: zero on our side
    spec = pm.specs.get(name)
    return grad if spec is None else spec.shard(grad, pm.coords["tp"])


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A dp_shard-sharded tensor gathered (collective: every rank, in the same order), else as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def freeze(model: torch.nn.Module, prefixes: tuple[str, ...]) -> torch.nn.Module:
    for name, p in model.named_parameters():
        if name.startswith(tuple(prefixes)):
            p.requires_grad_(False)
    return model


def optimizer_step(pm: qn_hf.ParallelModel, opt, *, seed: int) -> float:
    """One step on 8 random sequences of 12 tokens (seeded, the same global batch at every mesh), this
    dp rank's rows."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, pm.config.vocab_size, (8, 12), generator=gen)
    rows = 8 // pm.dims.dp
    local = ids[pm.coords["dp"] * rows : (pm.coords["dp"] + 1) * rows]
    opt.zero_grad()
    loss = pm.train_step({"input_ids": local, "labels": local.clone()})
    opt.step()
    return loss.item()


@contextlib.contextmanager
def head_rows(pm: qn_hf.ParallelModel):
    """The number of positions of each output the model's head gives inside the ``with`` (empty on a
    stage without the real head)."""
    seen: list[int] = []
    head = pm.module.get_output_embeddings() if pm.stage.is_last else None
    handle = head.register_forward_hook(lambda _m, _a, out: seen.append(out.shape[:-1].numel())) if head else None
    try:
        yield seen
    finally:
        if handle is not None:
            handle.remove()


def offloaded(pm: qn_hf.ParallelModel) -> tuple[int, int] | None:
    """offload="activations": how many saved tensors went to the host and came back (None without it)."""
    offload = pm.context.offload
    return None if offload is None else (offload.packed, offload.unpacked)


def parity(*, kind: str, model_dir: str, out_dir: str, dp: int, tp: int, pp: int = 1, microbatches: int = 1,
           schedule: str = "1f1b", layers_per_stage: list[int] | None = None, padded: bool = False,
           per_rank: int = 2, bucket_mb: float = 25.0, sequence_parallel: bool = False, cp: int = 1,
           packed: bool = False, seq: int = 12, virtual_stages: int = 1, rows: int | None = None,
           frozen: tuple[str, ...] = (), recompute: str | None = None, dp_shard: int = 1,
           dp_shard_gather: str = "step", loss_chunk_tokens: int | None = None, offload: str | None = None) -> dict:
    """Forward, loss, every gradient, grad norm and weights after an optimizer step against the plain model.
    ``rows`` (default ``per_rank * microbatches``) is each dp rank's batch size, which the
    microbatches need not divide. Parameters under the ``frozen`` prefixes get ``requires_grad=False``
    in both models."""
    torch.manual_seed(0)
    ref, model = freeze(load(kind, model_dir), frozen), freeze(load(kind, model_dir), frozen)
    pm = qn_hf.parallelize(model, dp=dp, tp=tp, pp=pp, cp=cp, microbatches=microbatches,
                           schedule=schedule, layers_per_stage=layers_per_stage, bucket_mb=bucket_mb,
                           mesh=mesh_for(dp, tp, pp, cp), sequence_parallel=sequence_parallel,
                           virtual_stages=virtual_stages, recompute=recompute, dp_shard=dp_shard,
                           dp_shard_gather=dp_shard_gather, loss_chunk_tokens=loss_chunk_tokens, offload=offload)
    full_numel = {n: p.numel() for n, p in ref.named_parameters(remove_duplicate=False)}

    batch = make_batch(kind, size=dp * (rows or per_rank * microbatches), seed=7, padded=padded, packed=packed, seq=seq)
    local = dp_slice(batch, dp=dp, dp_rank=pm.coords["dp"])

    if packed:  # transformers separates packed documents only without a cache (its training setting, as ours)
        batch_for_ref = {**batch, "use_cache": False}
    else:
        batch_for_ref = batch
    ref.eval()
    with torch.no_grad():
        ref_eval = ref(**batch_for_ref).loss.item()
        ref_logits = dp_slice({"x": ref(**model_inputs(batch_for_ref)).logits}, dp=dp, dp_rank=pm.coords["dp"])["x"]
        logit_err = 0.0
        if pp == 1 and cp == 1:  # a forward call is one rank's; with stages or cp it spans several
            pm.eval()
            logits = pm.full_logits(pm(**model_inputs(local)).logits)
            logit_err = (logits - ref_logits).abs().max().item()
    eval_loss = pm.eval_step(local).item()

    with head_rows(pm) as rows_seen:
        loss = pm.train_step(local)
    ref.train()
    ref_loss = ref(**batch_for_ref).loss
    ref_loss.backward()
    ref_params = dict(ref.named_parameters(remove_duplicate=False))  # lm_head.weight too, when tied
    grad_err, worst = 0.0, ""
    frozen_with_grad = [n for n, p in pm.named_parameters() if not p.requires_grad and p.grad is not None]
    for name, p in pm.named_parameters():
        if not p.requires_grad:
            continue
        err = (whole(p.grad) - reference_grad(ref_params, name, pm)).abs().max().item()
        if err > grad_err:
            grad_err, worst = err, name

    norm = qn_hf.clip_grad_norm_(pm, 1e9)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)

    # SGD, not Adam: Adam turns float rounding in near-zero gradients into lr-sized steps
    # (g/|g|), which would test rounding, not parallelism.
    before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    for params in (list(pm.parameters()), list(ref.parameters())):
        torch.optim.SGD(params, lr=0.5).step()
    pm.save_pretrained(out_dir)
    reloaded = dict(load(kind, out_dir).named_parameters())
    weight_err = max((reloaded[n] - p).abs().max().item() for n, p in ref.named_parameters())
    weight_moved = max((before[n] - p).abs().max().item() for n, p in ref.named_parameters())

    sharded = {n for n, s in pm.specs.items() if s is not None}
    return {
        "rank": dist.get_rank(),
        "loss": loss.item(),
        "ref_loss": ref_loss.item(),
        "eval_loss": eval_loss,
        "ref_eval_loss": ref_eval,
        "logit_err": logit_err,
        "grad_err": grad_err,
        "worst_grad": worst,
        "norm": norm.item(),
        "ref_norm": ref_norm.item(),
        "weight_err": weight_err,
        "weight_moved": weight_moved,
        "local_sharded": sum(p.numel() for n, p in pm.named_parameters() if n in sharded),
        "full_sharded": sum(full_numel.get(n, 0) for n, _ in pm.named_parameters() if n in sharded),
        "local_total": sum(p.numel() for p in pm.parameters()),
        # what this rank stores: dp_shard keeps its rows of each tensor (DTensor.numel() is the whole's)
        "stored": sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in pm.parameters()),
        "frozen_with_grad": frozen_with_grad,
        "frozen_here": sum(not p.requires_grad for p in pm.parameters()),
        # what dp reduces: the trainable parameters only (None without dp)
        "bucketed": None if pm.buckets is None else sum(p.numel() for p in pm.buckets.params),
        "trainable": sum(p.numel() for p in pm.parameters() if p.requires_grad),
        "full_total": sum(full_numel.values()),
        "head_rows": rows_seen,  # the rows of each logits the head made in the step (this stage's)
        "offloaded": offloaded(pm),
    }


def cp_batch_errors(*, model_dir: str) -> dict:
    """Each batch mistake under cp=2 is one ValueError on every rank, raised before any collective."""
    pm = qn_hf.parallelize(load("llama", model_dir), cp=2, mesh=mesh_for(1, 1, 1, 2))
    # Mistral's layers pass config.sliding_window to the attention function: the ring computes the
    # window (it was refused before); the loss equals the plain model's
    mistral_dir = model_dir.replace("llama", "mistral")
    windowed = qn_hf.parallelize(load("mistral", mistral_dir, sliding_window=8), cp=2, mesh=mesh_for(1, 1, 1, 2))
    batch = make_batch("llama", size=2, seed=3, seq=14)
    good = make_batch("llama", size=2, seed=3, seq=16)
    window_batch = make_batch("mistral", size=2, seed=3, seq=16)
    return {
        "odd": error_message(lambda: pm.train_step(batch)),
        "keys": error_message(lambda: pm.train_step({**good, "token_type_ids": good["input_ids"] * 0})),
        "window": (windowed.train_step(window_batch).item(),
                   load("mistral", mistral_dir, sliding_window=8)(**window_batch).loss.item()),
        "mesh_dims": pm.mesh.mesh_dim_names,
        "coords": pm.coords,
    }


def uneven_loss_fn(*, model_dir: str, dp: int, pp: int, microbatches: int, rows: list[int], tp: int = 1,
                   cp: int = 1) -> dict:
    """A user loss_fn (a microbatch's mean) over dp ranks holding ``rows[dp_rank]`` examples each, cut
    into microbatches of different sizes: the step's loss and gradients are the plain model's mean
    over all the examples. Under cp the loss_fn sees whole sequences."""
    import torch.nn.functional as F

    def loss_fn(outputs, batch):
        logits = outputs.logits[:, :-1].float()
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"][:, 1:].flatten())

    ref = load("llama", model_dir)
    pm = qn_hf.parallelize(load("llama", model_dir), dp=dp, tp=tp, pp=pp, cp=cp, microbatches=microbatches,
                           mesh=mesh_for(dp, tp, pp, cp))
    batch = make_batch("llama", size=sum(rows), seed=11, seq=16 if cp > 1 else 12)
    start = sum(rows[: pm.coords["dp"]])
    local = {k: v[start : start + rows[pm.coords["dp"]]] for k, v in batch.items()}
    loss = pm.train_step(local, loss_fn=loss_fn)
    ref_loss = loss_fn(ref(**{k: v for k, v in batch.items() if k != "labels"}), batch)
    ref_loss.backward()
    params = dict(ref.named_parameters())
    err = max((p.grad - reference_grad(params, n, pm)).abs().max().item() for n, p in pm.named_parameters())
    return {"loss": loss.item(), "ref_loss": ref_loss.item(), "grad_err": err}


def mixed_precision_steps(*, model_dir: str, precision: str, dp: int, dp_shard: int, steps: int) -> dict:
    """``steps`` AdamW steps of Llama under ``mixed_precision`` (the same global batches at any dp):
    the losses, and the dtypes of the parameters the optimizer sees."""
    pm = qn_hf.parallelize(load("llama", model_dir), dp=dp, dp_shard=dp_shard, mixed_precision=precision,
                           mesh=mesh_for(dp, 1))
    opt = qn_hf.optimizer(pm, torch.optim.AdamW, lr=3e-3)
    losses = [optimizer_step(pm, opt, seed=step % 2) for step in range(steps)]  # two batches, learnt
    return {"losses": losses, "dtypes": sorted({str(p.dtype) for p in pm.parameters()})}


def accumulation(*, kind: str, model_dir: str, dp: int, dp_shard: int, pp: int = 1) -> dict:
    """Two train_steps, the first inside ``pm.no_sync()``: the gradients are those of the two global
    batches' mean losses summed, as the plain model's two backward passes accumulate them (under pp,
    two microbatches a step, this stage's parameters)."""
    torch.manual_seed(0)
    ref, pm = load(kind, model_dir), qn_hf.parallelize(load(kind, model_dir), dp=dp, dp_shard=dp_shard, pp=pp,
                                                       microbatches=2 if pp > 1 else 1, mesh=mesh_for(dp, 1, pp))
    batches = [make_batch(kind, size=dp * 2, seed=seed) for seed in (3, 4)]
    with pm.no_sync():
        pm.train_step(dp_slice(batches[0], dp=dp, dp_rank=pm.coords["dp"]))
    deferred = all(p.grad is None for p in pm.parameters())  # nothing reduced into the shards yet
    pm.train_step(dp_slice(batches[1], dp=dp, dp_rank=pm.coords["dp"]))
    for batch in batches:
        ref(**batch).loss.backward()
    refs = dict(ref.named_parameters())
    return {"deferred": deferred,
            "grad_err": max((whole(p.grad) - refs[n].grad).abs().max().item() for n, p in pm.named_parameters())}


def _row_loss(outputs, batch) -> torch.Tensor:
    """A loss_fn that averages its rows: each row's mean squared logit."""
    return outputs.logits.float().pow(2).mean(dim=(1, 2)).mean()


def accumulation_full_batch(*, kind: str, model_dir: str, dp: int, dp_shard: int = 1, tp: int = 1, pp: int = 1,
                            with_loss_fn: bool = False) -> dict:
    """Two half-batches with different numbers of targets, the first inside ``pm.no_sync()``, both
    with ``num_items_in_batch=pm.count_items(halves)``: the gradients, and the returned losses summed,
    against one backward of the plain model on the whole batch."""
    ref = load(kind, model_dir)
    pm = qn_hf.parallelize(load(kind, model_dir), dp=dp, dp_shard=dp_shard, tp=tp, pp=pp,
                           microbatches=2 if pp > 1 else 1, mesh=mesh_for(dp, tp, pp))
    full = make_batch(kind, size=dp * 4, seed=5, padded=True)
    halves = [{k: v[i * 2 * dp:(i + 1) * 2 * dp] for k, v in full.items()} for i in (0, 1)]
    local = [dp_slice(h, dp=dp, dp_rank=pm.coords["dp"]) for h in halves]
    loss_fn = _row_loss if with_loss_fn else None
    count = pm.count_items(local, loss_fn)
    with pm.no_sync():
        first = pm.train_step(local[0], loss_fn, num_items_in_batch=count)
    second = pm.train_step(local[1], loss_fn, num_items_in_batch=count)
    ref_loss = _row_loss(ref(**full), full) if with_loss_fn else ref(**full).loss
    ref_loss.backward()
    refs = dict(ref.named_parameters(remove_duplicate=False))
    targets = sum(int((h["labels"][:, 1:] != -100).sum()) for h in halves)
    return {"loss": (first + second).item(), "ref_loss": ref_loss.item(), "count": count.item(),
            "targets": targets if not with_loss_fn else 4 * dp,
            "grad_err": max((whole(p.grad) - reference_grad(refs, n, pm)).abs().max().item()
                            for n, p in pm.named_parameters())}


def no_targets(*, kind: str, model_dir: str, dp: int, pp: int = 1) -> dict:
    """A global batch whose labels are all -100: the plain model's loss is NaN (0/0) and its gradients
    0; then a batch where only one dp rank's rows have targets: the plain model's mean over them."""
    ref = load(kind, model_dir)
    pm = qn_hf.parallelize(load(kind, model_dir), dp=dp, pp=pp, microbatches=2 if pp > 1 else 1,
                           mesh=mesh_for(dp, 1, pp))
    empty = make_batch(kind, size=dp * 2, seed=6)
    empty["labels"][:] = -100
    loss = pm.train_step(dp_slice(empty, dp=dp, dp_rank=pm.coords["dp"]))
    ref_loss = ref(**empty).loss
    ref_loss.backward()
    refs = dict(ref.named_parameters(remove_duplicate=False))
    zero_err = max((whole(p.grad) - reference_grad(refs, n, pm)).abs().max().item() for n, p in pm.named_parameters())
    half = make_batch(kind, size=dp * 2, seed=7)
    half["labels"][: 2 * (dp - 1) if dp > 1 else 0] = -100  # every rank's rows but the last dp rank's
    half_loss = pm.train_step(dp_slice(half, dp=dp, dp_rank=pm.coords["dp"]))
    return {"loss": loss.item(), "ref_loss": ref_loss.item(), "zero_grad_err": zero_err,
            "half_loss": half_loss.item(), "ref_half_loss": ref(**half).loss.item()}


def sharded_after_forward_only(*, model_dir: str, tmp: str) -> dict:
    """dp=4 x dp_shard=2: after eval_step, logits and generate every parameter is a shard again (FSDP
    keeps its root gathered after a forward, for a backward that never comes), and a checkpoint with
    the optimizer saves (no empty file from the second group, which holds what the first writes) and loads."""
    import glob

    from safetensors import safe_open

    pm = qn_hf.parallelize(load("gpt2", model_dir), dp=4, dp_shard=2, mesh=mesh_for(4, 1))
    opt = qn_hf.optimizer(pm, torch.optim.AdamW, lr=1e-3)
    batch = dp_slice(make_batch("gpt2", size=8, seed=0), dp=4, dp_rank=pm.coords["dp"])
    pm.train_step(batch)
    opt.step()
    opt.zero_grad()
    sharded = {}
    for what, run in (("eval_step", lambda: pm.eval_step(batch)), ("logits", lambda: pm.logits(batch)),
                      ("generate", lambda: pm.generate(batch["input_ids"][:, :4], max_new_tokens=2, do_sample=False))):
        run()
        sharded[what] = all(isinstance(p, DTensor) for p in pm.parameters())
    pm.save_checkpoint(tmp, optimizer=opt, step=1)
    files = {os.path.basename(f): len(safe_open(f, "pt").keys()) for f in glob.glob(f"{tmp}/*/*.safetensors")}
    return {"sharded": sharded, "loaded": pm.load_checkpoint(tmp, optimizer=opt).get("step"), "files": files}
