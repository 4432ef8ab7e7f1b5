"""``qn_hf.optimizer``: a torch optimizer over this rank's shard that holds the float32 master
weights under mixed precision and, with ``zero=True`` (ZeRO-1), only this dp rank's 1/dp of them.

Which tensors the wrapped optimizer steps (its ``param_groups`` hold these "masters"):

* plain: the model's parameters themselves; the optimizer is the one a user would build.
* mixed precision: a float32 copy of each parameter; its gradient is the parameter's float32
  ``.grad`` (see precision.py); after the step the copy is cast back into the parameter.
* ZeRO-1: for every parameter held by several ranks, the part of it in this rank's pieces of its
  buckets, as a flat 1-D tensor (a float32 copy under mixed precision, else a view of the flat
  weight buffer itself); its gradient is the reduce-scattered piece. After the step the pieces are
  written into the weight buffers and all-gathered (see buckets.py). The dp x cp buckets are split
  over dp x cp; the ep-sharded experts' buckets over the ranks holding the same expert block (the
  expert replicas), so each block's state is split among its holders. A parameter no other rank
  holds (experts when ep = dp x tp) keeps a whole master. Stepping a flat slice is exact only for an
  optimizer that treats every element on its own, so only those classes are accepted.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..placement import ShardPlacement
from .buckets import Piece
from .grad_norm import PiecesStandIn
from .grad_sync import GradSync
from .precision import LossScaler

# torch optimizers whose update of an element reads only that element's gradient and state (and
# scalars): a flat slice of a parameter steps exactly as the whole parameter would. Adafactor
# (factored moments of matrices), Muon (orthogonalised matrices), LBFGS (whole-vector line search)
# and SparseAdam are not among them.
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.Adagrad,
               torch.optim.Adadelta, torch.optim.RMSprop, torch.optim.NAdam, torch.optim.RAdam, torch.optim.ASGD,
               torch.optim.Rprop)


@dataclass(frozen=True)
class Master:
    """One tensor the wrapped optimizer steps: all of parameter ``name`` (``piece`` None) or the
    flat range ``[piece.start, piece.stop)`` of it."""

    name: str
    param: nn.Parameter
    tensor: torch.Tensor
    piece: Piece | None

    @property
    def start(self) -> int:
        return 0 if self.piece is None else self.piece.start

    def grad(self) -> torch.Tensor | None:
        return self.param.grad if self.piece is None else self.piece.grad


@dataclass(frozen=True)
class OptimizerView:
    """What a checkpoint reads of an optimizer, and its only way into one: qn_hf's optimizer gives it
    (``ParallelOptimizer.checkpoint_view``), any other torch optimizer is read as stepping the model's
    parameters themselves (``of_torch``).

    The state is keyed by what ``inner`` steps: a master per model parameter here (the parameter
    itself where no copy is kept), or for a torch optimizer the parameter itself."""

    inner: torch.optim.Optimizer  # the torch optimizer that steps: its class, param_groups and state
    model_param_groups: tuple[tuple[nn.Parameter, ...], ...]  # the model parameters of each of its groups
    masters: Mapping[int, Master] | None  # by id of the model parameter; None: a torch optimizer, no masters
    mixed: bool  # the masters are float32 copies of low-precision weights (saved and loaded in their place)
    split_params: frozenset[int]  # ZeRO-1: ids of the parameters whose masters and state are pieces over ranks

    @classmethod
    def of_torch(cls, optimizer: torch.optim.Optimizer) -> OptimizerView:
        """A torch optimizer built on the model's parameters: its groups hold them, its state is theirs."""
        return cls(inner=optimizer, model_param_groups=tuple(tuple(g["params"]) for g in optimizer.param_groups),
                   masters=None, mixed=False, split_params=frozenset())

    def master(self, param: torch.Tensor) -> Master | None:
        """The master of ``param`` on this rank (None: a torch optimizer, a parameter not stepped, or
        under ZeRO-1 none of its pieces here)."""
        return self.masters.get(id(param)) if self.masters is not None else None

    def state_key(self, param: torch.Tensor) -> torch.Tensor | None:
        """What ``inner.state`` keys ``param``'s state by; None where this rank steps no part of it."""
        if self.masters is None:
            return param
        m = self.masters.get(id(param))
        return m.tensor if m is not None else None

    def split(self, param: torch.Tensor) -> bool:
        """Whether ZeRO-1 keeps ``param``'s master and state in pieces over the ranks holding it."""
        return id(param) in self.split_params


