"""Where a model is cut into pipeline stages: which blocks, entry, first-only and last-only modules
and heads each stage holds, and which weights two stages share (``StagePlan``).

``build_stage_plan`` validates the cut for the policy's cut points and communicates nothing; it
reads the model only, so it works on a ``meta``-device model (the planner's). Applying a plan to
one rank's model is stage.py's ``apply_stage``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from ..arguments import check_positive_int
from ..compat import per_layer
from ..policies.model_policy import ModelPolicy
from ..policies.patterns import base_model_and_prefix, join
from ..policies.task import task_head
from .schedule import Op, chunks_of, rank_of_chunk
from .seq2seq import Seq2SeqStages, split_stacks
from .seq2seq import chunk_of as seq2seq_chunk


@dataclass(frozen=True)
class PipelineTie:
    """One parameter shared by a module on the first stage and one on the last (GPT-2's wte and
    lm_head). Each stage holds its own copy; their gradients are summed every step."""

    owner: str  # the HF name that is saved (first stage)
    follower: str  # the other name (last stage)


@dataclass(frozen=True)
class StagePlan:
    """The cut of a model into ``stages`` (pp ranks) x ``virtual`` chunks. Chunk c holds the blocks
    ``layer_ranges[c]`` and lives on rank ``c % stages`` (interleaved schedules: rank r runs chunks
    r, r+pp, ...); with ``virtual=1`` a chunk is a stage. The entry and first-only modules belong to
    chunk 0, the last-only modules and heads to the last chunk."""

    stages: int
    layer_ranges: tuple[tuple[int, int], ...]  # [start, stop) of the blocks of each chunk, in chunk order
    layers: str | None  # ModuleList path from the top model (None: the model has no blocks, one stage)
    entry: str | None  # paths from the top model
    first_only: tuple[tuple[str, str], ...]  # (module, stand-in)
    last_only: tuple[tuple[str, str], ...]
    heads: tuple[str, ...]
    entry_reads: tuple[str, ...]
    ties: tuple[PipelineTie, ...]
    virtual: int = 1  # chunks per rank
    # the received activation enters at each chunk's first block; the entry gives zeros on later
    # stages (ModelPolicy.pp_receive_at_blocks)
    receive_at_blocks: bool = False
    # modules real on every stage, the entry among them (ModelPolicy.pp_every_stage): their
    # parameters' gradients are summed over the pipeline
    every_stage: tuple[str, ...] = ()
    # of those, the ones whose output packs one part per block (ModelPolicy.pp_per_block_outputs)
    per_block: tuple[str, ...] = ()
    # an encoder-decoder: encoder chunks, then decoder chunks (seq2seq.py); ``layers`` is then the decoder's
    seq2seq: Seq2SeqStages | None = None
    # ``layers`` holds one module the loop calls this config key's count of times (ModelPolicy.pp_loop_count):
    # ``layer_ranges`` cut the iterations, and the module is among ``every_stage``
    loop_count: str | None = None
    # the other lists of a body written out over parallel lists (ModelPolicy.pp_siblings): full length on every
    # stage, this rank's positions real; ``layers``' module at a chunk's first position - 1 takes the activation
    siblings: tuple[str, ...] = ()

    def block(self, model: nn.Module, index: int) -> nn.Module:
        """The module block ``index`` of the whole model runs (the looped module for every index)."""
        return getattr(model.get_submodule(self.layers), "0" if self.loop_count is not None else str(index))

    @property
    def block_lists(self) -> tuple[str, ...]:
        """Every list of blocks a stage may hold blocks of (an encoder-decoder's two)."""
        if self.seq2seq is not None:
            return (self.seq2seq.encoder_layers, self.seq2seq.decoder_layers)
        return () if self.layers is None else (self.layers,)

    @property
    def chunks(self) -> int:
        return self.stages * self.virtual

    def rank_of_chunk(self, chunk: int) -> int:
        return rank_of_chunk(chunk, stages=self.stages)

    def chunks_of(self, stage: int) -> tuple[int, ...]:
        """The chunks rank ``stage`` runs, in model order."""
        return chunks_of(stage=stage, stages=self.stages, virtual_stages=self.virtual)

    def chunk_of_layer(self, index: int) -> int:
        return next(c for c, (a, b) in enumerate(self.layer_ranges) if a <= index < b)


def split_layers(*, num_layers: int, stages: int, layers_per_stage: Sequence[int] | None = None,
                 virtual: int = 1) -> tuple[tuple[int, int], ...]:
    """Contiguous block ranges per chunk (``stages`` x ``virtual`` of them, in model order): as even
    as possible (earlier chunks take the remainder), or exactly ``layers_per_stage`` (one entry per
    chunk)."""
    check_positive_int("virtual_stages", virtual)
    chunks = stages * virtual
    what = f"pp={stages}" if virtual == 1 else f"pp={stages} x virtual_stages={virtual} = {chunks} chunks"
    if chunks > num_layers:
        fix = f"use pp <= {num_layers}" if virtual == 1 else f"use pp x virtual_stages <= {num_layers}"
        raise ValueError(f"{what} is larger than the number of blocks ({num_layers}); {fix}")
    if layers_per_stage is None:
        sizes = [num_layers // chunks + (1 if s < num_layers % chunks else 0) for s in range(chunks)]
    else:
        sizes = list(layers_per_stage)
        if len(sizes) != chunks or any(not isinstance(n, int) or n < 1 for n in sizes) or sum(sizes) != num_layers:
            each = f"each of the pp={stages} stages" if virtual == 1 else f"each of the {what}"
            raise ValueError(f"layers_per_stage={sizes} must give {each} at least one block and sum to the "
                             f"{num_layers} blocks")
    bounds, start = [], 0
    for n in sizes:
        bounds.append((start, start + n))
        start += n
    return tuple(bounds)


def build_stage_plan(
    model: nn.Module, policy: ModelPolicy, *, stages: int, layers_per_stage: Sequence[int] | None = None,
    virtual: int = 1,
) -> StagePlan:
    """Validate the cut for ``stages`` stages of ``virtual`` chunks each (pure: reads the model,
    communicates nothing)."""
    base, prefix = base_model_and_prefix(model)
    if stages > 1 and policy.pp_refusal is not None:
        raise ValueError(f"pp={stages} ({policy.model_type}): {policy.pp_refusal}; use pp=1 (data and tensor "
                         f"parallelism still apply)")
    heads = [] if base is model else [n for n, _ in model.named_children() if model.get_submodule(n) is not base]
    head = task_head(model)
    if stages > 1 and head.reshapes_inputs:
        raise ValueError(f"pp={stages} ({head.cls}): the head reshapes the inputs before the base model sees them "
                         f"(the choices become rows), which only the last stage would do; use pp=1")
    if policy.layers is None:  # no blocks (body.py): one stage holds everything
        if stages > 1 or virtual > 1:
            raise ValueError(f"pp={stages} ({policy.model_type}): the policy names no list of blocks to cut into "
                             f"stages; use pp=1")
        return StagePlan(stages=1, layer_ranges=((0, 0),), layers=None, entry=None, first_only=(), last_only=(),
                         heads=tuple(heads), entry_reads=(), ties=())
    if stages > 1 and policy.pp_seq2seq is not None:
        return _seq2seq_plan(model, policy, prefix=prefix, stages=stages, layers_per_stage=layers_per_stage,
                             virtual=virtual)
    layers = base.get_submodule(policy.layers)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"policy {policy.model_type}: layers {policy.layers!r} is not a ModuleList")
    ranges = split_layers(num_layers=loop_iterations(base, policy) if policy.pp_loop_count else len(layers),
                          stages=stages, layers_per_stage=layers_per_stage, virtual=virtual)
    if policy.pp_siblings and virtual > 1:
        raise ValueError(f"pp={stages} x virtual_stages={virtual} ({policy.model_type}): its forward writes the blocks' "
                         f"body out over parallel lists ({policy.layers}, {', '.join(policy.pp_siblings)}), which a "
                         f"stage keeps whole for one chunk only; use virtual_stages=1")
    if stages > 1 and policy.pp_entry is None:
        why = (f"transformers declares no base_model_pp_plan for {policy.model_type!r} and its base model's forward does "
               f"not show the cut points plainly (the embedding, the blocks, then only a final norm)"
               if policy.transformers_plan else f"policy {policy.model_type} has no pp_entry")
        raise ValueError(f"pp={stages}: {why}; use pp=1 (data and tensor parallelism still apply) or pass "
                         f"policy=ModelPolicy(..., pp_entry=...)")

    def present(names: Sequence[str]) -> list[str]:
        # A stand-in target must exist, except an optional submodule the model leaves as None
        # (ViTModel without a pooler).
        found = []
        for name in names:
            parent, _, child = name.rpartition(".")
            holder = base.get_submodule(parent) if parent else base
            if not hasattr(holder, child):
                raise ValueError(f"policy {policy.model_type}: pipeline module {name!r} does not exist")
            if getattr(holder, child) is not None:
                found.append(name)
        return found

    entry = policy.pp_entry
    if entry is not None:
        present([entry])
        if (policy.pp_receive_at_blocks and entry not in policy.pp_every_stage
                and not isinstance(base.get_submodule(entry), nn.Embedding)):
            raise ValueError(f"policy {policy.model_type}: pp_receive_at_blocks needs an nn.Embedding entry (later "
                             f"stages give zeros of its shape) or one real on every stage (pp_every_stage), not "
                             f"{type(base.get_submodule(entry)).__name__}")
        for path in policy.pp_entry_reads:
            obj = base.get_submodule(entry)
            for part in path.split("."):
                if not hasattr(obj, part):
                    raise ValueError(f"policy {policy.model_type}: {join(entry, path)} (in pp_entry_reads) does not exist")
                obj = getattr(obj, part)
    first = [(n, policy.pp_first[n]) for n in present(list(policy.pp_first))]
    last = [(n, policy.pp_last[n]) for n in present(list(policy.pp_last))]

    plan = StagePlan(
        stages=stages,
        layer_ranges=ranges,
        layers=join(prefix, policy.layers),
        entry=join(prefix, entry) if entry else None,
        first_only=tuple((join(prefix, n), s) for n, s in first),
        last_only=tuple((join(prefix, n), s) for n, s in last),
        heads=tuple(heads),
        entry_reads=policy.pp_entry_reads,
        ties=(),
        virtual=virtual,
        receive_at_blocks=policy.pp_receive_at_blocks,
        every_stage=tuple(join(prefix, n) for n in present(list(policy.pp_every_stage))),
        per_block=tuple(join(prefix, n) for n in present(list(policy.pp_per_block_outputs))),
        loop_count=policy.pp_loop_count,
        siblings=tuple(join(prefix, n) for n in policy.pp_siblings),
    )
    if stages > 1:
        _check_assignment(model, plan, policy)
        _check_carried(model, plan, policy)
        _check_kv_sharing(model, plan, policy)
    return StagePlan(**{**plan.__dict__, "ties": _cross_stage_ties(model, plan)})


def loop_iterations(base: nn.Module, policy: ModelPolicy) -> int:
    """How often the loop over ``policy.layers`` calls its one module: the count its holder's config says."""
    holder = base.get_submodule(policy.layers.rpartition(".")[0])
    count = getattr(getattr(holder, "config", None), policy.pp_loop_count, None)
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"policy {policy.model_type}: the loop over {policy.layers} counts config."
                         f"{policy.pp_loop_count}, which {type(holder).__name__}'s config does not hold as a positive "
                         f"number")
    return count


