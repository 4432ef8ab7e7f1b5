"""The task head: what a task model adds after its base model (an LM head, a classifier, a pooler, a
span head) and the loss its own forward computes, found from the model, never named by a policy.

Which loss a class computes is read from transformers' own taxonomy: the auto mappings
(``MODEL_FOR_MASKED_LM_MAPPING_NAMES``, ...) that list the class, else the ``loss_type`` transformers
gives it from its name. Each family's loss is one ``LossKind`` that ``step/loss.py`` computes as
sums over microbatches, equal to the family's own function (``transformers/loss/loss_utils.py``, or
the same formula written inline by older models). A class whose forward computes anything else,
or a family qn_hf does not split, trains on its own ``outputs.loss`` (``LossKind.OWN``): exact when
one forward sees the whole batch, refused by ``train_step`` otherwise.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import textwrap
from dataclasses import dataclass

from torch import nn

from ..config.options import LossKind
from .entries import forward_source
from .patterns import base_model_and_prefix

# transformers' auto mappings, in the order a class found in several is decided by, and the family
# of loss their classes compute: (mapping, kind, whether a classifier may follow HF's problem_type).
# A per-position family's kind (shifted or not) is then read from the class's forward (``_shifted``).
FAMILIES: tuple[tuple[str, LossKind, bool], ...] = (
    ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", LossKind.CAUSAL_LM, False),
    ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", LossKind.TOKENS, False),
    ("MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", LossKind.TOKENS, False),
    ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", LossKind.TOKENS, False),
    ("MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", LossKind.TOKENS, False),
    ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", LossKind.CAUSAL_LM, False),
    ("MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES", LossKind.CAUSAL_LM, False),
    ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", LossKind.CLASSIFICATION, True),
    ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", LossKind.CLASSIFICATION, True),
    ("MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES", LossKind.CLASSIFICATION, True),
    ("MODEL_FOR_VIDEO_CLASSIFICATION_MAPPING_NAMES", LossKind.CLASSIFICATION, True),
    ("MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES", LossKind.CLASSIFICATION, False),
    ("MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES", LossKind.SPANS, False),
)
# transformers' ``loss_type`` (from the class name) of a class no mapping lists, and its family
LOSS_TYPES: dict[str, tuple[LossKind, bool]] = {
    "ForCausalLM": (LossKind.CAUSAL_LM, False),
    "ForConditionalGeneration": (LossKind.CAUSAL_LM, False),
    "ForMaskedLM": (LossKind.TOKENS, False),
    "ForTokenClassification": (LossKind.TOKENS, False),
    "ForSequenceClassification": (LossKind.CLASSIFICATION, True),
    "ForImageClassification": (LossKind.CLASSIFICATION, True),
    "ForAudioClassification": (LossKind.CLASSIFICATION, True),
    "ForVideoClassification": (LossKind.CLASSIFICATION, True),
    "ForQuestionAnswering": (LossKind.SPANS, False),
}
# transformers' loss functions that shift the labels (``loss/loss_utils.py``): a class calling
# ``self.loss_function`` under one of these loss types (None falls back to ForCausalLM) predicts
# the next position; under ForMaskedLM or ForTokenClassification (T5Gemma's override) it does not
SHIFTING_LOSS_TYPES = (None, "ForCausalLM", "ForConditionalGeneration")
# Classes a family lists whose forward computes another loss than the family's, as transformers
# 5.23 writes them (each checked against the plain model by the heads zoo): they train on their
# own ``outputs.loss``. Why, per class:
OWN_LOSS: dict[str, str] = {
    "GitForCausalLM": "scores only the text after the image tokens",
    "CanaryForConditionalGeneration": "shifts its labels itself",
    "CohereAsrForConditionalGeneration": "shifts its labels itself",
    "MoonshineForConditionalGeneration": "shifts its labels itself",
    "MoonshineStreamingForConditionalGeneration": "shifts its labels itself",
    "DiaForConditionalGeneration": "scores every audio channel's logits",
    "VibeVoiceForConditionalGeneration": "adds a diffusion loss",
    "CsmForConditionalGeneration": "adds its depth decoder's loss",
    "ProphetNetForConditionalGeneration": "scores every n-gram stream",
    "ProphetNetForCausalLM": "scores every n-gram stream",
    "XLMProphetNetForConditionalGeneration": "scores every n-gram stream",
    "XLMProphetNetForCausalLM": "scores every n-gram stream",
    "MusicgenForCausalLM": "averages over its codebooks",
    "MusicgenMelodyForCausalLM": "averages over its codebooks",
    "LukeForMaskedLM": "adds an entity prediction loss",
    "LxmertForQuestionAnswering": "classifies answers",
    "BrosForTokenClassification": "scores the first token of each box",
    "Qwen2AudioForConditionalGeneration": "scores only positions its attention mask keeps",
    "GraniteSpeechForConditionalGeneration": "scores only positions its attention mask keeps",
    "GraniteSpeechPlusForConditionalGeneration": "scores only positions its attention mask keeps",
}
# Token classifiers that also ignore the labels of positions their ``attention_mask`` leaves out.
MASKED_TOKEN_LABELS = ("BioGptForTokenClassification", "MraForTokenClassification",
                       "XLMRobertaXLForTokenClassification", "YosoForTokenClassification")
# Sequence classifiers that, without ``config.problem_type``, decide the loss their own way: one
# label is regression, a label per row single-label cross-entropy (negative labels dropped), a row
# of labels soft-label cross-entropy; and never record ``problem_type``.
OWN_PROBLEM_TYPES = ("DebertaForSequenceClassification", "DebertaV2ForSequenceClassification")
# The forward arguments that make a forward compute a loss (a class taking none has no loss).
LOSS_ARGUMENTS = ("labels", "start_positions", "end_positions", "return_loss", "next_sentence_label")
SPAN_KEYS = ("start_positions", "end_positions")  # a span head's labels: one position per example
# The batch keys each kind's loss reads; they never reach the forward (OWN: the forward reads them).
LABEL_KEYS: dict[LossKind, tuple[str, ...]] = {
    LossKind.CAUSAL_LM: ("labels",),
    LossKind.TOKENS: ("labels",),
    LossKind.CLASSIFICATION: ("labels",),
    LossKind.SPANS: SPAN_KEYS,
    LossKind.OWN: (),
}
# Config switches under which a class adds terms of its own (router losses, an adaptive softmax).
OWN_WHEN = {"output_router_logits": ("SwitchTransformersForConditionalGeneration", "NllbMoeForConditionalGeneration"),
            "asm": ("XLMWithLMHeadModel", "FlaubertWithLMHeadModel")}
@dataclass(frozen=True)
class TaskHead:
    """The head of a task model, found by ``task_head``.

    ``kind``: the loss its forward computes (None: a base model, or a head without a loss).
    ``modules``: the task model's children besides the base model (the last pipeline stage's).
    ``vocab_output``: the name of the ``nn.Linear`` that maps to the vocabulary (the LM head; tp
    splits its columns), None for any other head. ``problem_types``: a classifier that follows
    transformers' ``problem_type`` (regression, single- or multi-label), else always single-label
    cross-entropy (multiple choice, most audio classifiers). ``decoder_from_labels``: an
    encoder-decoder LM whose forward makes the decoder's input from the labels
    (``prepare_decoder_input_ids_from_labels``) when none is given; ``decoder_padding_mask``: and masks
    the padding of what it made (EncoderDecoderModel). ``mask_labels``: positions its
    ``attention_mask`` leaves out are not scored. ``own_problem_types``: DeBERTa's rules
    (``OWN_PROBLEM_TYPES``). ``reshapes_inputs``: the task model's forward reshapes the inputs before its
    base model sees them (multiple choice folds the choices into the rows), so no stage but the last
    could call the base model with them. ``why_own``: why a head of a known family trains on its own
    loss."""

    kind: LossKind | None
    modules: tuple[str, ...] = ()
    vocab_output: str | None = None
    problem_types: bool = False
    decoder_from_labels: bool = False
    decoder_padding_mask: bool = False
    mask_labels: bool = False
    own_problem_types: bool = False
    reshapes_inputs: bool = False
    cls: str = ""
    why_own: str = ""

    @property
    def label_keys(self) -> tuple[str, ...]:
        """The batch keys the built-in loss reads (never given to the forward)."""
        return LABEL_KEYS[self.kind] if self.kind is not None else ()


@functools.cache
def _families() -> dict[str, tuple[LossKind, bool]]:
    """Class name -> (kind, problem_types), from transformers' auto mappings."""
    from transformers.models.auto import modeling_auto

    found: dict[str, tuple[LossKind, bool]] = {}
    for mapping, kind, problem_types in FAMILIES:
        for names in getattr(modeling_auto, mapping, {}).values():
            for name in (names,) if isinstance(names, str) else names:
                found.setdefault(name, (kind, problem_types))
    return found


