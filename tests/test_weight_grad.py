"""Deferred weight gradients (ZB-H1's B/W split) against plain autograd: bit-equal fp32 gradients."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.pytorch_utils import Conv1D

from qn_hf.memory.recompute import apply_recompute, checkpoint_options
from qn_hf.pipeline.weight_grad import DeferrableConv1D, DeferrableLinear, WeightGradQueue, make_deferrable
from qn_hf.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from qn_hf.tensor_parallel.rng import RngStreams, stream_seeds
from qn_hf.tensor_parallel.shard import ShardSpec

KEY = (0, 0)


@pytest.fixture(scope="module")
def one_rank():
    """A one-rank gloo world for the tp layers (their collectives are identities at tp=1)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _layer(kind: str, bias: bool, group) -> nn.Module:
    torch.manual_seed(0)
    if kind == "conv1d":
        return Conv1D(6, 5)
    linear = nn.Linear(5, 6, bias=bias)
    if kind == "linear":
        return linear
    source = Conv1D(6, 5) if kind.endswith("conv1d") else linear
    if kind.startswith("column"):
        return ColumnParallelLinear.from_module(source, spec=ShardSpec(dim=0, tp=1, size=6), tp_rank=0, group=group)
    return RowParallelLinear.from_module(source, spec=ShardSpec(dim=0, tp=1, size=5), tp_rank=0, group=group)


CASES = [("linear", True), ("linear", False), ("conv1d", True), ("column", True), ("column", False),
         ("row", True), ("row", False), ("column_conv1d", True), ("row_conv1d", True)]


def _pair(kind: str, bias: bool, group) -> tuple[nn.Module, nn.Module, WeightGradQueue]:
    plain = _layer(kind, bias, group)
    holder = nn.Sequential(_layer(kind, bias, group))  # built again: a process group cannot be deep-copied
    queue = WeightGradQueue()
    names = make_deferrable(holder, queue=queue)
    assert names == [f"0.{n}" for n, _ in plain.named_parameters()]
    return plain, holder[0], queue


def _loss(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    y = module(x)
    return (torch.tanh(y) * torch.linspace(-1, 2, y.shape[-1])).sum()


def _input(dims: int) -> torch.Tensor:
    shape = (7, 5) if dims == 2 else (3, 4, 5)
    return torch.randn(shape, generator=torch.Generator().manual_seed(1))


def _grads(module: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: p.grad for n, p in module.named_parameters()}


def _count_hooks(module: nn.Module) -> dict[str, int]:
    fired = {n: 0 for n, _ in module.named_parameters()}
    for n, p in module.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: fired.__setitem__(n, fired[n] + 1))
    return fired


@pytest.mark.parametrize("dims", [2, 3])
@pytest.mark.parametrize(("kind", "bias"), CASES)
def test_b_then_w_equals_autograd(one_rank, kind, bias, dims):
    plain, deferred, queue = _pair(kind, bias, one_rank)
    fired = _count_hooks(deferred)
    x = _input(dims)
    x_plain, x_def = x.clone().requires_grad_(), x.clone().requires_grad_()
    assert torch.equal(plain(x), deferred(x))
    _loss(plain, x_plain).backward()
    queue.open = KEY
    _loss(deferred, x_def).backward()
    queue.open = None
    # B: the input gradient, bit-equal; no weight gradient and no hook yet
    assert torch.equal(x_plain.grad, x_def.grad)
    assert all(g is None for g in _grads(deferred).values()) and not any(fired.values())
    assert queue.pending() == [KEY]
    queue.run(KEY)
    assert queue.pending() == []
    for name, grad in _grads(plain).items():
        assert torch.equal(grad, _grads(deferred)[name]), name
    assert all(count == 1 for count in fired.values()), fired


@pytest.mark.parametrize(("kind", "bias"), CASES)
def test_closed_queue_is_plain_backward(one_rank, kind, bias):
    plain, deferred, queue = _pair(kind, bias, one_rank)
    fired = _count_hooks(deferred)
    x = _input(3)
    with torch.no_grad():
        assert torch.equal(plain(x), deferred(x))
    _loss(plain, x).backward()
    _loss(deferred, x).backward()
    for name, grad in _grads(plain).items():
        assert torch.equal(grad, _grads(deferred)[name]), name
    assert all(count == 1 for count in fired.values()) and queue.pending() == []