def _seq2seq_plan(model: nn.Module, policy: ModelPolicy, *, prefix: str, stages: int, layers_per_stage,
                  virtual: int) -> StagePlan:
    """An encoder-decoder's pipeline (seq2seq.py): encoder stages, then decoder stages."""
    cut = policy.pp_seq2seq
    placed = {join(prefix, n) for n in (cut.encoder, cut.decoder, *cut.shared)}
    heads = tuple(n for n, _ in model.named_modules() if n and "." not in n and n not in placed
                  and (not prefix or n != prefix) and any(True for _ in model.get_submodule(n).parameters()))
    heads += tuple(join(prefix, n) for n, m in model.get_submodule(prefix).named_children()
                   if join(prefix, n) not in placed and any(True for _ in m.parameters())) if prefix else ()
    stacks, ranges = split_stacks(cut, prefix=prefix, encoder_blocks=len(model.get_submodule(join(prefix, cut.encoder_layers))),
                                  decoder_blocks=len(model.get_submodule(join(prefix, cut.decoder_layers))), stages=stages,
                                  layers_per_stage=layers_per_stage, virtual=virtual, heads=heads)
    plan = StagePlan(stages=stages, layer_ranges=ranges, layers=stacks.decoder_layers, entry=None, first_only=(),
                     last_only=(), heads=heads, entry_reads=(), ties=(), every_stage=stacks.shared, seq2seq=stacks)
    _check_assignment(model, plan, policy)
    return StagePlan(**{**plan.__dict__, "ties": _cross_stage_ties(model, plan)})


