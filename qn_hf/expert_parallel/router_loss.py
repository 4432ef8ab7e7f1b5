"""The routers' load-balancing loss that transformers adds to an MoE model's loss when
``config.output_router_logits`` is set, computed over the whole batch of the step.

transformers' ``load_balancing_loss_func`` (one copy per MoE architecture, the same text in each)
pools the router logits of every layer and every token: with ``f_e`` the share of (row, choice)
pairs that picked expert e and ``P_e`` the mean router probability of e, over all rows, it returns
``E * sum_e f_e * P_e`` (padding rows left out via the attention mask), and the causal LM adds
``router_aux_loss_coef`` times it to the mean cross-entropy. The counts behind ``f`` are not
differentiable, so the gradient reaches the routers through ``P`` only.

Here each dp rank holds part of the rows, under cp each cp rank part of every row's tokens, and
under sequence parallelism (with ep) each tp rank a slice of those: the counts and token totals are
summed over dp x cp (x tp) first (one small all-reduce per step, detached),
and each rank adds ``coef * E * sum_e f_e * (its probability sum of e) / tokens``; the dp x cp sum
of those is the plain model's term, and so is the sum of their gradients. Nothing in the term
depends on a token's neighbours, so a cp rank's tokens (whichever pieces it holds) count like any
others; its attention mask is its own tokens' (``valid``). Pooling over layers needs every layer's logits at once, so the loss is computed where all
of them are: one pipeline stage and one microbatch (a microbatch's pool is not the batch's).
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from ..comm import flat_all_reduce_, group_rank, group_size


def adds_router_loss(model: torch.nn.Module) -> bool:
    """Whether ``model``'s forward adds transformers' load-balancing loss (the formula above)."""
    if not getattr(model.config, "output_router_logits", False):
        return False
    source = inspect.getsource(type(model).forward)
    return "load_balancing_loss_func(" in source


def _router_recorder(model: torch.nn.Module):
    """transformers' own declaration of where a model's router logits come from (the
    ``OutputRecorder`` its ``output_router_logits`` hooks in), or None."""
    recorder = (getattr(type(model), "_can_record_outputs", None) or {}).get("router_logits")
    if recorder is None or getattr(recorder, "layer_name", None) or getattr(recorder, "class_name", None):
        return None  # one we do not read (by layer or class name): the check refuses it
    return recorder


class RouterLogits:
    """While entered, collects every router's logits of a forward, in call order (layer order), from
    the modules transformers records them from (``_router_recorder``), so the forward itself can run
    with ``output_router_logits=False``: transformers' own load-balancing term, computed inside the
    forward from its ``attention_mask``, would read context parallelism's mask layout and is replaced
    here anyway."""

    # what the forward is called with while recording: no term of transformers' own
    forward_kwargs = {"output_router_logits": False}

    def __init__(self, model: torch.nn.Module, *, pp: int, microbatches: int, replicas: ProcessGroup,
                 sequence: ProcessGroup | None) -> None:
        check_router_loss(model, pp=pp, microbatches=microbatches)
        recorder = _router_recorder(model)
        self.model, self.replicas, self.sequence = model, replicas, sequence
        self.modules = [m for m in model.modules() if isinstance(m, recorder.target_class)]
        self.index = recorder.index
        self.logits: list[torch.Tensor] = []
        self._handles: list = []

    def __enter__(self) -> RouterLogits:
        self.logits = []

        def record(_module, _args, out) -> None:
            self.logits.append(out[self.index] if isinstance(out, tuple) else out)

        self._handles = [m.register_forward_hook(record) for m in self.modules]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def loss(self, valid: torch.Tensor | None) -> torch.Tensor:
        """This rank's share of the term from the logits recorded. The routers saw this rank's tokens:
        its rows (dp), its pieces (cp: ``valid`` is theirs) and, with ``sequence`` (the tp group under
        sequence parallelism, on), its contiguous slice of those over tp."""
        if self.sequence is None:
            return router_loss(self.logits, valid, model=self.model, groups=[self.replicas])
        if valid is not None:
            valid = valid.chunk(group_size(self.sequence), dim=1)[group_rank(self.sequence)]
        share = router_loss(self.logits, valid, model=self.model, groups=[self.replicas, self.sequence])
        # The tp ranks' shares differ (their tokens do) while the rest of the loss is the same on each:
        # the value is the sum of the shares (so the reported loss is whole), the gradient this rank's.
        whole = share.detach().clone()
        flat_all_reduce_([whole], group=self.sequence)
        return share + (whole - share.detach())


def check_router_loss(model: torch.nn.Module, *, pp: int, microbatches: int) -> None:
    """Raise ``ValueError`` (before any collective of the step) where the term cannot be equal; for a
    model that ``adds_router_loss``."""
    fix = "or set model.config.output_router_logits = False"
    source = inspect.getsource(type(model).forward)
    if ("self.router_aux_loss_coef * aux_loss" not in source or not hasattr(model, "num_experts_per_tok")
            or _router_recorder(model) is None):
        raise ValueError(f"config.output_router_logits=True: {type(model).__name__} adds a router loss qn_hf does not "
                         f"reproduce; {fix}")
    for name, value, why in (("pp", pp, "the loss pools the routers of every layer, which the stages split"),
                             ("microbatches", microbatches, "the loss pools the routers over the whole batch, which "
                                                            "microbatches split")):
        if value > 1:
            raise ValueError(f"config.output_router_logits=True with {name}={value}: {why}; use {name}=1 {fix}")


def router_loss(router_logits: list[torch.Tensor], valid: torch.Tensor | None, *, model: torch.nn.Module,
                groups: list[ProcessGroup]) -> torch.Tensor:
    """This rank's share of ``router_aux_loss_coef x`` the load-balancing loss of the whole batch, from
    every layer's ``router_logits`` [rows x tokens, experts]: ``valid`` [rows, tokens] marks this
    rank's real tokens (None: all), ``groups`` join the ranks holding the batch's other tokens (dp x
    cp, and tp under sequence parallelism)."""
    experts, top_k = model.num_experts, model.num_experts_per_tok
    logits = torch.cat(list(router_logits), dim=0)  # [layers x rows, experts]
    layers = len(router_logits)
    probs = F.softmax(logits, dim=-1)
    chosen = F.one_hot(torch.topk(probs, top_k, dim=-1).indices, experts)  # [layers x rows, top_k, experts]
    if valid is None:
        weight = torch.ones(logits.shape[0], dtype=probs.dtype, device=probs.device)
    else:  # layer-major, as the logits are concatenated
        weight = valid.reshape(-1).to(probs.dtype).repeat(layers)
    counts = (chosen * weight[:, None, None]).sum(0)  # [top_k, experts]
    pooled = torch.cat([counts.reshape(-1), weight.sum()[None]]).detach()
    for group in groups:
        flat_all_reduce_([pooled], group=group)
    counts, rows = pooled[:-1].view_as(counts), pooled[-1]
    prob_sum = (probs * weight[:, None]).sum(0)
    loss = torch.sum(counts / rows * (prob_sum / rows)[None]) * experts
    return model.router_aux_loss_coef * loss
