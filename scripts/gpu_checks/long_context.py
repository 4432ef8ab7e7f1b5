"""Long context on one GPU: ``offload="activations"``'s CUDA path (pinned host memory, a side stream, the copy
back prefetched) and ``loss_chunk_tokens``, which the CPU suite runs only through their synchronous path.

* parity: one SGD step of a tiny float32 Llama with recomputation, offload and the loss in chunks against the
  plain model (equal, as every parity case), every offloaded input handed back;
* memory: a Llama with a 128k vocabulary at a long sequence (8,192 tokens; quick: small) under full recomputation,
  then with offload, then with offload and the loss in chunks: the device's peak (``max_memory_allocated``), the
  step's time, and the planner's device peak for the same settings beside it;
* the same sequence through the plain model under transformers' gradient checkpointing with its offload
  (``offload=True``, CUDA only): its device peak, the figure the options are compared with;
* host_copy: a block input to the host and back as the offload moves it (``offload_call``, the calibration's
  timing): GB/s, against the planner's stated figure.
"""

from __future__ import annotations

import copy
import time

import torch

from .common import LOSS_RTOL, WEIGHT_ATOL, build, release, row, synchronize
from .common import device as this_device


def _parity(device: torch.device) -> dict:
    import qn_hf

    from .common import llama_config

    config = llama_config(big=False, seq=256)
    ref = build(config, device)
    start = copy.deepcopy(ref)
    pm = qn_hf.parallelize(copy.deepcopy(ref), device=device, recompute="full", offload="activations",
                           loss_chunk_tokens=96)
    ids = torch.randint(3, config.vocab_size, (2, 256), generator=torch.Generator().manual_seed(0)).to(device)
    ref_loss = ref(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    torch.optim.SGD(ref.parameters(), lr=1.0).step()
    loss = pm.train_step({"input_ids": ids, "labels": ids})
    torch.optim.SGD(pm.parameters(), lr=1.0).step()
    refs = dict(ref.named_parameters())
    err = max((p.detach() - refs[n].detach()).abs().max().item() for n, p in pm.named_parameters())
    moved = max((p.detach() - q.detach()).abs().max().item() for p, q in zip(ref.parameters(), start.parameters()))
    loss_err = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
    offload = pm.context.offload
    whole = offload.packed == offload.unpacked > 0 and offload.host_bytes == 0
    result = "equal" if loss_err <= LOSS_RTOL and err <= WEIGHT_ATOL and whole else "different"
    return row("long", "recompute + offload + loss chunks, float32", result,
               f"loss rel {loss_err:.1e}, max weight diff {err:.1e} (moved {moved:.1e}); {offload.packed} inputs to "
               f"the host, {offload.unpacked} back, {offload.prefetched} prefetched", loss_err=loss_err,
               weight_err=err, packed=offload.packed, unpacked=offload.unpacked)


def _memory(device: torch.device, *, quick: bool) -> list[dict]:
    from transformers import AutoConfig

    import qn_hf
    from qn_hf.config.parallel_config import ParallelConfig
    from qn_hf.planner.estimate import Planner

    seq, vocab = (512, 32000) if quick else (8192, 128256)  # (quick: the test suite's CPU run, small)
    config = AutoConfig.for_model("llama", hidden_size=128 if quick else 1024, intermediate_size=256 if quick else 4096,
                                  num_hidden_layers=2 if quick else 8, num_attention_heads=4 if quick else 8,
                                  num_key_value_heads=4 if quick else 8, vocab_size=vocab,
                                  max_position_embeddings=seq, use_cache=False)
    ids = torch.randint(3, config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0)).to(device)
    rows = []
    for name, options in (("recompute", dict(recompute="full")),
                          ("recompute + offload", dict(recompute="full", offload="activations")),
                          ("recompute + offload + chunks", dict(recompute="full", offload="activations",
                                                                loss_chunk_tokens=1024))):
        model = build(config, device)
        planner = Planner(config, seq_len=seq, micro_batch_size=1, model_class=type(model))
        pm = qn_hf.parallelize(model, device=device, **options)
        pm.train_step({"input_ids": ids, "labels": ids})  # the gradients made: held from here on
        release(device)
        synchronize(device)
        began = time.perf_counter()
        pm.train_step({"input_ids": ids, "labels": ids})
        synchronize(device)
        step_s = time.perf_counter() - began
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        stage = planner.estimate(ParallelConfig.from_keywords(**options)).stages[0]
        planned = stage.weight_bytes + stage.grad_bytes + stage.activation_bytes + stage.transient_bytes
        measured = "-" if peak is None else f"{peak / 2**30:.2f}"
        rows.append(row("long", f"{seq:,} tokens, vocabulary {vocab:,}: {name}", "measured",
                        f"peak {measured} GiB on the device (planner {planned / 2**30:.2f}; host "
                        f"{stage.host_bytes / 2**30:.2f}), step {step_s:.2f} s", peak_bytes=peak,
                        planned_bytes=planned, host_bytes=stage.host_bytes, step_s=step_s))
        del pm, model
        release(device)
    rows.append(_hf_offload(config, ids, device))
    return rows


def _hf_offload(config, ids: torch.Tensor, device: torch.device) -> dict:
    """The plain model under transformers' own gradient checkpointing with its offload (``offload=True``: the
    checkpointed inputs in pinned host memory), the recipe Hugging Face users follow: its device peak."""
    case = f"{ids.shape[1]:,} tokens: transformers' checkpointing with offload (plain model)"
    if device.type != "cuda":  # its offload pins host memory, which a CPU torch has no allocator for
        return row("long", case, "skipped", "offload=True needs CUDA's pinned memory")
    model = build(config, device).train()
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.24; the older name before
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False}, offload=True)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False}, offload=True)
    model(input_ids=ids, labels=ids).loss.backward()
    release(device)
    synchronize(device)
    began = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    synchronize(device)
    step_s = time.perf_counter() - began
    peak = torch.cuda.max_memory_allocated(device)
    del model
    release(device)
    return row("long", case, "measured", f"peak {peak / 2**30:.2f} GiB on the device, step {step_s:.2f} s",
               peak_bytes=peak, step_s=step_s)


def _host_copy(device: torch.device) -> dict:
    from qn_hf.planner.calibration import assumed
    from qn_hf.planner.compute_timing import offload_call, seconds_per_call

    numel = 32 * 2**20 if device.type == "cuda" else 2**20  # 128 MiB of float32 (4 MiB on a CPU)
    seconds = seconds_per_call(offload_call(numel, device=device), device, repeats=5)
    stated = assumed(tflops=1, nvlink_gbps=1, ib_gbps=1, gpus_per_node=8, gpu_memory=1).host_copy
    return row("long", "a block input to the host and back (offload's own copies)", "measured",
               f"{4 * numel / seconds / 1e9:.1f} GB/s of input there and back (the planner states "
               f"{stated.rate / 1e9:.1f})", gbps=4 * numel / seconds / 1e9)


def offload_and_chunks(*, quick: bool) -> list[dict]:
    device = this_device()
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = [_parity(device)]
    release(device)
    rows += _memory(device, quick=quick)
    rows.append(_host_copy(device))
    return rows