@functools.cache
def _multiple_choice() -> frozenset[str]:
    from transformers.models.auto import modeling_auto

    names = getattr(modeling_auto, "MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES", {}).values()
    return frozenset(n for found in names for n in ((found,) if isinstance(found, str) else found))


def loss_arguments(model: nn.Module) -> tuple[str, ...]:
    """The arguments of ``model.forward`` that make it compute a loss."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return ()
    return tuple(a for a in LOSS_ARGUMENTS if a in params)


def _forward_tree(source: str) -> ast.AST | None:
    """A forward's source parsed once for the readings below (None where it does not parse)."""
    try:
        return ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return None


def _loss_calls(tree: ast.AST | None) -> list[ast.Call]:
    """The ``self.loss_function(...)`` calls in a forward."""
    if tree is None:
        return []
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == "loss_function" and isinstance(n.func.value, ast.Name) and n.func.value.id == "self"]


def _decoder_ids_from_labels(tree: ast.AST | None) -> bool:
    """Whether a forward makes its decoder's inputs from the labels when none are given (BART's
    ``decoder_input_ids = shift_tokens_right(labels, ...)``, T5's ``self._shift_right(labels)``). FSMT's
    makes them from input_ids instead, inside its base model: given the labels' there, it trained another
    model."""
    if tree is None:
        return False
    return any(isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "decoder_input_ids" for t in n.targets)
               and isinstance(n.value, ast.Call)
               and any(isinstance(a, ast.Name) and a.id == "labels" for a in (*n.value.args, *(k.value for k in n.value.keywords)))
               for n in ast.walk(tree))


