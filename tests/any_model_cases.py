"""Jobs of the any-model tests, run on every rank of a test world: a shrunk model of any type under
any head, one parity check (``one_step_parity``) or a resumed checkpoint."""

from __future__ import annotations

import copy

import torch
import transformers
from transformers import CONFIG_MAPPING

import qn_hf
from qn_hf.check.config_part import config_taken_by
from qn_hf.check.inputs import dummy_batch
from qn_hf.check.run import build, one_step_parity, parity_config
from qn_hf.check.shrink import shrink_config
from tests.cases import mesh_for, pad_for_pooling


def tiny_config(model_type: str, *, cls: str | None = None, **overrides) -> dict:
    """A shrunk default config of ``model_type`` that ``cls`` builds from (shrink_config's ``builds``); a
    sequence classifier pools at the last token that is not padding, so a config without a pad token (Llama's)
    gets one, as checkpoints set it."""
    config = shrink_config(CONFIG_MAPPING[model_type](**overrides), builds=getattr(transformers, cls) if cls else None)
    pad_for_pooling(config_taken_by(config, getattr(transformers, cls)) if cls else config, cls)  # a text class's part
    return config.to_dict()


def head_step(*, model_type: str, cls: str, dp: int = 1, tp: int = 1, pp: int = 1, dp_shard: int = 1, ep: int = 1,
              microbatches: int | None = None, overrides: dict | None = None, steps: int = 2,
              schedule: str | None = None, recompute: str | None = None, virtual_stages: int = 1,
              sequence_parallel: bool = False) -> dict:
    """Two SGD steps of ``cls`` (shrunk ``model_type``) at the mesh against the plain model."""
    parallel = parity_config(dp=dp, tp=tp, pp=pp, dp_shard=dp_shard, ep=ep, microbatches=microbatches,
                             schedule=schedule, recompute=recompute, virtual_stages=virtual_stages,
                             sequence_parallel=sequence_parallel)
    verdict = one_step_parity(config=tiny_config(model_type, cls=cls, **(overrides or {})), parallel=parallel,
                              mesh=mesh_for(dp, tp, pp), model_class_name=cls, steps=steps)
    return {k: verdict[k] for k in ("verdict", "reason", "moved")} | {"worst": verdict["worst"][:3]}


