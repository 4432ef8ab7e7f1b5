"""Mixed precision: low-precision weights and activations for compute, float32 for everything that
accumulates (gradients, master weights, optimizer state), and loss scaling for float16.

``apply_mixed_precision`` casts the floating-point parameters (not buffers: rotary frequencies and
other buffers keep the precision HF computes them in) and sets each trainable parameter's
``grad_dtype`` to float32, so autograd accumulates every microbatch's low-precision gradient into a
float32 ``.grad``: the dp buckets, the tp/tie sums and ``clip_grad_norm_`` all see float32. The
float32 master weights live in ``qn_hf.optimizer``.

float16's narrow range needs the loss scaled before backward and the gradients unscaled after;
``LossScaler`` does the dynamic scaling torch's ``GradScaler`` does: a step whose gradients hold an
inf or NaN anywhere in the job is skipped and the scale halved; after ``growth_interval`` good steps
the scale doubles. bfloat16 has float32's range and needs no scaling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

GRAD_DTYPE = torch.float32


def apply_mixed_precision(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast ``model``'s floating-point parameters to ``dtype`` in place; float32 gradients."""
    for p in model.parameters():
        if p.is_floating_point():
            p.data = p.data.to(dtype)
            if p.requires_grad:
                p.grad_dtype = GRAD_DTYPE


@dataclass
class LossScaler:
    """Dynamic loss scale for float16 (the defaults of torch's ``GradScaler``)."""

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    good_steps: int = 0
    skipped_steps: int = 0
    # whether the last synchronized step's gradients overflowed: a device flag until first read
    _overflow: torch.Tensor | bool = field(default=False, init=False, repr=False)

    def unscale_(self, grads: list[torch.Tensor], *, device: torch.device) -> None:
        """Divide ``grads`` by the scale and record whether any rank's gradients hold inf/NaN
        (one all-reduce over the whole job, so every rank skips or steps together). As GradScaler:
        one fused check-and-unscale per dtype, the flag left on the device."""
        found = torch.zeros(1, dtype=torch.float32, device=device)
        inverse = torch.full((1,), 1.0 / self.scale, dtype=torch.float32, device=device)  # a fill, no copy
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for tensors in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, inverse)
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
        self._overflow = found

    @property
    def found_inf(self) -> bool:
        """Whether the gradients of the last synchronized step overflowed on any rank. Reading it is
        the one host sync of a float16 step (GradScaler's ``step`` has the same): the optimizer reads
        it in ``step``, after the clip's work is queued, rather than at the end of backward."""
        if isinstance(self._overflow, torch.Tensor):
            self._overflow = bool(self._overflow.item())
        return self._overflow

    def update(self) -> bool:
        """After an optimizer step: whether the step was skipped; adjust the scale."""
        skipped = self.found_inf
        if skipped:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped_steps += 1
        else:
            self.good_steps += 1
            if self.good_steps == self.growth_interval:
                self.scale *= self.growth_factor
                self.good_steps = 0
        self._overflow = False
        return skipped

    def state(self) -> dict[str, float | int]:
        """What a resumed run needs to scale and skip as this one would have (GradScaler's ``state_dict``
        and the count of skipped steps): the same on every rank, so it survives any change of mesh."""
        return {"scale": self.scale, "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "good_steps": self.good_steps,
                "skipped_steps": self.skipped_steps}

    def load_state(self, state: dict) -> None:
        problem = scaler_state_problem(state)
        if problem is not None:
            raise ValueError(f"not a loss scaler's state: {problem}")
        self.scale, self.growth_factor, self.backoff_factor = (float(state[k]) for k in _FACTORS)
        self.growth_interval, self.good_steps, self.skipped_steps = (int(state[k]) for k in _COUNTS)
        self._overflow = False


_FACTORS = ("scale", "growth_factor", "backoff_factor")
_COUNTS = ("growth_interval", "good_steps", "skipped_steps")


def scaler_state_problem(state: object) -> str | None:
    """Why ``state`` is not what ``LossScaler.state`` writes, or None: its fields, a finite positive
    scale, a growth factor above 1, a backoff factor in (0, 1), non-negative counts (a positive interval)."""
    if not isinstance(state, dict) or set(state) != {*_FACTORS, *_COUNTS}:
        return f"the fields must be {sorted({*_FACTORS, *_COUNTS})}, not {str(state)[:200]}"
    number = {k: isinstance(state[k], (int, float)) and not isinstance(state[k], bool) for k in state}
    if not all(number[k] and math.isfinite(state[k]) for k in _FACTORS) or not all(
            number[k] and isinstance(state[k], int) for k in _COUNTS):
        return f"{_FACTORS} must be finite numbers and {_COUNTS} integers: {state}"
    if not (state["scale"] > 0 and state["growth_factor"] > 1 and 0 < state["backoff_factor"] < 1
            and state["growth_interval"] > 0 and state["good_steps"] >= 0 and state["skipped_steps"] >= 0):
        return (f"scale {state['scale']} must be positive, growth_factor {state['growth_factor']} above 1, "
                f"backoff_factor {state['backoff_factor']} in (0, 1), growth_interval {state['growth_interval']} "
                f"positive and the step counts non-negative")
    return None