# the one decoder mask qn_hf makes as a forward does, beside the decoder's input it makes from the labels
_PADDING_MASK = "(decoder_input_ids != self.config.pad_token_id).to(decoder_input_ids.dtype)"


def _decoder_mask(tree: ast.AST | None) -> bool | None:
    """Whether a forward that makes its decoder's input from the labels also masks its padding
    (EncoderDecoderModel: ``_PADDING_MASK``); None where it assigns a decoder mask any other way."""
    if tree is None:
        return None
    masks = [ast.unparse(n.value) for n in ast.walk(tree) if isinstance(n, ast.Assign)
             and any(isinstance(t, ast.Name) and t.id == "decoder_attention_mask" for t in n.targets)]
    if not masks:
        return False
    return True if masks == [_PADDING_MASK] else None


# an inline shift of the logits or the labels, as transformers' forwards write it
_SHIFTS = re.compile(r"\[(\.\.\.|:),:-1(,:)?\]|\[(\.\.\.|:),1:\]")


def _shifted(model: nn.Module, source: str, tree: ast.AST | None) -> bool | None:
    """Whether a per-position head predicts the next position (None: its forward passes targets of its
    own making, ``shift_labels=``, which qn_hf does not reproduce)."""
    calls = _loss_calls(tree)
    if calls:
        if any(k.arg == "shift_labels" for c in calls for k in c.keywords):
            return None
        return getattr(model, "loss_type", None) in SHIFTING_LOSS_TYPES
    return bool(_SHIFTS.search(re.sub(r"\s", "", source)))


def _follows_problem_type(source: str, tree: ast.AST | None) -> bool:
    """A classifier's forward that reads ``problem_type`` itself, or hands it to transformers' loss
    function (which does); a plain cross-entropy written inline does not."""
    return "problem_type" in source or bool(_loss_calls(tree))


