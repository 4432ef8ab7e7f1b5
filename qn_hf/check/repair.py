"""Repairing a shrunk config its own validation refuses (``shrink.shrink_config``): from what the config holds,
never from its error's words, and only where it refuses, so that no config that builds changes."""

from __future__ import annotations

import math
import re

from transformers import PretrainedConfig

from .sizes import HEAD_DIM, HIDDEN, LAYER_COUNTS, LAYERS, STAGE_DEPTH, is_size

# Stored counts of blocks beside a num_hidden_layers the config computes from them (a read-only property):
# Funnel's blocks per stage, ProphetNet's encoder and decoder
_STORED_COUNTS = ("num_encoder_layers", "num_decoder_layers")
# the sections a config splits its blocks into, summing to its layer count (Dory: blocks run once, then a
# recurrent section run n_recurrent_loops times, then blocks run once)
_SECTIONS = ("n_input_layers", "n_recurrent_layers", "n_output_layers")
# a layer kind that is the second half of the layer before it in a released layout (Dory's to_dict: each layer an
# attention entry and an "mlp" entry, counted twice), which the config halves when it finds one
_HALF_LAYER_KINDS = ("mlp",)
# a size key naming a width another part must match (an adapter's input, a tower's output for the text
# model, a flow head's condition): shrunk with the hidden size it equals
_WIDTH_KEY = re.compile(r"hidden|_dim$|_(input|output)_size$")
# an override the repair may take back where the config refuses the shrunk value: the original, where it
# is no larger than this (ZAYA routes each token to one expert)
_REVERTIBLE_UP_TO = 64


def _hidden_sizes(config: PretrainedConfig) -> set[int]:
    """The hidden sizes of ``config`` and of its sub-configs, as the defaults give them."""
    configs = [config] + [v for v in vars(config).values() if isinstance(v, PretrainedConfig)]
    return {size for c in configs for key in ("hidden_size", "d_model") if is_size(size := getattr(c, key, None))}


