"""``ModelPolicy``: how to parallelize one architecture, as data (module name patterns and the style
each takes, the pipeline's cut points and stand-ins, the loss, the forward's keywords). Checked
when it is built; resolved against a concrete model by ``tensor_parallel/plan.py`` and
``pipeline/split.py``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..config.options import LossKind
from .cuts import Seq2SeqCut, StandIn
from .fused import HeadAxis
from .heads import LAYOUT_VALUES
from .styles import STYLES, Style

STANDINS = StandIn.values()


@dataclass(frozen=True)
class ModelPolicy:
    """How to parallelize one architecture's body. Patterns in ``tp_plan``, ``layers``, ``attr_patches``
    and the rng regions are relative to the base model (``model.base_model``). The head is found from
    the model, whichever it is (``policies/task.py``: an LM head over the vocabulary is split over tp,
    any other stays whole), and so is its loss; ``head_plan`` (patterns relative to the task model)
    may give a head module another style, and applies only to the heads a model has. ``loss``
    overrides the loss found from the model's class (a custom class transformers' taxonomy does not
    know). ``layers`` is the list of blocks (None: the model has none, so no pipeline, recomputation
    or tp; data parallelism needs nothing more).

    ``tp_entries`` names modules (attention, MLP) whose first forward argument feeds only their
    column-parallel layers: the tensor enters the tp region once there, so the input gradient of
    q, k and v takes one all-reduce instead of three. Column layers outside entries enter alone.

    Pipeline stages run the base model's own forward over their blocks. ``pp_entry`` is the module
    that makes the first hidden state (the token or patch embedding): on later stages it is
    replaced by a stand-in that returns the activation received from the previous stage, keeping
    the attributes in ``pp_entry_reads`` that the forward reads from it. ``pp_first`` and
    ``pp_last`` name the other modules that belong to the first or last stage only, with the stand-in
    they get elsewhere: ``"zeros"`` (GPT-2's position embedding, added to the received activation)
    or ``"identity"`` (dropout after the embedding, the final norm). With ``pp_receive_at_blocks``
    the received activation enters at each chunk's first block instead, and the entry (an
    ``nn.Embedding``) gives zeros on later stages: for base models that turn the embedding into the
    blocks' input before the blocks (DeepSeek-V4 expands it into hyper-connection streams, NanoChat
    normalizes it), which a later stage must not do again to what it receives.

    ``attr_patches`` keys are a module pattern and an attribute path: ``layers.*.self_attn.num_heads``,
    or through an object the module reads, ``layers.*.self_attn.config.num_attention_heads`` (the
    module then gets its own copy of the config; other modules and saved configs keep the shared one).
    ``transformers_plan`` reads the plan with transformers' conventions: a rule may match nothing
    (an optional module) and a Linear inside a block that no rule names stays whole. ``tp_refusal`` is why this policy cannot shard
    over tp (it still serves dp and pp). ``pp_carried`` names what the base forward hands each block from
    the block before besides the hidden states (HY-V4's top-k indices): no stage boundary carries
    it, so a cut is refused unless every later chunk's first block makes it anew, as
    ``pp_carried_reuse`` tells: the config's list of per-layer kinds and the kind that reuses it.

    ``pp_every_stage`` names modules that are real on every stage, the entry among them: what the
    base forward runs before the blocks and hands every block besides the hidden states (Gemma 4's
    per-layer embeddings, which read the token embedding too). Each stage computes them for its own
    blocks (``pp_receive_at_blocks`` is then required), and their gradients, each copy's share
    through its own blocks, are summed over the pipeline, as a tied weight's are.
    ``pp_per_block_outputs`` are those of them whose output packs one part per block, block-major,
    in its last dimension, which the forward indexes by the loop's position
    (``per_layer_inputs[:, :, i]``): on a chunk starting at block s the parts are rotated so that
    part s comes first. ``pp_kv_sharing`` = (config list of per-layer modes, the mode that stores
    keys and values, the mode that reuses them): a block that reuses the keys and values of an
    earlier block of its kind (``config.layer_types``) must be in that block's chunk.
    ``pp_loop_count``: the blocks (``layers``) are one module the loop calls this config key's count of
    times (ALBERT's shared layer group, looped.py); stages cut the iterations, the module is real on
    every stage (among ``pp_every_stage``).
    ``pp_siblings``: the forward writes the blocks' body out over parallel lists indexed by the loop's
    position (XLM, Flaubert; indexed_lists.py): ``layers`` is the one whose module's result the stages send
    and receive in place of, these are the others, each kept at full length on every stage.
    ``pp_refusal`` is why this policy cannot cut the model into stages (it still serves dp and tp).
    """

    model_type: str
    layers: str | None
    tp_plan: Mapping[str, Style | str]
    head_plan: Mapping[str, Style | str] = field(default_factory=dict)
    attr_patches: Mapping[str, str] = field(default_factory=dict)
    tp_entries: tuple[str, ...] = ()
    tp_rng_regions: tuple[str, ...] = ()
    shared_rng_regions: tuple[str, ...] = ()
    loss: LossKind | str | None = None
    forward_kwargs: Mapping[str, object] = field(default_factory=dict)
    num_kv_heads_key: str | None = None
    pp_entry: str | None = None
    pp_entry_reads: tuple[str, ...] = ()
    pp_first: Mapping[str, str] = field(default_factory=dict)
    pp_last: Mapping[str, str] = field(default_factory=dict)
    pp_receive_at_blocks: bool = False
    transformers_plan: bool = False
    tp_refusal: str | None = None
    # (n, why): transformers' plan holds only at a tp that divides n (CodeGen's 4 blocks of q|v|k); else refused
    tp_divides: tuple[int, str] | None = None
    # an attention module (pattern) -> the inputs it takes built for every head, and where they hold them
    # (BLOOM's ALiBi bias): each tp rank's module takes its heads' rows (tensor_parallel/hooks.py)
    head_inputs: Mapping[str, Mapping[str, HeadAxis]] = field(default_factory=dict)
    pp_carried: tuple[str, ...] = ()
    pp_carried_reuse: tuple[str, str] | None = None  # (config list of per-layer kinds, the kind that reuses it)
    pp_every_stage: tuple[str, ...] = ()
    pp_per_block_outputs: tuple[str, ...] = ()
    pp_kv_sharing: tuple[str, str, str] | None = None  # (config list of per-layer modes, store, reuse)
    pp_loop_count: str | None = None
    pp_siblings: tuple[str, ...] = ()
    pp_refusal: str | None = None
    # an encoder-decoder: its two stacks, encoder stages then decoder stages (stack_cut.Seq2SeqCut)
    pp_seq2seq: Seq2SeqCut | None = None

    def __post_init__(self) -> None:
        for pattern, style in {**self.tp_plan, **self.head_plan}.items():
            if style not in STYLES:
                raise ValueError(f"policy {self.model_type}: rule {pattern!r} has unknown style {style!r}; known: {STYLES}")
        # frozen: the rules' styles become members once, here (a policy may spell them as strings)
        object.__setattr__(self, "tp_plan", {p: Style(s) for p, s in self.tp_plan.items()})
        object.__setattr__(self, "head_plan", {p: Style(s) for p, s in self.head_plan.items()})
        for pattern, value in self.attr_patches.items():
            if value not in LAYOUT_VALUES:
                raise ValueError(f"policy {self.model_type}: patch {pattern!r} has unknown value {value!r}; known: {LAYOUT_VALUES}")
        for name, standin in {**self.pp_first, **self.pp_last}.items():
            if standin not in STANDINS:
                raise ValueError(f"policy {self.model_type}: stage stand-in {standin!r} for {name!r} is unknown; known: {STANDINS}")
        # frozen: the stand-ins become members once, here (a policy may spell them as strings)
        object.__setattr__(self, "pp_first", {n: StandIn(k) for n, k in self.pp_first.items()})
        object.__setattr__(self, "pp_last", {n: StandIn(k) for n, k in self.pp_last.items()})
        if self.pp_every_stage and not self.pp_receive_at_blocks:
            raise ValueError(f"policy {self.model_type}: pp_every_stage needs pp_receive_at_blocks (each stage computes "
                             f"what comes before the blocks, then its first block takes the received activation)")
        if self.pp_every_stage and self.pp_entry not in self.pp_every_stage:
            raise ValueError(f"policy {self.model_type}: pp_every_stage {list(self.pp_every_stage)} must hold the entry "
                             f"{self.pp_entry!r}: what runs before the blocks reads its output on every stage")
        if self.pp_loop_count is not None and self.layers not in self.pp_every_stage:
            raise ValueError(f"policy {self.model_type}: pp_loop_count needs the looped module {self.layers!r} among "
                             f"pp_every_stage {list(self.pp_every_stage)}: every stage calls it")
        if not set(self.pp_per_block_outputs) <= set(self.pp_every_stage):
            raise ValueError(f"policy {self.model_type}: pp_per_block_outputs {list(self.pp_per_block_outputs)} must be "
                             f"among pp_every_stage {list(self.pp_every_stage)}")
        if self.loss is not None and self.loss not in LossKind.values():
            raise ValueError(f"policy {self.model_type}: unknown loss {self.loss!r}; known: {LossKind.values()}")
        if self.loss is not None:
            object.__setattr__(self, "loss", LossKind(self.loss))  # frozen: set once, here
