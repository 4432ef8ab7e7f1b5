"""Code that runs inside test worlds for tests/test_planner_memory.py: one real training run per mesh,
with every per-rank byte count the planner estimates measured from the tensors themselves.

Activations are measured as *live allocations*: a ``TorchDispatchMode`` is active around the forward
of each microbatch on this stage (its loss included, on the last stage) and records every storage
an op allocates there; the bytes of those storages still alive when the microbatch's backward
starts are what it kept. Whatever keeps them (autograd's saved tensors, torch's checkpoint holding
a block's inputs, selective recomputation's cache of matmul outputs, the executor holding the
activation it sent) counts once per storage, and the measure needs no knowledge of which of those
mechanisms is on. The activation this stage received is allocated before its forward and held
until its backward, so it is added.

Under expert parallelism what a rank keeps depends on the rows the router sends it; the planner
estimates it at uniform routing. These runs force uniform routing (``_uniform_routing``): every
experts call gets token t's k-th choice = (t*K + k) mod E, so each rank's (token, choice) pairs
spread evenly over the experts (T_local * K divisible by E) and each rank receives exactly as many
rows as it sends. The model's own router still runs and keeps what it keeps.
"""

from __future__ import annotations

import copy
import gc
import time

import torch
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

import qn_hf
from qn_hf.data_parallel.grad_norm import PiecesStandIn
from qn_hf.data_parallel.sharded import local
from qn_hf.expert_parallel.apply import experts_modules
from qn_hf.memory.live_allocations import LiveAllocations, storage_bytes, storage_now
from tests.cases import mesh_for
from tests.ep_cases import moe_config
from tests.models import CONFIGS, dp_slice, make_batch

# Big enough that activations and optimizer state dwarf constants (scalars, rng states): hidden 64,
# sequences of 128; small enough for a 2-core machine. ``architectures`` makes the planner's meta
# model the causal LM (without it, it builds the base model).
SIZES = {
    "gpt2": dict(n_embd=64, n_head=4, n_layer=4, n_positions=128, architectures=["GPT2LMHeadModel"]),
    "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, max_position_embeddings=128, architectures=["LlamaForCausalLM"]),
    "gemma4": dict(max_position_embeddings=256, architectures=["Gemma4ForCausalLM"]),  # per-layer embeddings
    "gemma2": dict(max_position_embeddings=256, architectures=["Gemma2ForCausalLM"]),  # the logits soft-capped
}
SEQ = 128
ROWS = 2  # rows per microbatch
BUCKET_MB = 0.1  # a few buckets per rank, so zero's per-bucket padding is exercised


MOE = "qwen3_moe"  # shrunk (hidden 64, 4 layers of 4 experts, top-2, vocabulary 126)
# The same with experts 4 times wider (moe_intermediate_size 128): a layer's experts then outweigh the
# rest of its block, as Mixtral's do, which decides what FSDP holds gathered at once under ep.
MOE_WIDE = "qwen3_moe_wide"
MOE_KINDS = {MOE: {}, MOE_WIDE: {"moe_intermediate_size": 128}}


def config_for(kind: str):
    if kind in MOE_KINDS:
        return moe_config(MOE, architectures=["Qwen3MoeForCausalLM"], **MOE_KINDS[kind])
    config = copy.deepcopy(CONFIGS[kind])
    config.update(SIZES[kind])
    return config