def check_optimizer_class(optimizer_class: type, *, zero: bool) -> None:
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise ValueError(f"optimizer_class={optimizer_class!r} is not a torch.optim.Optimizer subclass")
    if zero and optimizer_class not in ELEMENTWISE:
        raise ValueError(
            f"zero=True shards every parameter into flat slices, which is exact only for optimizers that update each "
            f"element on its own ({', '.join(c.__name__ for c in ELEMENTWISE)}); {optimizer_class.__name__} is not "
            f"one of them: use zero=False")


@dataclass(frozen=True)
class Trainee:
    """What an optimizer reads of the parallel model it steps (``ParallelModel.trainee``)."""

    module: nn.Module
    grads: GradSync
    placement: ShardPlacement
    precision: torch.dtype | None  # the compute dtype under mixed precision: masters are kept in float32
    scaler: LossScaler | None  # float16's loss scale, updated by each step
    fsdp_masters: bool  # dp_shard: FSDP keeps the sharded parameters in float32 itself (they are the masters)
    check_zero: Callable[[], None]  # the composition table's verdict on ZeRO-1 with this model's features


class ParallelOptimizer(torch.optim.Optimizer):
    """``optimizer_class`` over this rank's masters (see the module docstring); ``param_groups`` and
    ``state`` are the wrapped optimizer's, so LR schedulers and ``opt.state`` work as usual."""

    def __init__(self, trainee: Trainee, optimizer_class: type, *, zero: bool, param_groups: Iterable[dict] | None,
                 skip_nonfinite: bool = False, **kwargs) -> None:
        check_optimizer_class(optimizer_class, zero=zero)
        names = {id(p): n for n, p in trainee.module.named_parameters()}
        groups = _groups(trainee.module, param_groups, names)
        grads = trainee.grads
        if zero:
            trainee.check_zero()  # the table's refusal, or its warning for untested pairs
        if zero and not grads.bucket_sets:
            warnings.warn("zero=True with dp=1 shards nothing (with cp=1 no other rank holds the same weights, and "
                          "no two ranks hold the same experts): the optimizer keeps all of its state", stacklevel=3)
            zero = False
        self.trainee, self.zero = trainee, zero
        self.mixed = trainee.precision is not None and not trainee.fsdp_masters
        self.skip_nonfinite = skip_nonfinite
        self._skipped_nonfinite = 0
        if zero:
            named = dict(trainee.module.named_parameters())
            placement = trainee.placement
            grads.shard(separate=[[named[n] for n in placement.tied_names(named)],
                                  [named[n] for n in placement.every_stage_names(named)]])
            pieces = {id(piece.param): piece for piece in grads.pieces()}
        # ids of the parameters whose optimizer data lives in pieces (checkpoints write those per rank)
        self.split_params = grads.split_params() if zero else frozenset()
        self.masters: list[Master] = []
        self.model_param_groups = [list(g["params"]) for g in groups]  # checkpoints name groups by these
        inner_groups = []
        for group in groups:
            tensors = []
            for p in group["params"]:
                piece = pieces.get(id(p)) if zero else None
                if piece is None and id(p) in self.split_params:
                    continue  # no part of this parameter is in this rank's pieces
                if piece is not None:
                    tensor = piece.weight.detach().float().clone() if self.mixed else piece.weight
                else:
                    tensor = p.detach().float().clone() if self.mixed else p
                master = Master(name=names[id(p)], param=p, tensor=_leaf(tensor, p), piece=piece)
                self.masters.append(master)
                tensors.append(master.tensor)
            inner_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": tensors})
        self.inner = optimizer_class(inner_groups, **kwargs)
        super().__init__([{"params": list(g["params"])} for g in self.inner.param_groups], self.inner.defaults)
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state

    def checkpoint_view(self) -> OptimizerView:
        """What a checkpoint reads of this optimizer (``OptimizerView``)."""
        return OptimizerView(inner=self.inner, model_param_groups=tuple(tuple(g) for g in self.model_param_groups),
                             masters={id(m.param): m for m in self.masters}, mixed=self.mixed,
                             split_params=self.split_params)

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because some rank's gradients held inf or NaN: float16's overflows, and with
        ``skip_nonfinite`` any precision's."""
        return (self.trainee.scaler.skipped_steps if self.trainee.scaler is not None else 0) + self._skipped_nonfinite

    def _nonfinite(self) -> bool:
        """Whether any rank's gradients of this step hold inf or NaN: one fused check per dtype, one
        all-reduce over the job and one host read (the price of ``skip_nonfinite``, as of fp16's check)."""
        device = self.trainee.placement.device
        found = torch.zeros(1, dtype=torch.float32, device=device)
        unit = torch.ones(1, dtype=torch.float32, device=device)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for m in self.masters:
            grad = m.grad()
            if grad is not None:
                by_dtype.setdefault(grad.dtype, []).append(grad)
        for grads in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, unit)  # x 1: checks only
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
        return bool(found.item())

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scaler = self.trainee.scaler
        if scaler is not None and scaler.found_inf:
            scaler.update()  # skip: some rank's float16 gradients overflowed; the scale shrinks
            return loss
        if self.skip_nonfinite and scaler is None and self._nonfinite():
            self._skipped_nonfinite += 1  # the weights and the optimizer state stay as they were
            return loss
        if self.mixed or self.zero:
            for m in self.masters:
                m.tensor.grad = m.grad()
        self.inner.step()
        self._copy_masters_to_params()
        if self.zero:
            self.trainee.grads.gather_weights()
        if scaler is not None:
            scaler.update()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.trainee.module.parameters():
            if p.grad is not None:
                if set_to_none or isinstance(p.grad, PiecesStandIn):  # ZeRO-1's pieces are zeroed below
                    p.grad = None
                else:
                    p.grad.zero_()
        if self.mixed or self.zero:
            for m in self.masters:
                m.tensor.grad = None
        if self.zero:
            self.trainee.grads.zero_reduced()

    def state_dict(self) -> dict:
        """The wrapped optimizer's state dict, plus the masters under mixed precision. It loads back
        at the same mesh only; ``pm.save_checkpoint(path, optimizer=opt)`` moves across meshes."""
        saved = self.inner.state_dict()
        saved["qn_hf"] = {"masters": [m.tensor.detach().clone() for m in self.masters] if self.mixed else None,
                          "layout": [(m.name, m.start, m.tensor.numel()) for m in self.masters]}
        return saved

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        extra = state_dict.pop("qn_hf", None)
        layout = [(m.name, m.start, m.tensor.numel()) for m in self.masters]
        if extra is None or [tuple(x) for x in extra["layout"]] != layout:
            raise ValueError("this optimizer state dict was saved at another mesh or with other zero/mixed_precision "
                             "settings; use pm.save_checkpoint/load_checkpoint(optimizer=) to move between meshes")
        self.inner.load_state_dict(state_dict)
        self.state = self.inner.state
        if self.mixed and extra["masters"] is not None:
            with torch.no_grad():
                for m, value in zip(self.masters, extra["masters"]):
                    m.tensor.copy_(value)
                self.write_params()

    def _copy_masters_to_params(self) -> None:
        """Mixed precision: cast every master into its low-precision weight, one fused copy (a
        kernel per weight on a device otherwise)."""
        if self.mixed and self.masters:
            torch._foreach_copy_([m.param.data.view(-1) if m.piece is None else m.piece.weight for m in self.masters],
                                 [m.tensor.view(-1) for m in self.masters])

    @torch.no_grad()
    def write_params(self) -> None:
        """Make the model's parameters what the masters say (after loading masters)."""
        self._copy_masters_to_params()
        if self.zero:
            self.trainee.grads.gather_weights()
            self.trainee.grads.wait_weights()