def chunk_of_module(plan: StagePlan, name: str) -> int | None:
    """The chunk a module (by its path in the top model) belongs to; None: every chunk."""
    def under(root: str) -> bool:
        return name == root or name.startswith(root + ".")

    if plan.seq2seq is not None:
        return seq2seq_chunk(plan.seq2seq, name, chunks=plan.chunks, layer_ranges=plan.layer_ranges)

    if any(under(n) for n in plan.every_stage):
        return None
    if plan.entry and under(plan.entry) or any(under(n) for n, _ in plan.first_only):
        return 0
    if any(under(n) for n, _ in plan.last_only) or any(under(h) for h in plan.heads):
        return plan.chunks - 1
    for layers in (plan.layers, *plan.siblings) if plan.layers is not None else ():
        if under(layers) and name != layers:
            return plan.chunk_of_layer(int(name[len(layers) + 1 :].split(".")[0]))
    return None


def stage_of_module(plan: StagePlan, name: str) -> int | None:
    """The stage (pp rank) a module lives on; None: every stage."""
    chunk = chunk_of_module(plan, name)
    return None if chunk is None else plan.rank_of_chunk(chunk)


def _check_assignment(model: nn.Module, plan: StagePlan, policy: ModelPolicy) -> None:
    """Parameters outside any stage's modules would be copied onto every stage; refuse them, except
    under the modules the policy puts on every stage."""
    for name, _ in model.named_parameters():
        module = name.rpartition(".")[0]
        if stage_of_module(plan, module) is None and not on_every_stage(plan, module):
            source = (f"transformers' base_model_pp_plan for {policy.model_type!r} does not place it (only the "
                      f"embedding, the blocks and what follows them); " if policy.transformers_plan else "")
            raise ValueError(f"parameter {name} belongs to no pipeline stage: {source}name its module in the "
                             f"policy's pp_first or pp_last, or use pp=1")