def zero_step(*, model_type: str, cls: str) -> tuple[float, float, float]:
    """One AdamW step with ZeRO-1 at dp=2 against the plain model: (loss, plain loss, worst weight)."""
    config = CONFIG_MAPPING[model_type](**tiny_config(model_type))
    model = build(config, seed=0, name=cls)
    ref = build(config, seed=0, name=cls)
    pm = qn_hf.parallelize(model, dp=2, mesh=mesh_for(2, 1))
    opt = qn_hf.optimizer(pm, torch.optim.AdamW, zero=True, lr=1e-2)
    batch = dummy_batch(ref, rows=4, seed=2)
    loss = pm.train_step(pm.local_batch(batch)).item()
    opt.step()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_loss = ref(**batch).loss
    ref_loss.backward()
    ref_opt.step()
    mine = dict(pm.named_parameters())
    worst = max((mine[n].detach() - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    return loss, ref_loss.item(), worst


def resume_step(*, model_type: str, cls: str, ckpt: str, save: bool, dp: int, pp: int, dp_shard: int = 1,
                loss_fn=None) -> float:
    """At (dp, pp, dp_shard): an AdamW step, then (``save``) a checkpoint and another step, or (not ``save``)
    the checkpoint loaded and that second step; returns the second step's loss."""
    config = CONFIG_MAPPING[model_type](**tiny_config(model_type))
    pm = qn_hf.parallelize(build(config, seed=0, name=cls), dp=dp, pp=pp, microbatches=2, dp_shard=dp_shard,
                           mesh=mesh_for(dp, 1, pp))
    opt = torch.optim.AdamW(list(pm.parameters()), lr=1e-2)
    probe = build(config, seed=0, name=cls)
    batches = [pm.local_batch(dummy_batch(probe, rows=4, seed=s)) for s in (5, 6)]
    if save:
        pm.train_step(batches[0], loss_fn=loss_fn)
        opt.step()
        opt.zero_grad()
        pm.save_checkpoint(ckpt, optimizer=opt, step=1)
    else:
        assert pm.load_checkpoint(ckpt, optimizer=opt)["step"] == 1
    loss = pm.train_step(batches[1], loss_fn=loss_fn)
    opt.step()
    return loss.item()


def _branching_model():
    """A model whose second layer runs only on the rows that pick it (an MoE's expert loop, written the
    old way): on a rank none of whose rows do, its weights get no gradient at all."""
    from torch import nn
    from transformers import PretrainedConfig, PreTrainedModel

    class BranchConfig(PretrainedConfig):
        model_type = "qn_hf_branch"

    class Branch(PreTrainedModel):
        config_class = BranchConfig

        def __init__(self, config):
            super().__init__(config)
            self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)
            self.post_init()

        def forward(self, inputs_embeds):
            hidden = self.first(inputs_embeds)
            picked = inputs_embeds[:, 0] > 0
            if picked.any():
                hidden = hidden + torch.zeros_like(hidden).index_put((picked.nonzero()[:, 0],),
                                                                     self.second(hidden[picked]))
            return hidden

    torch.manual_seed(0)
    return Branch(BranchConfig())


def branch_step() -> tuple[float, float, float]:
    """dp=2 where rank 1's rows never take the branch: the same loss and weights as the plain model."""
    model, ref = _branching_model(), _branching_model()
    pm = qn_hf.parallelize(model, dp=2, mesh=mesh_for(2, 1))
    rows = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))
    rows[:2, 0], rows[2:, 0] = rows[:2, 0].abs() + 0.1, -rows[2:, 0].abs() - 0.1  # rank 0 picks, rank 1 never

    def loss_fn(outputs, batch):
        return outputs.square().mean()

    loss = pm.train_step(pm.local_batch({"inputs_embeds": rows}), loss_fn=loss_fn).item()
    ref_loss = loss_fn(ref(rows), None)
    ref_loss.backward()
    mine = dict(pm.named_parameters())
    worst = max((mine[n].grad - p.grad).abs().max().item() for n, p in ref.named_parameters())
    return loss, ref_loss.item(), worst


def checkpoint_round(*, model_type: str, cls: str, out: str, load: str | None, tp: int = 1, pp: int = 1) -> dict:
    """At (tp, pp), SGD steps with momentum (optimizer state, and no AdamW that turns rounding in a
    gradient near zero into a whole step) of ``cls`` on two fixed batches. ``load`` None: the first step, then a
    checkpoint in every format (qn_hf's, DCP, a Hugging Face directory) under ``out``; else the
    checkpoint at ``out/<load>`` loaded, then the second step. Returns this run's loss and, on rank 0,
    the plain model's two losses and its weights after the first step against the Hugging Face
    directory's (the worst relative difference and its parameter)."""
    import os

    import transformers

    config = CONFIG_MAPPING[model_type](**tiny_config(model_type))
    pm = qn_hf.parallelize(build(config, seed=0, name=cls), tp=tp, pp=pp, microbatches=2, mesh=mesh_for(1, tp, pp))
    opt = torch.optim.SGD(list(pm.parameters()), lr=0.1, momentum=0.9)
    ref = build(config, seed=0, name=cls)
    batches = [dummy_batch(ref, rows=4, seed=s) for s in (5, 6)]
    if load is None:
        loss = pm.train_step(batches[0]).item()
        opt.step()
        pm.save_checkpoint(os.path.join(out, "qn"), optimizer=opt, step=1)
        pm.save_checkpoint(os.path.join(out, "dcp"), optimizer=opt, step=1, format="dcp")
        pm.save_pretrained(os.path.join(out, "hf"))
    else:
        assert pm.load_checkpoint(os.path.join(out, load), optimizer=opt)["step"] == 1
        loss = pm.train_step(batches[1]).item()
        opt.step()
    result = {"loss": loss}
    if pm.coords["tp"] == 0 and pm.coords["pp"] == 0:
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        losses = []
        for batch in batches:
            step_loss = ref(**batch).loss
            step_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            losses.append(step_loss.item())
            if not losses[1:] and load is None:
                hf = getattr(transformers, cls).from_pretrained(os.path.join(out, "hf"))
                saved = dict(hf.named_parameters())
                result["hf_worst"] = max((((saved[n] - p).abs().max() / p.abs().max().clamp_min(1e-12)).item(), n)
                                         for n, p in ref.named_parameters())
        result["ref"] = losses
    return result


