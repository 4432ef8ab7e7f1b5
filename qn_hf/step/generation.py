"""``pm.generate``: Hugging Face's own generation loop, run identically on every rank of a dp replica.

Every rank of a replica (its tp x pp ranks) calls ``module.generate`` with the same inputs, so every
rank runs the same loop (greedy, sampling, its logits processors and stopping criteria, all HF's);
what differs by mesh is only how one forward call of that loop reaches the whole model. Hooks do
that, for the duration of the call; no forward is replaced.

* pp=1: the module holds every block and HF's loop runs with its KV cache, as on one device. At tp>1
  the head computes this rank's columns of the (padded) vocabulary: a forward hook on the module
  gathers the columns over tp and cuts the padding, so the logits processors see the whole
  vocabulary, identical on every tp rank.
* pp>1: one forward call runs the stages in turn over the whole sequence so far, without a cache. A
  pre-hook on a later stage's base model receives the previous stage's hidden states into the
  pipeline entry (``Injector``); a hook on a non-last stage's base model sends its output on; the
  last stage's last-position logits (whole vocabulary, float32) are broadcast over the pp group and
  become every stage's ``outputs.logits``. With virtual stages a rank runs each of its chunks in
  turn within the one forward call, so the hidden states go round the ring of stages once per
  chunk (``_pipeline_hooks``). No cache, because each stage's cache would hold only its
  own blocks while HF reads sequence lengths from layer 0's. The cost: token t re-runs the t tokens
  before it, O(n^2) work in the generated length instead of O(n) -- fine for evaluation samples,
  not for serving (``save_pretrained`` and a serving engine are for that).

Sampling: HF draws with ``torch.multinomial`` from the device's default generator. Before the loop
every rank of the replica adopts the generator state of the replica's first rank (tp 0 of stage 0),
so all draw the same tokens from the same probabilities, and that rank draws exactly what the plain
model draws given the same state. Afterwards the first stage's ranks keep the advanced state (as the
plain model's generator advances; equal across tp, as qn_hf's shared dropout stream must be); later
stages get their own back, which ``rng.py`` keeps distinct per stage.

ep>1: experts exchange tokens with ranks of other dp replicas, whose loops may differ in length
(other prompts, another ``max_new_tokens``, an early end of sequence). HF's own ``synced_gpus``
(made for ZeRO-3, where every forward gathers weights from every rank) keeps every rank of the job
calling the forward until all have finished: one flag all-reduce over the job and one host read per
token. A rank that finished runs forwards whose outputs HF discards; the all-to-alls pair up.

Sequence parallelism is switched off for the call (``SequenceParallelSwitch``): a one-token step
cannot be split over tp.

Context parallelism is switched off for the call too (``AttentionSwitch``): every cp rank holds the whole
model, so each runs the loop on whole sequences with the attention that ran before ring attention
(one token cannot be cut into 2*cp pieces), as the tp ranks of a replica each run it.

Refused (``ValueError`` naming the fix): ep>1 with ``synced_gpus=False``, and at pp>1: ``use_cache=True``, ``inputs_embeds``,
``past_key_values`` (``cache``) and per-layer outputs (attentions, hidden states: each stage has only its own).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn

from ..comm import flat_broadcast_
from ..compat import CACHE_KWARGS, trim_attention_mask
from ..pipeline.p2p import Link
from ..pipeline.stage import StageModules
from ..pipeline.wire import broadcast_announced, empty_header, header_of, read_header
from ..placement import ShardPlacement
from ..tensor_parallel.rng import device_rng_state, set_device_rng_state

PP_REFUSED = ("inputs_embeds", *CACHE_KWARGS)
PER_LAYER_OUTPUTS = ("output_attentions", "output_hidden_states")


@contextlib.contextmanager
def switched_off(*switches) -> Iterator[None]:
    """Each of ``switches`` that exists (sequence parallelism's, ring attention's) off for the call."""
    with contextlib.ExitStack() as stack:
        for switch in switches:
            if switch is not None:
                stack.enter_context(switch.off())
        yield


def parallel_generate(module: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, *,
                      stage: StageModules, placement: ShardPlacement,
                      full_logits: Callable[[torch.Tensor], torch.Tensor] | None,
                      generate_kwargs: Mapping[str, object]):
    """``module.generate(input_ids, attention_mask=..., **generate_kwargs)`` over the replica: every
    rank returns what the plain model's ``generate`` returns. ``full_logits`` gathers vocab-sharded
    logits (None when the vocabulary is not sharded). Runs in evaluation mode, restoring the mode."""
    check_generate(module, stage=stage, placement=placement, generate_kwargs=generate_kwargs)
    device, pp_rank = placement.device, placement.coords.pp
    kwargs = dict(generate_kwargs)
    if placement.dims.ep > 1:  # every rank calls the forward until all have finished (module docstring)
        kwargs["synced_gpus"] = True
    if stage.stages > 1:
        kwargs["use_cache"] = False
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask.to(device)
    was_training = module.training
    own_state = device_rng_state(device)
    handles = []
    module.eval()
    try:
        _share_generator(placement)
        if stage.stages > 1:
            handles = _pipeline_hooks(module, stage=stage, placement=placement, full_logits=full_logits)
            if kwargs.get("synced_gpus"):  # a finished peer's mask outgrows its ids on transformers 5.17
                handles.append(module.register_forward_pre_hook(trim_attention_mask, with_kwargs=True))
        elif full_logits is not None:
            handles = [module.register_forward_hook(lambda _m, _a, out: _with_logits(out, full_logits(out.logits)))]
        return module.generate(input_ids.to(device), **kwargs)
    finally:
        for handle in handles:
            handle.remove()
        module.train(was_training)
        if pp_rank != 0:
            set_device_rng_state(device, own_state)


def check_generate(module: nn.Module, *, stage: StageModules, placement: ShardPlacement,
                   generate_kwargs: Mapping[str, object]) -> None:
    """Every refusal of the model or of the call, raised before any communication (the same on every
    rank of a replica); generate with cp, ep, sp or interleaved chunks is the composition table's."""
    dims = placement.dims
    if not getattr(module, "can_generate", lambda: False)():
        raise ValueError(f"{type(module).__name__} cannot generate (no language-model head with a generation mixin)")
    config = generate_kwargs.get("generation_config") or getattr(module, "generation_config", None)
    clocked = generate_kwargs.get("max_time", getattr(config, "max_time", None)) is not None
    if (dims.tp > 1 or stage.stages > 1) and (clocked or generate_kwargs.get("stopping_criteria")):
        # every rank of a replica must run the same number of steps (each step is collectives); a clock or a
        # user criterion is evaluated by each rank on its own and may stop one rank before the others
        raise ValueError(f"generate at tp={dims.tp}, pp={stage.stages} with max_time or stopping_criteria: each rank "
                         f"would decide on its own when to stop and the others would wait for it; use max_new_tokens "
                         f"(and eos_token_id / stop_strings), which every rank decides alike")
    if dims.ep > 1 and generate_kwargs.get("synced_gpus") is False:
        raise ValueError(f"generate at ep={dims.ep} with synced_gpus=False: the experts exchange tokens with ranks of "
                         f"other dp replicas, which would wait for a rank that stopped; leave synced_gpus unset")
    if stage.stages == 1:
        return
    if generate_kwargs.get("use_cache"):
        raise ValueError(f"use_cache=True at pp={stage.stages}: each stage would cache only its own blocks; pp>1 "
                         f"generates without a cache (each token re-runs the sequence), leave use_cache unset")
    wanted = [k for k in PER_LAYER_OUTPUTS if generate_kwargs.get(k, getattr(config, k, False))]
    wanted += [k for k in PP_REFUSED if generate_kwargs.get(k) is not None]
    if wanted:
        raise ValueError(f"generate at pp={stage.stages} does not support {wanted}: each stage holds only its own "
                         f"layers; pass input_ids (and attention_mask) only")