def _beside_the_head(model: nn.Module, output: nn.Module, vocab: int) -> str | None:
    """A tensor over the vocabulary that is not the head's nor an embedding's (BART's
    ``final_logits_bias``, added to the logits): the forward would combine it with vocabulary-split
    logits, so the head stays whole. Its name, or None."""
    own = {id(t) for t in output.parameters()}
    own |= {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if id(tensor) not in own and tensor.dim() and tensor.shape[-1] == vocab:
            return name
    return None


def task_head(model: nn.Module) -> TaskHead:
    """The head of ``model`` and the loss its forward computes (module docstring)."""
    base, _ = base_model_and_prefix(model)
    name = type(model).__name__
    modules = () if base is model else tuple(n for n, m in model.named_children() if m is not base)
    if not loss_arguments(model):
        return TaskHead(kind=None, modules=modules, cls=name)
    config = model.config
    family, problem_types = (_families().get(name)
                             or LOSS_TYPES.get(getattr(model, "loss_type", None) or "", (None, False)))
    why = OWN_LOSS.get(name) or next((f"adds terms of its own with config.{key}" for key, classes in OWN_WHEN.items()
                                      if name in classes and getattr(config, key, False)), "")
    if family is None or why:
        return TaskHead(kind=LossKind.OWN, modules=modules, cls=name,
                        why_own=why or "its loss is of no family qn_hf splits")
    source = forward_source(type(model))
    tree = _forward_tree(source)
    kind = family
    if family.per_position:
        shifted = _shifted(model, source, tree)
        if shifted is None:
            return TaskHead(kind=LossKind.OWN, modules=modules, cls=name, why_own="it makes its own targets")
        kind = LossKind.CAUSAL_LM if shifted else LossKind.TOKENS
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None)
    vocab_output = None
    # a linear layer under a wrapper (peft's LoRA keeps it as base_layer) is still the LM head: its rule
    # is the head's, and the wrapper's own rules decide whether its adapters can follow it
    linear = getattr(output, "base_layer", output)
    if kind.per_position and type(linear) is nn.Linear and vocab and linear.out_features == vocab \
            and not _beside_the_head(model, output, vocab):
        vocab_output = next((n for n, m in model.named_modules() if m is output), None)
    decoder = bool(getattr(config, "is_encoder_decoder", False)) and kind is LossKind.TOKENS \
        and _decoder_ids_from_labels(tree)
    if decoder and not hasattr(model, "prepare_decoder_input_ids_from_labels"):
        return TaskHead(kind=LossKind.OWN, modules=modules, cls=name,
                        why_own="it makes its decoder's input from its labels by no method qn_hf can call")
    padding_mask = decoder and _decoder_mask(tree)
    if padding_mask is None:
        return TaskHead(kind=LossKind.OWN, modules=modules, cls=name,
                        why_own="it masks the decoder's input it makes from its labels in a way of its own")
    return TaskHead(kind=kind, modules=modules, vocab_output=vocab_output,
                    problem_types=problem_types and (_follows_problem_type(source, tree) or name in OWN_PROBLEM_TYPES),
                    decoder_from_labels=decoder, decoder_padding_mask=bool(padding_mask),
                    mask_labels=name in MASKED_TOKEN_LABELS,
                    own_problem_types=name in OWN_PROBLEM_TYPES, cls=name,
                    reshapes_inputs=name in _multiple_choice())


def main_input_name(model: nn.Module) -> str:
    """The batch key of the model's main input: ``model.main_input_name``, unless the forward takes no such
    argument and takes ``pixel_values`` (a vision tower that keeps transformers' default ``input_ids``:
    SmolVLM's, Idefics 3's, Granite Docling's), or else ``hidden_states`` (Qwen2.5-VL's tower: its patches)."""
    name = getattr(model, "main_input_name", "input_ids")
    parameters = inspect.signature(model.forward).parameters
    if isinstance(name, (list, tuple)):  # transformers 5.24 names several (OneFormer: pixel_values, task_inputs)
        name = next((n for n in name if n in parameters), name[0])
    if name in parameters:
        return name
    return next((n for n in ("pixel_values", "hidden_states") if n in parameters), name)
