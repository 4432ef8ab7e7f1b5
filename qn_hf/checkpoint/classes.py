"""Which transformers class a saved model is: the one its config names, else the one class of its model type
whose tensors are exactly the source's (a converter must build the class that reads every tensor)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .format import CheckpointError
from .hf import base_prefixes, config_from_dict, source_name
from .layout import candidate_classes, meta_model, named_class


def _fit(model: torch.nn.Module, names: set[str], prefixes: list[str]) -> tuple[int, list[str], list[str]]:
    """How a class fits a source's tensor names: (names it finds verbatim, its tensors the source
    lacks, source tensors it would leave unread)."""
    verbatim, missing, used = 0, [], set()
    own = {n for n, _ in model.named_parameters()}
    for name, _ in model.named_parameters(remove_duplicate=False):  # a tied alias the source holds is used too
        try:
            source = source_name({"tensors": names}, name, prefixes)
        except CheckpointError:
            if name in own:
                missing.append(name)
            continue
        used.add(source)
        verbatim += source == name
    return verbatim, missing, sorted(names - used)


def model_class(config: dict, names_for: Callable[[torch.nn.Module], set[str]], *, where: str) -> type:
    """The class the config names, else the one class of its model type whose tensors are exactly
    the source's (``names_for(model)``: the source's tensor names as that model reads them); of
    several, the one that finds the most under their own names (a tied head adds no tensor)."""
    built = config_from_dict(config)
    named = named_class(built)
    if named is not None:
        return named
    fits, near = [], []
    for cls in candidate_classes(built):
        try:
            model = meta_model(built, cls=cls)
        except Exception:  # an auto mapping may list a class of another family this config cannot build
            continue
        verbatim, missing, extra = _fit(model, names_for(model), [model.base_model_prefix, *base_prefixes(config)])
        fit = (verbatim, -len(missing) - len(extra), cls, missing, extra)
        (fits if not missing and not extra else near).append(fit)
    fits.sort(key=lambda f: -f[0])
    if fits and (len(fits) == 1 or fits[0][0] > fits[1][0]):
        return fits[0][2]
    hint = f'add "architectures": ["<class>"] to its config (one of {[c.__name__ for c in candidate_classes(built)]})'
    if fits:
        raise CheckpointError(f"{where}: its config records no model class and several fit its tensors "
                              f"({', '.join(f[2].__name__ for f in fits)}); {hint}")
    best = max(near, key=lambda f: f[1], default=None)
    detail = (f"; the closest, {best[2].__name__}, would lack {best[3][:3]} and leave out {best[4][:3]}"
              if best else "")
    raise CheckpointError(f"{where}: its config records no model class and no {config['model_type']!r} class has "
                          f"exactly its tensors{detail}; {hint}")