def _pipeline_hooks(module: nn.Module, *, stage: StageModules, placement: ShardPlacement,
                    full_logits: Callable[[torch.Tensor], torch.Tensor] | None) -> list:
    """The hooks that make one forward call of ``module`` on every rank one pass through the pipeline:
    through each of this rank's chunks in turn (one, or ``virtual_stages`` of them, interleaved with
    the other ranks' around the ring of stages). HF calls the base model once; its pre-hook installs
    the first chunk's view (and receives into the pipeline entry), its hook sends that chunk's output
    on and runs the base model again for each further chunk, in that chunk's view, returning the
    last one's output: the head runs on it, as a training step's last chunk does."""
    groups, device = placement.groups, placement.device
    chunks = stage.chunks
    views = contextlib.ExitStack()
    again = [False]  # inside the hook's own further calls: their hooks stand aside

    def enter(chunk: int) -> None:
        views.enter_context(stage.view(chunk))
        if chunk > 0:
            stage.injector.pending = _recv(groups.peers.from_prev, device=device)

    def leave(chunk: int, output) -> None:
        if not stage.is_last_chunk(chunk):
            _send(output[0], groups.peers.to_next)  # the base model's last_hidden_state, as a training step sends
        views.close()

    def before(_module, _args, _kwargs):
        if not again[0]:
            enter(chunks[0])

    def after(base, args, kwargs, output):
        if again[0]:
            return output
        leave(chunks[0], output)
        for chunk in chunks[1:]:
            enter(chunk)
            again[0] = True
            try:
                output = base(*args, **kwargs)
            finally:
                again[0] = False
            leave(chunk, output)
        return output

    handles = [stage.base.register_forward_pre_hook(before, with_kwargs=True),
               stage.base.register_forward_hook(after, with_kwargs=True)]

    def share_logits(_module, _args, output):
        last = None
        if stage.is_last:  # only the last position is read; gather the vocabulary of that one
            last = output.logits[:, -1:]
            last = (full_logits(last) if full_logits is not None else last).float()
        return _with_logits(output, broadcast_announced(last, src=stage.stages - 1, group=groups.pp, device=device))

    handles.append(module.register_forward_hook(share_logits))
    return handles


def _with_logits(output, logits: torch.Tensor):
    output.logits = logits
    return output


def _send(x: torch.Tensor, link: Link) -> None:
    """The header, then ``x``, on the training pipeline's own link to the next stage (p2p.py)."""
    x = x.detach().contiguous()
    header = header_of(x)
    for work in (link.send(header, tag=0), link.send(x, tag=1)):
        work.wait()


def _recv(link: Link, *, device: torch.device) -> torch.Tensor:
    header = empty_header(device)
    link.recv(header, tag=0).wait()
    shape, dtype = read_header(header)  # a host read: the sequence grows by a token per call
    x = torch.empty(shape, dtype=dtype, device=device)
    link.recv(x, tag=1).wait()
    return x


def _share_generator(placement: ShardPlacement) -> None:
    """The replica's first rank's generator state on every rank of the replica: over tp within each
    stage, then over pp from the first stage (the device's tensor: NCCL broadcasts no host tensor)."""
    device, groups = placement.device, placement.groups
    state = device_rng_state(device).to(device)
    for group in (groups.tp, groups.cp, groups.pp):  # cp ranks each run the loop too, on whole sequences
        if group is not None:
            flat_broadcast_([state], src_group_rank=0, group=group)
    set_device_rng_state(device, state)