def _leaf(tensor: torch.Tensor, p: nn.Parameter) -> torch.Tensor:
    """A tensor the optimizer may step: the parameter itself, or a new leaf aliasing ``tensor``."""
    return tensor if tensor is p else nn.Parameter(tensor, requires_grad=p.requires_grad)


def _groups(module: nn.Module, param_groups: Iterable[dict] | None, names: dict[int, str]) -> list[dict]:
    """The parameter groups over ``module``'s trainable parameters (all in one group by default)."""
    trainable = [p for p in module.parameters() if p.requires_grad]
    if param_groups is None:
        return [{"params": trainable}]
    groups, seen = [], set()
    allowed = {id(p) for p in trainable}
    for i, group in enumerate(param_groups):
        if not isinstance(group, dict) or "params" not in group:
            raise ValueError(f"param_groups[{i}] must be a dict with 'params' (as torch optimizers take)")
        params = list(group["params"])
        for p in params:
            if id(p) not in allowed:
                raise ValueError(f"param_groups[{i}] holds a tensor that is not a trainable parameter of this "
                                 f"ParallelModel ({names.get(id(p), 'unknown')}); take them from pm.named_parameters()")
            if id(p) in seen:
                raise ValueError(f"parameter {names[id(p)]} is in two param_groups")
            seen.add(id(p))
        groups.append({**group, "params": params})
    return groups
