"""How the keys of a DCP checkpoint name a model's tensors and its optimizer's state.

Torch's recipe saves ``{"model": msd, "optim": osd}`` (keys ``model.<fqn>``, ``optim.state.<fqn>.<key>``,
``optim.param_groups.<i>.<hyperparameter>``); accelerate saves the model and the optimizer in two
directories (``optimizer.`` instead of ``optim.``); ``flatten_optimizer_state_dict=True`` (torchtitan)
gives ``optim.param_groups.<fqn>.<hyperparameter>`` per parameter; torchtitan keeps the model's keys at
the top level. A model saved with ``model.state_dict()`` rather than ``get_state_dict`` carries the
wrappers' segments (``_orig_mod``, ``_checkpoint_wrapped_module``, DDP's leading ``module``), which
``get_state_dict`` strips and so are stripped here too. A ``KeyMap`` renames what is left (another
framework's names, e.g. torchtitan's Llama) and may reorder rows of what it renames.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from ..format import CheckpointError

MODEL_PREFIX = "model."
OPTIMIZER_PREFIXES = ("optim.", "optimizer.")  # torch's recipe; accelerate's
STATE, GROUPS = "state.", "param_groups."
WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


class Part(enum.Enum):
    MODEL = "model"
    STATE = "optimizer state"
    GROUP = "parameter group"
    OTHER = "other"  # a dataloader's, a scheduler's, a training loop's entries: not qn_hf's to read


@dataclass(frozen=True)
class Key:
    part: Part
    fqn: str  # the parameter (MODEL, STATE, flat GROUP), or the group's number (nested GROUP)
    field: str = ""  # the state key (``exp_avg``) or the hyperparameter (``lr``)


@dataclass(frozen=True)
class RowOrder:
    """Rows of a tensor stored in another order within blocks of ``block`` rows along dim 0:
    saved row ``order[j]`` of each block is the model's row ``j``. Whole blocks map to whole blocks,
    so any box of whole blocks reads from the same blocks on disk."""

    block: int
    order: tuple[int, ...]


@dataclass(frozen=True)
class KeyMap:
    """Another framework's names for a model's tensors: ``rename(fqn)`` gives the Hugging Face name
    (None: not a tensor of the model, left unread); ``rows(hf_name)`` how its rows are stored, if not in
    the model's order. Applied to optimizer state too (state shaped like its parameter is stored in the
    parameter's row order)."""

    rename: Callable[[str], str | None]
    rows: Callable[[str], RowOrder | None] = lambda name: None


def as_key_map(key_map: KeyMap | Callable[[str], str | None] | None) -> KeyMap | None:
    if key_map is None or isinstance(key_map, KeyMap):
        return key_map
    if callable(key_map):
        return KeyMap(rename=key_map)
    raise TypeError(f"key_map must be a qn_hf KeyMap or a function from a saved name to a model name (or None), "
                    f"not {type(key_map).__name__}")


def canonical(fqn: str) -> str:
    """``fqn`` without the segments torch's wrappers add, as ``get_state_dict`` names it."""
    parts = [p for p in fqn.split(".") if p not in WRAPPER_SEGMENTS]
    if parts and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


def classify(keys: list[str]) -> dict[str, Key]:
    """Each flattened key's part. The model's keys are under ``model.`` when any key is, else every
    tensor key outside the optimizer's is the model's (torchtitan)."""
    prefixed = any(k.startswith(MODEL_PREFIX) for k in keys)
    out = {}
    for key in keys:
        opt = next((p for p in OPTIMIZER_PREFIXES if key.startswith(p + STATE) or key.startswith(p + GROUPS)), None)
        if opt is not None:
            rest = key[len(opt):]
            if rest.startswith(STATE):
                fqn, _, field = rest[len(STATE):].rpartition(".")
                out[key] = Key(Part.STATE, fqn, field)
            else:
                owner, _, field = rest[len(GROUPS):].rpartition(".")
                out[key] = Key(Part.GROUP, owner, field)
        elif prefixed:
            out[key] = Key(Part.MODEL, key[len(MODEL_PREFIX):]) if key.startswith(MODEL_PREFIX) else Key(Part.OTHER, key)
        else:
            out[key] = Key(Part.MODEL, key)
    return out


def model_name(fqn: str, key_map: KeyMap | None) -> str | None:
    name = canonical(fqn)
    return key_map.rename(name) if key_map is not None else name


def check_unique(where: str, names: dict[str, str]) -> None:
    """Two saved keys must not become one tensor (``a._orig_mod.w`` and ``a.w``)."""
    seen: dict[str, str] = {}
    for key, name in names.items():
        if name in seen:
            raise CheckpointError(f"{where}: the keys {seen[name]!r} and {key!r} both name the tensor {name!r}")
        seen[name] = key