def _check_carried(model: nn.Module, plan: StagePlan, policy: ModelPolicy) -> None:
    """What a block hands the next one besides the hidden states (``policy.pp_carried``) does not
    cross a stage boundary: each later chunk's first block must make it anew, as the config's
    per-layer kinds tell (``policy.pp_carried_reuse``); refuse any other cut."""
    if not policy.pp_carried:
        return
    config = model.config.get_text_config()
    key, reuse = policy.pp_carried_reuse or (None, None)
    if not isinstance(getattr(config, key or "", None), list):
        key = None
    starts = [start for start, _ in plan.layer_ranges[1:]]
    reusing = [i for i in starts if key is None or getattr(config, key)[i] == reuse]
    if reusing:
        kinds = f" ({key}[{reusing[0]}] = {reuse!r})" if key else ""
        layers = sum(b - a for a, b in plan.layer_ranges)
        allowed = [i for i in range(1, layers) if key is not None and getattr(config, key)[i] != reuse]
        cuts = _nearest_cuts(allowed, layers=layers, chunks=len(plan.layer_ranges))
        fix = (f"layers_per_stage={[b - a for a, b in zip([0, *cuts], [*cuts, layers])]} cuts only before blocks that "
               f"make it anew ({', '.join(map(str, cuts))})" if cuts else
               f"no cut into {len(plan.layer_ranges)} chunks starts only at blocks that make it anew "
               f"({allowed or 'none'}): use fewer stages")
        raise ValueError(f"pp={plan.stages} ({policy.model_type}): its base forward hands each block "
                         f"{', '.join(policy.pp_carried)} from the block before besides the hidden states, and block "
                         f"{reusing[0]}, the first of a chunk, reuses it{kinds}, but a pipeline sends only the hidden "
                         f"states between stages; {fix}, or use pp=1")


