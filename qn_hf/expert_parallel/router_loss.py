"""The routers' load-balancing loss that transformers adds to an MoE model's loss when
``config.output_router_logits`` is set, computed over the whole batch of the step.

transformers' ``load_balancing_loss_func`` (one copy per MoE architecture, the same text in each)
pools the router logits of every layer and every token: with ``f_e`` the share of (row, choice)
pairs that picked expert e and ``P_e`` the mean router probability of e, over all rows, it returns
``E * sum_e f_e * P_e`` (padding rows left out via the attention mask), and the causal LM adds
``router_aux_loss_coef`` times it to the mean cross-entropy. The counts behind ``f`` are not
differentiable, so the gradient reaches the routers through ``P`` only.

Here each dp rank holds part of the rows: the counts and row totals are summed over dp first (one
small all-reduce per step, detached), and each rank adds ``coef * E * sum_e f_e * (its probability
sum of e) / rows``; the dp sum of those is the plain model's term, and so is the dp sum of their
gradients. Pooling over layers needs every layer's logits at once, so the loss is computed where all
of them are: one pipeline stage and one microbatch (a microbatch's pool is not the batch's).
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from ..comm import flat_all_reduce_


def adds_router_loss(model: torch.nn.Module) -> bool:
    """Whether ``model``'s forward adds transformers' load-balancing loss (the formula above)."""
    if not getattr(model.config, "output_router_logits", False):
        return False
    source = inspect.getsource(type(model).forward)
    return "load_balancing_loss_func(" in source


def check_router_loss(model: torch.nn.Module, *, pp: int, cp: int, microbatches: int) -> None:
    """Raise ``ValueError`` (before any collective of the step) where the term cannot be equal; for a
    model that ``adds_router_loss``."""
    fix = "or set model.config.output_router_logits = False"
    source = inspect.getsource(type(model).forward)
    if "self.router_aux_loss_coef * aux_loss" not in source or not hasattr(model, "num_experts_per_tok"):
        raise ValueError(f"config.output_router_logits=True: {type(model).__name__} adds a router loss qn_hf does not "
                         f"reproduce; {fix}")
    for name, value, why in (("pp", pp, "the loss pools the routers of every layer, which the stages split"),
                             ("microbatches", microbatches, "the loss pools the routers over the whole batch, which "
                                                            "microbatches split"),
                             ("cp", cp, "the loss pools whole sequences, which cp splits")):
        if value > 1:
            raise ValueError(f"config.output_router_logits=True with {name}={value}: {why}; use {name}=1 {fix}")


def router_loss(outputs, attention_mask: torch.Tensor | None, *, model: torch.nn.Module,
                group: ProcessGroup) -> torch.Tensor:
    """This dp rank's share of ``router_aux_loss_coef x`` the load-balancing loss of the whole batch."""
    experts, top_k = model.num_experts, model.num_experts_per_tok
    logits = torch.cat(list(outputs.router_logits), dim=0)  # [layers x rows, experts]
    layers = len(outputs.router_logits)
    probs = F.softmax(logits, dim=-1)
    chosen = F.one_hot(torch.topk(probs, top_k, dim=-1).indices, experts)  # [layers x rows, top_k, experts]
    if attention_mask is None:
        weight = torch.ones(logits.shape[0], dtype=probs.dtype, device=probs.device)
    else:  # layer-major, as the logits are concatenated
        weight = attention_mask.reshape(-1).to(probs.dtype).repeat(layers)
    counts = (chosen * weight[:, None, None]).sum(0)  # [top_k, experts]
    pooled = torch.cat([counts.reshape(-1), weight.sum()[None]]).detach()
    flat_all_reduce_([pooled], group=group)
    counts, rows = pooled[:-1].view_as(counts), pooled[-1]
    prob_sum = (probs * weight[:, None]).sum(0)
    loss = torch.sum(counts / rows * (prob_sum / rows)[None]) * experts
    return model.router_aux_loss_coef * loss