def repaired(merged: dict, *, data: dict, new: dict, config: PretrainedConfig) -> dict:
    """``merged`` where the config refuses it: sizes its validation ties together that the shrink set apart,
    or a count it computes itself. Only for configs the plain shrink cannot build, so that no config that
    builds changes. Each rule is data the config holds, not its error's words:

    * a width equal to a hidden size of this config or a sub-config (``_hidden_sizes``) is the shrunk
      hidden size, in this config and its sub-configs (Dots 3's adapter_in_dim, a tower's out_hidden_size,
      a flow head's condition_dim, a head's audio_hidden_size);
    * a token id beyond the shrunk vocabulary is its last (a CTC head's blank);
    * XLNet's and Funnel's per-head width: the shrunk head width; Mamba 2's heads x head width = expand x
      hidden;
    * a config whose blocks are sections summing to its count (Dory's input, recurrent, output): one block each
      before and after, the rest recurrent, in the layout of a layer an entry;
    * a count the config computes (a property: Funnel's num_hidden_layers and num_blocks) is not set: the
      stored counts are (Funnel's
      blocks per stage as a staged tower's, ProphetNet's encoder and decoder layers);
    * last, an override the config still refuses is taken back one at a time, where the original is small."""
    out = dict(merged)
    hidden = _hidden_sizes(config)

    def tie(values: dict) -> dict:
        return {k: HIDDEN if isinstance(k, str) and _WIDTH_KEY.search(k) and is_size(v) and v in hidden
                and v != HIDDEN else v for k, v in values.items()}

    out = tie(out)
    for key, value in out.items():
        if isinstance(value, dict) and isinstance(getattr(config, key, None), PretrainedConfig):
            out[key] = tie(value)
    if is_size(out.get("vocab_size")):  # a token the vocabulary must hold (a CTC head's blank): its last
        out.update({k: out["vocab_size"] - 1 for k, v in out.items()
                    if k.endswith("_token_id") and is_size(v) and v >= out["vocab_size"]})
    if is_size(data.get("d_head")):
        out["d_head"] = HEAD_DIM
    if is_size(data.get("expand")) and is_size(data.get("head_dim")) and is_size(data.get("num_heads")):
        out["head_dim"] = data["expand"] * HIDDEN // out["num_heads"]
    if is_size(data.get("index_kpool")) and is_size(out.get("index_topk")):
        out["index_kpool"] = math.gcd(out["index_topk"], data["index_kpool"])  # GLM-5 Next pools the top-k in groups
    layers = data.get("num_hidden_layers")
    for key, value in data.items():
        # a per-layer list of earlier layers' positions (Mistral Large 4's kv_source_layers): the first layers' own,
        # not a pattern of kinds completed with positions past the shrunk count
        if (isinstance(value, list) and len(value) == layers and isinstance(out.get(key), list)
                and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= i for i, v in enumerate(value))):
            out[key] = value[: len(out[key])]
    if is_size(data.get("mamba_d_ssm")) and is_size(out.get("mamba_n_heads")) and is_size(out.get("mamba_d_head")):
        out["mamba_d_ssm"] = out["mamba_n_heads"] * out["mamba_d_head"]  # Falcon-H1: the SSM's width is its heads'
    if all(is_size(data.get(key)) for key in _SECTIONS) and is_size(out.get("num_hidden_layers")):
        # one block before and one after the recurrent section, the rest in it, counted a layer an entry (the
        # released layout's halves dropped: the shrunk count is of layers, at least 3)
        count = max(3, out["num_hidden_layers"])
        kinds = [k for k in data.get("layer_types") or [] if k not in _HALF_LAYER_KINDS]
        out.update(num_hidden_layers=count, n_input_layers=1, n_recurrent_layers=count - 2, n_output_layers=1)
        if len(kinds) >= count:
            out["layer_types"] = kinds[:count]
    computed = [key for key in LAYER_COUNTS if key not in data and isinstance(getattr(type(config), key, None), property)]
    if computed:
        for key in computed:
            out.pop(key, None)
        out.update({key: LAYERS for key in _STORED_COUNTS if is_size(data.get(key))})
        if isinstance(data.get("block_sizes"), list):
            out["block_sizes"] = [min(d, STAGE_DEPTH) for d in data["block_sizes"]]
    try:
        type(config)(**out)
        return out
    except Exception:  # noqa: BLE001 - which override it refuses, the config does not say as data
        pass
    for key in new:
        original = data.get(key)
        if key in out and out[key] != original and not (is_size(original) and original > _REVERTIBLE_UP_TO):
            trial = {**out, key: original}
            try:
                type(config)(**trial)
                return trial
            except Exception:  # noqa: BLE001
                continue
    return out


# sizes no shrink rule names, which a model's own code ties to its hidden size (SqueezeBERT's embedding must be
# as wide; MobileBERT's head is hidden - embedding wide): not the vocabulary's, the positions', nor a count
_UNNAMED_WIDTH = re.compile(r"_size$|_groups$")  # Mimi's upsample_groups: one per hidden channel
_NOT_WIDTHS = re.compile(r"vocab|position|type_vocab|chunk|batch|window|kernel|patch|image|num_")


def widths_scaled(config: PretrainedConfig, shrunk: PretrainedConfig) -> PretrainedConfig | None:
    """``shrunk`` for a model whose own code, not its config's validation, refuses the shrunk sizes
    (``shrink_config``'s ``builds``): each width the shrink left alone scaled as the hidden size was (a ``*_size``
    or ``*_groups`` no rule names, between a sixteenth of the original hidden size and all of it), and a token id
    its embedding must hold (Kyutai's audio padding) beyond the shrunk vocabulary its last. None where nothing
    changes."""
    hidden, small = getattr(config, "hidden_size", None), getattr(shrunk, "hidden_size", None)
    data = shrunk.to_dict()
    scaled = {}
    if is_size(hidden) and is_size(small) and small < hidden:
        scaled = {key: max(8, value * small // hidden) for key, value in config.to_dict().items()
                  if _UNNAMED_WIDTH.search(key) and not _NOT_WIDTHS.search(key) and key != "hidden_size"
                  and is_size(value) and hidden // 16 <= value <= hidden and data.get(key) == value}
    if is_size(data.get("vocab_size")):
        scaled.update({k: data["vocab_size"] - 1 for k, v in data.items()
                       if k.endswith("_token_id") and is_size(v) and v >= data["vocab_size"]})
    if not scaled:
        return None
    for key in ("model_type", "transformers_version"):
        data.pop(key, None)
    return type(shrunk)(**{**data, **scaled})