def _nearest_cuts(allowed: list[int], *, layers: int, chunks: int) -> list[int]:
    """``chunks - 1`` increasing cut points from ``allowed``, each the nearest free one to where an even
    split would cut ([] if there are too few)."""
    cuts: list[int] = []
    for k in range(1, chunks):
        left = [i for n, i in enumerate(allowed) if (not cuts or i > cuts[-1]) and len(allowed) - n >= chunks - k]
        if not left:
            return []
        cuts.append(min(left, key=lambda i: abs(i - k * layers / chunks)))
    return cuts


def on_every_stage(plan: StagePlan, name: str) -> bool:
    """Whether a module (by its path in the top model) is real on every stage (``every_stage``)."""
    return any(name == root or name.startswith(root + ".") for root in plan.every_stage)


def _check_kv_sharing(model: nn.Module, plan: StagePlan, policy: ModelPolicy) -> None:
    """A block that reuses the keys and values an earlier block of its kind stored (Gemma 3n and 4's
    last layers) reads them from a dict the base forward passes every block on its own stage: both
    must be in one chunk."""
    if policy.pp_kv_sharing is None:
        return
    config = model.config.get_text_config()
    key, store, reuse = policy.pp_kv_sharing
    modes, kinds = per_layer(config, key), getattr(config, "layer_types", None)
    if not isinstance(modes, list) or reuse not in modes:
        return
    kinds = kinds if isinstance(kinds, list) and len(kinds) == len(modes) else [None] * len(modes)
    for j, mode in enumerate(modes):
        if mode != reuse:
            continue
        source = max((i for i in range(j) if modes[i] == store and kinds[i] == kinds[j]), default=None)
        if source is None or plan.chunk_of_layer(source) != plan.chunk_of_layer(j):
            where = f"block {source}, in chunk {plan.chunk_of_layer(source)}" if source is not None else "no earlier block"
            raise ValueError(f"pp={plan.stages} ({policy.model_type}): block {j} ({key}[{j}] = {reuse!r}) reuses the keys "
                             f"and values stored by {where}, but block {j} is in chunk {plan.chunk_of_layer(j)}, and a "
                             f"pipeline sends only the hidden states between stages; keep them in one stage "
                             f"(layers_per_stage) or use pp=1")


def _cross_stage_ties(model: nn.Module, plan: StagePlan) -> tuple[PipelineTie, ...]:
    if plan.stages == 1:
        return ()  # one stage holds every copy
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    ties = []
    for names in by_id.values():
        if len(names) < 2:
            continue
        if any(on_every_stage(plan, n.rpartition(".")[0]) for n in names):
            # one name is real on every stage, so each stage holding another holds the same object:
            # the pipeline's sum over every stage covers it (Gemma 4's head tied to its embedding)
            continue
        stages = {stage_of_module(plan, n.rpartition(".")[0]) for n in names}
        if len(stages) == 1:
            continue
        if len(names) != 2 or stages != {0, plan.stages - 1}:
            raise ValueError(f"tied parameters {names} span stages {sorted(stages)}; only first-last ties are supported")
        owner, follower = sorted(names, key=lambda n: stage_of_module(plan, n.rpartition(".")[0]))
        ties.append(PipelineTie(owner=owner, follower=follower))
    return tuple(ties)


def params_by_final_pass(module: nn.Module, plan: StagePlan, *, chunks: tuple[int, ...],
                         deferred: frozenset[str]) -> dict[tuple[int, str], list[nn.Parameter]]:
    """Each trainable parameter of ``module`` (a rank holding ``chunks``) under (its chunk, ``Op.WGT`` if its
    weight gradient is ``deferred`` to a W pass else ``Op.BWD``): after that chunk's last pass of that kind
    its gradient is final. A parameter outside every chunk (only without a pipeline) counts with the
    first chunk."""
    finals: dict[tuple[int, str], list[nn.Parameter]] = {}
    for name, param in module.named_parameters():
        if param.requires_grad:
            chunk = chunk_of_module(plan, name.rpartition(".")[0])
            key = (chunks[0] if chunk is None else chunk, Op.WGT if name in deferred else Op.BWD)
            finals.setdefault(key, []).append(param)
    return finals
