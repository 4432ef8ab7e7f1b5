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
"""

from __future__ import annotations

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


def stream_seeds(*, base_seed: int, dp_rank: int, tp_rank: int, pp_rank: int) -> dict[str, int]:
    """Shared: one per (dp, pp) replica, equal across tp. tp-local: distinct for every rank."""
    # Large odd multipliers keep the seeds of different coordinates from colliding.
    shared = base_seed + 1_000_003 * dp_rank + 7_919 * pp_rank
    return {SHARED: shared, TP_LOCAL: shared + 2_147_483_647 + 104_729 * tp_rank}
