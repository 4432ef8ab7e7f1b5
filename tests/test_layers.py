"""Each parallel layer and the vocab-parallel loss against its torch / transformers original (tp=2)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

from qn_hf.comm import gather_from_group
from qn_hf.step.loss import vocab_parallel_cross_entropy
from qn_hf.tensor_parallel.embeddings import VocabParallelEmbedding
from qn_hf.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from qn_hf.tensor_parallel.shard import ShardSpec, padded


def _grads_match(parallel: nn.Module, reference: nn.Module, rank: int) -> float:
    specs = parallel.shard_specs()
    ref = dict(reference.named_parameters())
    err = 0.0
    for name, p in parallel.named_parameters():
        expected = ref[name].grad if specs[name] is None else specs[name].shard(ref[name].grad, rank)
        err = max(err, (p.grad - expected).abs().max().item())
    return err


def _column_then_row(reference_in: nn.Module, reference_out: nn.Module, parts: int, rank: int, tp: int) -> dict[str, float]:
    group = dist.group.WORLD
    out_f = reference_in.nf if isinstance(reference_in, Conv1D) else reference_in.out_features
    col = ColumnParallelLinear.from_module(reference_in, spec=ShardSpec(dim=0, tp=tp, size=out_f, parts=parts), tp_rank=rank, group=group)
    in_f = reference_out.nx if isinstance(reference_out, Conv1D) else reference_out.in_features
    # a packed column output is consumed by a row layer whose inputs are packed the same way
    row = RowParallelLinear.from_module(reference_out, spec=ShardSpec(dim=0, tp=tp, size=in_f, parts=parts), tp_rank=rank, group=group)
    x = torch.randn(3, 5, reference_in.weight.shape[1 if isinstance(reference_in, nn.Linear) else 0], generator=torch.Generator().manual_seed(3))
    x_ref, x_par = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y_ref = reference_out(torch.tanh(reference_in(x_ref)))
    y_par = row(torch.tanh(col(x_par)))
    y_ref.square().sum().backward()
    y_par.square().sum().backward()
    return {
        "output": (y_ref - y_par).abs().max().item(),
        "input grad": (x_ref.grad - x_par.grad).abs().max().item(),
        "column grads": _grads_match(col, reference_in, rank),
        "row grads": _grads_match(row, reference_out, rank),
    }


def case_linear_and_conv1d() -> dict[str, float]:
    rank, tp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    errors = {}
    for label, first, second, parts in (
        ("linear", nn.Linear(8, 12), nn.Linear(12, 8), 1),
        ("conv1d", Conv1D(12, 8), Conv1D(8, 12), 1),
        ("conv1d packed q|k|v", Conv1D(12, 8), Conv1D(8, 12), 3),  # 12 = 3 parts of 4
    ):
        for key, err in _column_then_row(first, second, parts, rank, tp).items():
            errors[f"{label}: {key}"] = err
    # packed layout: a rank's columns are q_r | k_r | v_r
    fused = Conv1D(12, 8)
    col = ColumnParallelLinear.from_module(fused, spec=ShardSpec(dim=0, tp=tp, size=12, parts=3), tp_rank=rank, group=dist.group.WORLD)
    q, k, v = fused.weight.split(4, dim=1)
    w = 4 // tp
    expected = torch.cat([t[:, rank * w : (rank + 1) * w] for t in (q, k, v)], dim=1)
    errors["packed shard layout"] = (col.weight - expected).abs().max().item()
    return errors


def case_vocab_embedding_and_loss() -> dict[str, float]:
    rank, tp = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    torch.manual_seed(0)
    vocab = 11  # not divisible by tp: padded
    spec = ShardSpec(dim=0, tp=tp, size=vocab, padded_size=padded(vocab, tp))
    emb = nn.Embedding(vocab, 6, padding_idx=vocab - 1)
    par = VocabParallelEmbedding.from_module(emb, spec=spec, tp_rank=rank, group=group)
    ids = torch.tensor([[0, 3, 10, 5], [10, 9, 1, 2]])
    (emb(ids) * torch.arange(6.0)).sum().backward()
    out = par(ids)
    (out * torch.arange(6.0)).sum().backward()
    errors = {"embedding output": (out - emb(ids)).abs().max().item(), "embedding grads": _grads_match(par, emb, rank)}
    errors["padding row grad is zero"] = par.weight.grad[par.local_padding_idx].abs().max().item() if par.local_padding_idx is not None else 0.0

    logits = torch.randn(7, vocab, generator=torch.Generator().manual_seed(5))
    targets = torch.tensor([0, 10, 4, -100, 7, 1, 5])
    ref_logits = logits.clone().requires_grad_(True)
    ref = F.cross_entropy(ref_logits, targets, reduction="none")
    (ref * torch.arange(1.0, 8.0)).sum().backward()
    start, stop = spec.local_range(rank)
    local = F.pad(logits, (0, spec.full_size - vocab))[:, start:stop].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, targets, vocab_start=start, vocab_size=vocab, group=group)
    (loss * torch.arange(1.0, 8.0)).sum().backward()
    full_grad = gather_from_group(local.grad, group=group)
    errors["vocab-parallel CE loss"] = (loss - ref).abs().max().item()
    errors["vocab-parallel CE grad"] = (full_grad[:, :vocab] - ref_logits.grad).abs().max().item()
    errors["padding columns get no grad"] = full_grad[:, vocab:].abs().max().item() if spec.full_size > vocab else 0.0
    return errors


def _check(results: list[dict[str, float]], tol: float = 1e-6) -> None:
    for rank, errors in enumerate(results):
        bad = {k: v for k, v in errors.items() if v > tol}
        assert not bad, f"rank {rank}: {bad}"


def test_linear_and_conv1d_tp2(worlds):
    _check(worlds.run(2, case_linear_and_conv1d))


def test_linear_and_conv1d_tp4(worlds):
    _check(worlds.run(4, case_linear_and_conv1d))


def test_vocab_embedding_and_loss_tp2(worlds):
    _check(worlds.run(2, case_vocab_embedding_and_loss))


def test_vocab_embedding_and_loss_tp4(worlds):
    _check(worlds.run(4, case_vocab_embedding_and_loss))
