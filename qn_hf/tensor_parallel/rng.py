"""Two random streams per rank, so dropout is right under tensor parallelism.

* the shared stream: the device's default generator, seeded identically on every tp rank of a dp
  replica (and differently across dp). Replicated activations (embeddings, residual dropout) see
  identical masks on every tp rank, so they stay replicated.
* the tp-local stream: seeded per tp rank. Dropout on sharded activations (attention
  probabilities of this rank's heads) draws independent masks, as the unsharded model would for
  different heads.

Regions are entered with forward pre-hooks and left with forward hooks on the modules a policy
names, so no Hugging Face forward is replaced. Regions nest (GPT-2's residual dropout, which is
replicated, lives inside the attention module, which is not).

The hooks go in only where a draw needs them: at tp > 1 on a model that draws random numbers in
training (``draws_in_training``). At tp = 1 there is no replicated activation to keep equal across tp
ranks and no head split to keep apart, and a model without dropout draws nothing: its regions get no
hooks, every draw (if any) comes from the shared stream, and ``torch.compile`` traces each block whole
(swapping the generator's state is a graph break). It is decided once, when ``parallelize`` runs.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

SHARED, TP_LOCAL = "shared", "tp_local"


def device_rng_state(device: torch.device) -> torch.Tensor:
    """The state of ``device``'s default generator (what dropout and sampling draw from)."""
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def set_device_rng_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state.cpu(), device)
    else:
        torch.set_rng_state(state.cpu())


def _state_for_seed(device: torch.device, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen.get_state()


class RngStreams:
    """Swaps the device's default generator between named streams; a stack tracks nesting."""

    def __init__(self, *, device: torch.device, seeds: dict[str, int]) -> None:
        self.device = device
        self._states = {name: _state_for_seed(device, seed) for name, seed in seeds.items()}
        self._stack: list[str] = [SHARED]
        set_device_rng_state(device, self._states[SHARED])

    @property
    def current(self) -> str:
        return self._stack[-1]

    def enter(self, name: str) -> None:
        self._states[self.current] = device_rng_state(self.device)
        set_device_rng_state(self.device, self._states[name])
        self._stack.append(name)

    def exit(self) -> None:
        name = self._stack.pop()
        self._states[name] = device_rng_state(self.device)
        set_device_rng_state(self.device, self._states[self.current])

    def snapshot(self) -> tuple[tuple[str, ...], dict[str, torch.Tensor]]:
        """Which streams are running (the stack) and the saved states of the others. The running
        stream's state is the device's generator, which torch's checkpoint saves and restores itself."""
        return tuple(self._stack), dict(self._states)

    def restore(self, snapshot: tuple[tuple[str, ...], dict[str, torch.Tensor]]) -> None:
        """Put back a ``snapshot``: a recomputation then runs in the streams its block first ran in
        (under sequence parallelism a whole block runs in the tp-local stream, entered by a hook
        outside the recomputed forward) and draws what they drew."""
        stack, states = snapshot
        self._stack, self._states = list(stack), dict(states)

    def hook_module(self, module: nn.Module, name: str) -> list[RemovableHandle]:
        """Run ``module``'s forward inside stream ``name``."""
        return [
            module.register_forward_pre_hook(lambda *_: self.enter(name)),
            module.register_forward_hook(lambda *_: self.exit(), always_call=True),
        ]

    def hook_regions(self, model: nn.Module, *, tp_local: Sequence[str], shared: Sequence[str]) -> None:
        """Run the named submodules of ``model`` in the tp-local and the shared stream (a plan's regions),
        those that may draw only (``region_draws``): a region that draws nothing would draw the same in
        any stream, and its hooks swap the generator's state, which splits a compiled block's graph."""
        for names, stream in ((tp_local, TP_LOCAL), (shared, SHARED)):
            for region in (model.get_submodule(name) for name in names):
                if region_draws(region):
                    self.hook_module(region, stream)


# Module attributes and config keys (by name) holding the probability or scale of a draw in training:
# dropout modules aside, transformers' attention passes ``dropout=self.attention_dropout`` to its kernel,
# some forwards read ``p=self.config.dropout``, and MoE routers add ``router_jitter_noise``.
RANDOM_IN_TRAINING = ("dropout", "pdrop", "jitter")
DROPOUT_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def _named_draw(key: object) -> bool:
    return any(word in str(key).lower() for word in RANDOM_IN_TRAINING)


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _config_draws(config: dict) -> bool:
    """A key of ``config`` (a ``to_dict()``, sub-configs nested) naming a draw, above 0."""
    for key, value in config.items():
        if isinstance(value, dict) and _config_draws(value):
            return True
        if _named_draw(key) and _positive(value):
            return True
    return False


def region_draws(region: nn.Module) -> bool:
    """Whether ``region`` may draw in training: a dropout module with ``p`` > 0 in it, an attribute named
    for a draw above 0 (``attention_dropout``, passed to the attention kernel), or a forward in it that
    reads such a key of its config (``self.config.dropout``) set above 0."""
    for module in region.modules():
        if isinstance(module, DROPOUT_MODULES) and module.p > 0:
            return True
        if any(_named_draw(key) and _positive(value) for key, value in vars(module).items()):
            return True
        config = getattr(module, "config", None)
        if config is not None and any(_positive(_config_value(config, key)) for key in _config_draws_read(type(module))):
            return True
    return False


def _config_value(config: object, key: str) -> object:
    try:
        return getattr(config, key, None)
    except RuntimeError:  # a per-layer value (transformers' per-layer configs): may be above 0 somewhere
        return 1.0


@functools.cache
def _config_draws_read(kind: type) -> tuple[str, ...]:
    """The draw-named config keys ``kind.forward`` reads (``config.<key>`` in its source)."""
    try:
        source = inspect.getsource(kind.forward)
    except (OSError, TypeError):  # no source (a compiled or built-in forward): assume it reads them all
        return RANDOM_IN_TRAINING
    return tuple(key for key in set(re.findall(r"config\.(\w+)", source)) if _named_draw(key))


def draws_in_training(model: nn.Module) -> bool:
    """Whether ``model`` may draw random numbers in training: a dropout module with ``p`` > 0, or an
    attribute of a module or a key of its config named for a draw (``RANDOM_IN_TRAINING``) above 0.
    Conservative: a key the forward never reads (a head this model lacks) counts too."""
    if region_draws(model):
        return True
    config = getattr(model, "config", None)
    return config is not None and hasattr(config, "to_dict") and _config_draws(config.to_dict())


def stream_seeds(*, base_seed: int, dp_rank: int, tp_rank: int, pp_rank: int) -> dict[str, int]:
    """Shared: one per (dp, pp) replica, equal across tp. tp-local: distinct for every rank."""
    # Large odd multipliers keep the seeds of different coordinates from colliding.
    shared = base_seed + 1_000_003 * dp_rank + 7_919 * pp_rank
    return {SHARED: shared, TP_LOCAL: shared + 2_147_483_647 + 104_729 * tp_rank}