def test_microbatches_under_two_keys_run_in_any_order():
    plain, deferred, queue = _pair("linear", True, None)
    xs = [_input(3), _input(3) * 2 + 1]
    for x in xs:
        _loss(plain, x).backward()
    for mb, x in enumerate(xs):
        queue.open = (0, mb)
        _loss(deferred, x).backward()
    queue.open = None
    assert queue.pending() == [(0, 0), (0, 1)]
    queue.run((0, 1))
    queue.run((0, 0))
    queue.run((0, 7))  # nothing queued there: a chunk without deferrable layers
    for name, grad in _grads(plain).items():
        assert torch.equal(grad, _grads(deferred)[name]), name


def test_clear_drops_queued_work():
    _, deferred, queue = _pair("linear", True, None)
    queue.open = KEY
    _loss(deferred, _input(2)).backward()
    queue.clear()
    assert queue.pending() == [] and queue.open is None
    queue.run(KEY)
    assert deferred.weight.grad is None


def test_input_without_grad_and_inplace_output():
    """The first layer of a stage may get an input needing no gradient; HF code may modify an
    output in place: the weights still get their whole gradient."""
    plain, deferred, queue = _pair("linear", True, None)
    x = _input(3)
    for module in (plain, deferred):
        y = module(x)
        y.mul_(3.0)
        y.square().sum().backward()
    for name, grad in _grads(plain).items():
        assert torch.equal(grad, _grads(deferred)[name]), name


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.frozen = nn.Linear(4, 4)
        self.frozen.weight.requires_grad_(False)
        self.tied_a = nn.Linear(4, 4)
        self.tied_b = nn.Linear(4, 4)
        self.tied_b.weight = self.tied_a.weight
        self.conv = Conv1D(4, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 4)


def test_what_is_deferred():
    model = _Model()
    names = make_deferrable(model, queue=WeightGradQueue(), skip=("head",))
    assert names == ["a.weight", "a.bias", "conv.weight", "conv.bias"]
    assert type(model.a) is DeferrableLinear and type(model.conv) is DeferrableConv1D
    for name in ("frozen", "tied_a", "tied_b", "head"):
        assert type(model.get_submodule(name)) is nn.Linear, name
    assert model.tied_a.weight is model.tied_b.weight


def test_swap_keeps_parameters_and_subclasses():
    class Scaled(nn.Linear):  # a subclass's forward may do more: never swapped
        def forward(self, x):
            return 2 * super().forward(x)

    model = nn.Sequential(nn.Linear(3, 3), Scaled(3, 3))
    before = dict(model.named_parameters())
    assert make_deferrable(model, queue=WeightGradQueue()) == ["0.weight", "0.bias"]
    assert type(model[1]) is Scaled
    assert all(p is before[n] for n, p in model.named_parameters())


def test_mixed_precision_grad_dtype():
    plain, deferred, queue = _pair("linear", True, None)
    for module in (plain, deferred):
        for p in module.parameters():
            p.data = p.data.to(torch.bfloat16)
            p.grad_dtype = torch.float32
    x = _input(3).to(torch.bfloat16)
    for _ in range(2):  # two microbatches: accumulation in float32
        _loss(plain, x).backward()
        queue.open = KEY
        _loss(deferred, x).backward()
        queue.open = None
        queue.run(KEY)
    for name, grad in _grads(plain).items():
        assert grad.dtype == torch.float32 and torch.equal(grad, _grads(deferred)[name]), name


class _Products(TorchDispatchMode):
    """Counts the matrix products run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_recompute(recompute):
    """Same gradients, and no product recomputed that the plain layers do not recompute: full
    recomputation stops before the block's last product, selective keeps every product."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(5, 8), nn.GELU(), nn.Linear(8, 5))
    deferred = copy.deepcopy(plain)
    queue = WeightGradQueue()
    make_deferrable(deferred, queue=queue)
    x = _input(3).requires_grad_()
    counts = []
    for module, key in ((plain, None), (deferred, KEY)):
        loss = checkpoint(module, x, **checkpoint_options(recompute)).square().sum()
        products = _Products()
        queue.open = key
        with products:
            loss.backward()
            queue.open = None
            queue.run(KEY)
        counts.append(products.count)
    assert counts[0] == counts[1], counts
    for name, grad in _grads(plain).items():
        assert torch.equal(grad, _grads(deferred)[name]), name