def synced_batch_norm_job() -> dict:
    """BatchNorm layers of every kind (1d over rows and over positions, 2d, 3d; no affine; a running average
    where momentum is None; no running statistics) summed over the world: each rank holds its rows of one
    batch, and the outputs, the input and weight gradients and the running statistics are those of the same
    layers over the whole batch in one process."""
    import torch.distributed as dist
    from torch import nn

    from qn_hf.data_parallel.batch_statistics import sync_batch_statistics

    rank, world = dist.get_rank(), dist.get_world_size()
    layers = {"1d": (nn.BatchNorm1d(3), (8, 3)), "1d_positions": (nn.BatchNorm1d(3, momentum=None), (8, 3, 5)),
              "2d": (nn.BatchNorm2d(3, affine=False), (8, 3, 4, 4)), "3d": (nn.BatchNorm3d(3), (8, 3, 2, 2, 2)),
              "no_running": (nn.BatchNorm2d(3, track_running_stats=False), (8, 3, 2, 2))}
    worst = 0.0

    def off(ours: torch.Tensor, theirs: torch.Tensor) -> float:  # relative to the larger of 1 and the reference
        return ((ours.float() - theirs.float()).abs().max() / theirs.float().abs().max().clamp(min=1)).item()
    for plain, shape in layers.values():
        torch.manual_seed(0)
        if plain.affine:
            nn.init.uniform_(plain.weight, 0.5, 1.5)
            nn.init.uniform_(plain.bias, -0.5, 0.5)
        synced = copy.deepcopy(plain)
        assert sync_batch_statistics(synced, dist.group.WORLD) == [""]
        for step in range(2):  # the second step reads the running average the first left
            x = torch.randn(shape, generator=torch.Generator().manual_seed(step)) * 3 + 1
            target = torch.randn(shape, generator=torch.Generator().manual_seed(10 + step))
            rows = shape[0] // world
            mine = x[rank * rows:(rank + 1) * rows].clone().requires_grad_()
            whole = x.clone().requires_grad_()
            expected = plain(whole)
            ((expected - target) ** 2).sum().backward()
            out = synced(mine)
            ((out - target[rank * rows:(rank + 1) * rows]) ** 2).sum().backward()
            ours = rank * rows, (rank + 1) * rows
            worst = max(worst, off(out, expected[ours[0]:ours[1]]), off(mine.grad, whole.grad[ours[0]:ours[1]]))
        for p, q in zip(synced.parameters(), plain.parameters()):
            dist.all_reduce(p.grad)  # what dp's gradient sum does
            worst = max(worst, off(p.grad, q.grad))
        for b, c in zip(synced.buffers(), plain.buffers(), strict=True):
            worst = max(worst, off(b, c))
        synced.eval()
        plain.eval()
        if plain.track_running_stats:  # eval reads the running statistics alone: nothing summed
            x = torch.randn(shape)
            worst = max(worst, off(synced(x), plain(x)))
        assert type(synced).__name__ == f"DataParallel{type(plain).__name__}" and isinstance(synced, type(plain))
    return {"worst": worst}


def judged_step(*, model_type: str, cls: str, dp: int, shift: float = 0.0) -> dict:
    """``head_step`` at dp, every model qn_hf parallelizes (the float32 one and the check's float64 one) first
    given ``shift`` more on its first weight: a parallel step that computes something else than the plain one."""
    if shift:
        parallelize = qn_hf.parallelize

        def shifted(model, *args, **kwargs):
            with torch.no_grad():
                next(model.parameters()).add_(shift)
            return parallelize(model, *args, **kwargs)

        qn_hf.parallelize = shifted  # this worker's own module: the check calls qn_hf.parallelize
    try:
        return head_step(model_type=model_type, cls=cls, dp=dp)
    finally:
        if shift:
            qn_hf.parallelize = parallelize