def _batch(kind: str, *, size: int, seed: int) -> dict[str, torch.Tensor]:
    if kind not in MOE_KINDS:
        return make_batch(kind, size=size, seed=seed, seq=SEQ)
    ids = torch.randint(3, config_for(kind).vocab_size, (size, SEQ), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def _uniform_routing(model: torch.nn.Module, experts: int) -> None:
    """Every experts call routes token t's k-th choice to expert (t*K + k) mod E (module docstring)."""
    def route(_module, args):
        hidden, index, weights = args
        return hidden, torch.arange(index.numel(), device=index.device).view(index.shape) % experts, weights

    for module in experts_modules(model).values():
        module.register_forward_pre_hook(route)


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a dp_shard-sharded one: this rank's)."""
    seen = {}
    for t in map(local, tensors):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


class _Gathered(TorchDispatchMode):
    """Under dp_shard: the most bytes of whole weights FSDP holds at once, after any op: the module
    parameters that are plain tensors then (not their DTensor shards) and the outputs of its
    all-gathers still alive (a block prefetched is one until its copy-out into its parameters); and
    at the step's one reduction under a pipeline, the whole gradients accumulated over its
    microbatches (what the step's ops made that the reduction frees). Parameters FSDP leaves alone
    (ep's experts when no other rank of the stage holds the same ones) are plain tensors throughout:
    those already plain before the step are not gathered weights (every group is sharded then)."""

    def __init__(self, pm) -> None:
        super().__init__()
        self.model, self.most, self.accumulated = pm.module, 0, 0
        self.unmanaged = {id(p) for p in pm.module.parameters() if not isinstance(p, DTensor)}
        # FSDP's all-gathers run on its meshes' groups; others gather activations (ep's token split over tp)
        meshes = [m for m in (pm.groups.shard_mesh, pm.groups.expert_shard_mesh) if m is not None]
        self.fsdp_groups = {m.get_group(d).group_name for m in meshes for d in range(m.ndim)}
        self.outputs: list[StorageWeakRef] = []
        self.live = LiveAllocations()
        if pm.sharded.pipelined:
            finish = pm.sharded.finish_backward

            def noted(**kwargs):  # what the reduction frees of what the step made: the whole gradients
                # Read once a gloo work object has let go of the step's last transfers (``_settled``):
                # a scalar it still held for a moment once counted as freed by the reduction (4 bytes)
                before = _settled_reading(lambda: [(ref, storage_bytes(ref)) for ref in self.live.alive_storages()],
                                          key=lambda alive: (len(alive), sum(n for _, n in alive)))
                finish(**kwargs)
                self.accumulated = _settled_reading(lambda: sum(n - storage_bytes(ref) for ref, n in before))

            pm.sharded.finish_backward = noted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (func is torch.ops.c10d._allgather_base_.default
                and ProcessGroup.unbox(args[2]).group_name in self.fsdp_groups):
            self.outputs.append(StorageWeakRef(args[0].untyped_storage()))
        self.outputs = [ref for ref in self.outputs if not ref.expired()]
        sizes = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                 for t in self.model.parameters() if not isinstance(t, DTensor) and id(t) not in self.unmanaged}
        sizes |= dict(filter(None, map(storage_now, self.outputs)))  # at their size now: FSDP frees by resizing
        self.most = max(self.most, sum(sizes.values()))
        return out


def _settled_reading(read, *, key=lambda value: value):
    """``read()`` after a collection, once two reads 20 ms apart agree by ``key`` (at most a second):
    see ``_settled``."""
    gc.collect()
    last = read()
    for _ in range(50):
        time.sleep(0.02)
        now = read()
        if key(now) == key(last):
            return now
        last = now
    return last


def _settled(live: LiveAllocations) -> int:
    """``live.alive_bytes()`` once nothing outside backward's needs still holds a storage: a gloo
    collective's work object can keep its input and output (expert parallelism's all-to-all rows)
    for a moment after the forward used them, until its worker thread lets go or a collection frees
    it. Under a loaded machine that moment once reached the backward (256 KiB more on one rank of
    many), so read until two reads 20 ms apart agree, for at most a second."""
    return _settled_reading(live.alive_bytes)


def _measure_forwards(pm, out: list[int]):
    """Wrap this rank's executor so every microbatch's forward records into ``out`` the bytes it
    keeps (the executor is the one place that sees a whole microbatch's forward, loss included).
    They are read when the microbatch's backward starts (a hook on its output's node): what is
    alive then is what backward needs, and a reference a collective's worker thread still holds for
    a moment after the forward returned has been dropped by then."""
    run = pm.executor.run

    def measured_run(schedule, forward, **kwargs):
        def measured(chunk, mb, received):
            with LiveAllocations() as live:
                result = forward(chunk, mb, received)
            held = received.untyped_storage().nbytes() if received is not None else 0
            result.grad_fn.register_prehook(lambda grads: out.append(_settled(live) + held))
            return result

        return run(schedule, measured, **kwargs)

    pm.executor.run = measured_run