def _tiny(model_type: str) -> nn.Module:
    if model_type == "llama":
        config = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    else:
        config = AutoConfig.for_model("gpt2", n_embd=32, n_layer=2, n_head=4, n_positions=16, vocab_size=64,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager")


@pytest.mark.parametrize("recompute", [None, "full", "selective"])
@pytest.mark.parametrize(("model_type", "layers"), [("llama", "model.layers"), ("gpt2", "transformer.h")])
def test_hf_model(model_type, layers, recompute):
    """Two microbatches B then W on an HF model (qn_hf's recomputation of its blocks or none) give every
    parameter the untouched copy's gradient, with no extra product."""
    plain = _tiny(model_type).train()
    deferred = copy.deepcopy(plain)
    queue = WeightGradQueue()
    names = make_deferrable(deferred, queue=queue, skip=("lm_head",))
    projections = [n for n, m in plain.named_modules() if isinstance(m, (nn.Linear, Conv1D)) and n != "lm_head"]
    assert sorted(names) == sorted(f"{n}.{p}" for n in projections for p, _ in plain.get_submodule(n).named_parameters())
    if recompute is not None:
        for model in (plain, deferred):
            rng = RngStreams(device=torch.device("cpu"), seeds=stream_seeds(base_seed=0, dp_rank=0, tp_rank=0, pp_rank=0))
            assert apply_recompute(model, recompute=recompute, layers=layers, rng=rng) == 2
    ids = torch.randint(0, 64, (2, 2, 8), generator=torch.Generator().manual_seed(0))
    counts = [_Products(), _Products()]
    for mb in range(2):
        with counts[0]:
            plain(input_ids=ids[mb], labels=ids[mb], use_cache=False).loss.backward()
        queue.open = (0, mb)
        with counts[1]:
            deferred(input_ids=ids[mb], labels=ids[mb], use_cache=False).loss.backward()
        queue.open = None
        assert all(dict(deferred.named_parameters())[n].grad is None for n in names)
    with counts[1]:
        for mb in (1, 0):
            queue.run((0, mb))
    assert counts[0].count == counts[1].count
    reference = dict(plain.named_parameters())
    for name, p in deferred.named_parameters():
        expected = reference[name].grad
        assert torch.allclose(p.grad, expected, rtol=1e-6, atol=1e-6 * expected.abs().max().item()), name


def case_tp2() -> dict[str, object]:
    """Column then row layer at tp=2 against the whole reference layers: the tp collectives all run in
    B (on the input gradient); the row bias, added after the tp sum, gets its gradient in B too."""
    rank, tp = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    torch.manual_seed(0)
    first, second = nn.Linear(8, 12), nn.Linear(12, 8)
    layers = nn.Sequential(
        ColumnParallelLinear.from_module(first, spec=ShardSpec(dim=0, tp=tp, size=12), tp_rank=rank, group=group),
        nn.Tanh(),
        RowParallelLinear.from_module(second, spec=ShardSpec(dim=0, tp=tp, size=12), tp_rank=rank, group=group))
    queue = WeightGradQueue()
    names = make_deferrable(layers, queue=queue)
    x = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(1))
    x_ref, x_par = x.clone().requires_grad_(), x.clone().requires_grad_()
    second(torch.tanh(first(x_ref))).square().sum().backward()
    queue.open = KEY
    layers(x_par).square().sum().backward()
    queue.open = None
    in_b = sorted(n for n, p in layers.named_parameters() if p.grad is not None)
    queue.run(KEY)
    errors = {"input grad": (x_ref.grad - x_par.grad).abs().max().item()}
    for name, ref in (("0", first), ("2", second)):
        specs = layers.get_submodule(name).shard_specs()
        for pname, p in layers.get_submodule(name).named_parameters():
            full = getattr(ref, pname).grad
            expected = full if specs[pname] is None else specs[pname].shard(full, rank)
            errors[f"{name}.{pname}"] = (p.grad - expected).abs().max().item()
    return {"names": names, "grads in B": in_b, "errors": errors}


def test_tp2(worlds):
    for result in worlds.run(2, case_tp2):
        assert result["names"] == ["0.weight", "0.bias", "2.weight"]
        assert result["grads in B"] == ["2.bias"]
        assert max(result["errors"].values()) < 1e-6, result["errors"]
