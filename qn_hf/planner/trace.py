"""One microbatch through the unsharded model on the ``meta`` device, recording what the planner
needs without computing anything: the input and output sizes of every module the tp plan touches
(what its collectives carry), the hidden state passed between stages, and the bytes autograd saves
for backward, attributed to the module that saved them (assuming a fused attention kernel, which
keeps no query x key matrix).

The forward is Hugging Face's own, so the shapes are the model's real ones (GQA, packed q|k|v,
ViT's class token ...), for 70B-parameter configs in about a second.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn

from ..plan import TpPlan


@dataclass(frozen=True)
class ModuleIO:
    calls: int
    in_numel: int  # first tensor argument, summed over calls
    out_numel: int  # output tensor (or first of a tuple), summed over calls


@dataclass(frozen=True)
class Trace:
    io: dict[str, ModuleIO]  # every tp-plan rule module and tp entry, by name in the top model
    boundary_numel: int  # elements of the hidden state one block hands to the next
    saved: dict[str, tuple[int, int]]  # module -> (bytes saved whole on every tp rank, bytes split across tp)
    logits_rows: int  # rows of the output logits (tokens of a causal LM, images of a classifier)
    tokens: int  # positions per microbatch the blocks process


def example_inputs(model: nn.Module, *, micro_batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    """Meta tensors shaped like one microbatch of the model's main input."""
    config = model.config
    if getattr(model, "main_input_name", "input_ids") == "pixel_values":
        size = config.image_size
        return {"pixel_values": torch.empty(micro_batch_size, config.num_channels, size, size, device="meta")}
    return {"input_ids": torch.empty(micro_batch_size, seq_len, dtype=torch.long, device="meta")}


def trace_microbatch(model: nn.Module, plan: TpPlan, *, layers: str, inputs: dict[str, torch.Tensor]) -> Trace:
    styles = dict(plan.rules)
    watched = set(styles) | set(plan.tp_entries)
    io: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    stack: list[str] = []
    boundary = [0]
    handles = []
    block_names = {f"{layers}.{i}" for i in range(len(model.get_submodule(layers)))}

    def pre(name: str):
        def hook(module, args, kwargs):
            stack.append(name)
            if name in watched:
                first = args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
                io[name][0] += 1
                io[name][1] += first.numel()
        return hook

    def post(name: str):
        def hook(module, args, kwargs, output):
            stack.pop()
            out = output[0] if isinstance(output, (tuple, list)) else getattr(output, "last_hidden_state", output)
            if name in watched and isinstance(out, torch.Tensor):
                io[name][2] += out.numel()
            if name in block_names and isinstance(out, torch.Tensor):
                boundary[0] = out.numel()
        return hook

    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(pre(name), with_kwargs=True))
        handles.append(module.register_forward_hook(post(name), with_kwargs=True))

    params = {id(p) for p in model.parameters()}
    seen: dict[int, torch.Tensor] = {}  # kept alive so ids are not reused
    saved: dict[str, list[int]] = defaultdict(lambda: [0, 0])

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if id(t) in seen or id(base) in params or id(t) in params:  # weights are not activations
            return t
        seen[id(t)] = t
        owner = stack[-1] if stack else ""
        if t.dim() >= 3 and t.shape[-1] == t.shape[-2] and _split_across_tp(owner, styles, plan):
            # A (batch, heads, q, k) attention matrix: meta tensors take the unfused math path,
            # while the fused kernels training uses (FlashAttention, SDPA) never store it.
            return t
        saved[owner][1 if _split_across_tp(owner, styles, plan) else 0] += t.numel() * t.element_size()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            # With use_cache on, transformers skips a packed-sequence check that reads tensor values
            # (impossible on meta); the cache holds no autograd state, so nothing else changes.
            kwargs = {**plan.policy.forward_kwargs, **({"use_cache": True} if "use_cache" in plan.policy.forward_kwargs else {})}
            out = model(**inputs, **kwargs)
    finally:
        for h in handles:
            h.remove()
    logits = getattr(out, "logits", None)
    rows = logits.shape[:-1].numel() if logits is not None else 0
    tokens = boundary[0] // model.config.hidden_size if boundary[0] else 0
    return Trace(io={k: ModuleIO(*v) for k, v in io.items()}, boundary_numel=boundary[0],
                 saved={k: (v[0], v[1]) for k, v in saved.items()}, logits_rows=rows, tokens=tokens)


def _split_across_tp(name: str, styles: dict[str, str], plan: TpPlan) -> bool:
    """Whether what ``name`` saves is sharded under tp: a row-parallel layer's input and anything
    computed inside a tp entry or region between the column and row layers (attention heads, the
    MLP's activation) are; a column layer's input, norms, residuals and embeddings are not."""
    if name in styles:
        return styles[name] == "rowwise"
    regions = plan.tp_entries + plan.tp_rng_regions
    return any(name == r or name.startswith(r + ".") for r in regions)