def measure(*, kind: str, dp: int, tp: int, pp: int, microbatches: int, mixed_precision: str | None, zero: bool,
            recompute: str | None, sequence_parallel: bool = False, cp: int = 1, ep: int = 1,
            natural_routing: bool = False, schedule: str = "1f1b", virtual_stages: int = 1, dp_shard: int = 1,
            dp_shard_gather: str = "step", expert_dispatch: str = "all_to_all",
            loss_chunk_tokens: int | None = None, offload: str | None = None) -> dict:
    """One run's measured bytes; under ep with uniform routing unless ``natural_routing``."""
    torch.manual_seed(0)
    config = config_for(kind)
    model = AutoModelForCausalLM.from_config(config)
    pm = qn_hf.parallelize(model, dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, microbatches=microbatches,
                           mesh=mesh_for(dp, tp, pp, cp), bucket_mb=BUCKET_MB, mixed_precision=mixed_precision,
                           recompute=recompute, sequence_parallel=sequence_parallel, schedule=schedule,
                           virtual_stages=virtual_stages, dp_shard=dp_shard, dp_shard_gather=dp_shard_gather,
                           expert_dispatch=expert_dispatch, loss_chunk_tokens=loss_chunk_tokens, offload=offload)
    if ep > 1 and not natural_routing:
        _uniform_routing(pm.module, config.num_experts)
    opt = qn_hf.optimizer(pm, torch.optim.AdamW, zero=zero, lr=1e-4)

    def batch(step: int):
        rows = _batch(kind, size=dp * ROWS * microbatches, seed=step)
        return dp_slice(rows, dp=dp, dp_rank=pm.coords["dp"])

    for step in range(2):  # the optimizer state exists after a step that was not skipped (fp16)
        opt.zero_grad()
        pm.train_step(batch(step))
        opt.step()
    activations: list[int] = []
    _measure_forwards(pm, activations)
    if pm.context.offload is not None:  # the host's high-water mark of this step alone
        pm.context.offload.peak_host_bytes = 0
    opt.zero_grad()
    gathered = _Gathered(pm) if dp_shard > 1 else None
    with qn_hf.CommMeter(pm) as meter:
        if gathered is not None:
            with gathered.live, gathered:
                pm.train_step(batch(2))
        else:
            pm.train_step(batch(2))
        # (under zero, .grad is a refusing stand-in over the bucket counted below: grad_norm.PiecesStandIn)
        grads = [p.grad for p in pm.parameters() if p.grad is not None and not isinstance(p.grad, PiecesStandIn)]
        for buckets in pm.grads.bucket_sets:  # zero: the full-size buckets stay allocated while .grad is cleared
            grads += [b.buffer for b in buckets.buckets]
        grad_bytes = _storage_bytes(grads)
        opt.step()
    weights = list(pm.parameters())
    params = {local(t).untyped_storage().data_ptr() for t in weights}
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    masters = [m.tensor for m in opt.masters if local(m.tensor).untyped_storage().data_ptr() not in params]  # copies only
    comm: dict[str, list[int]] = {}
    for (group, _), total in meter.totals().items():
        acc = comm.setdefault(group, [0, 0])
        acc[0] += total.calls
        acc[1] += total.nbytes
    return {"coords": pm.coords, "params": sum(p.numel() for p in weights),
            # dp_shard: the shards' storage, padded to the same rows on every rank
            "weight_bytes": _storage_bytes(weights) if dp_shard > 1 else sum(p.numel() * p.element_size() for p in weights),
            "grad_bytes": grad_bytes,
            "gathered_bytes": gathered.most if gathered else 0,
            "accumulated_grad_bytes": gathered.accumulated if gathered else 0,
            "optimizer_bytes": _storage_bytes(state) + _storage_bytes(masters),
            "activation_bytes": max(activations), "activations": activations, "comm": comm,
            "host_bytes": pm.context.offload.peak_host_bytes if pm.context.offload is not None else 0,
            "comm_ops": {f"{g}:{op}": [t.calls, t.nbytes] for (g, op), t in meter.totals().items()}}


# A long sequence through a large vocabulary: the loss's logits outweigh everything else a step makes
LONG_LOSS = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, vocab_size=8192, max_position_embeddings=1024, tie_word_embeddings=False,
                 architectures=["LlamaForCausalLM"])
LONG_SEQ = 1024


class _Peak(LiveAllocations):
    """The most bytes of the storages made while active alive at once, after any op."""

    def __init__(self) -> None:
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.most = max(self.most, self.alive_bytes())
        return out


def measure_step_peak(*, recompute: str | None, loss_chunk_tokens: int | None, offload: str | None) -> int:
    """One process, one sequence of ``LONG_SEQ`` tokens: the most bytes the storages a step makes hold at once (its
    activations, the loss's backward's moment; the gradients are the last step's, held and added to in place)."""
    from transformers import AutoConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **LONG_LOSS))
    pm = qn_hf.parallelize(model, recompute=recompute, loss_chunk_tokens=loss_chunk_tokens, offload=offload,
                           mesh=mesh_for(1, 1))
    ids = torch.randint(3, 8192, (1, LONG_SEQ), generator=torch.Generator().manual_seed(0))
    pm.train_step({"input_ids": ids, "labels": ids})
    pm.module.zero_grad(set_to_none=False)
    gc.collect()
    with _Peak() as peak:
        pm.train_step({"input_ids": ids, "labels": ids})
    return peak.most
