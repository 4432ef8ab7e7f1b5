"""One training step of a model at a mesh against the same step of the plain model.

``one_step_parity`` runs on every rank of a world of ``dp * pp * cp * tp`` processes (gloo on CPU): it
builds the model from a config with a fixed seed (every rank and the reference get the same
weights), trains one step of SGD on a random batch both ways, and compares the loss and every
weight after the step, read back through ``save_pretrained`` -> ``from_pretrained``. A
configuration qn_hf refuses raises the same ``ValueError`` on every rank before any collective,
and comes back as a refusal. ``qn-hf-check`` and the model-zoo test both use it.
"""

from __future__ import annotations

import copy
import tempfile
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
import transformers

from ..config.parallel_config import ParallelConfig
from ..data_parallel.batch_statistics import batch_statistics_layers
from ..policies.body import no_cache
from ..step.batch import split_microbatches
from ..step.packed import packed_keys, row_layout
from .config_part import config_taken_by
from .inputs import probe_loss
from .randomness import draws_random, sample_as_in_evaluation

LOSS_RTOL = 1e-5
WEIGHT_ATOL = 5e-5
# plus this much of the weight's size: with lr=1 a weight moves by its gradient, and float32 sums of a
# gradient of size g differ by ~1e-7 g between two orders of summation (a DeiT class token's is ~1500)
WEIGHT_RTOL = 1e-5
ROWS_PER_MICROBATCH = 2
LR = 1.0  # plain SGD: a weight's change is its gradient, so the weight check is a gradient check
# An ill-conditioned model (a deep conv tower, LeViT after an lr=1 step: running variances of 1e6) is not
# reproducible in float32 at all: any other order of the same sums (a batch split in two, the plain model's own
# gradient accumulation too) lands farther from the plain float32 step than the tolerances. Where the float32 step
# is not equal, the check runs both sides again in float64 (``_float64_verdict``), where rounding is 2**29 times
# finer: a parallel step that computes what the plain one does is then equal to it within the tolerances times
# that ratio times the model's own amplification of rounding (how far the plain float32 step is from the
# float64 one, in tolerances) times FLOAT64_SLACK; one that computes something else (statistics of half the
# batch, a missing mask) stays as far apart as its error, whatever the precision.
FLOAT64_SLACK = 16.0
FLOAT64_FINER = 2.0 ** -29  # float64's epsilon over float32's


@dataclass
class Verdict:
    """``equal``, ``different`` or ``refused``, with the numbers behind it."""

    verdict: str
    reason: str = ""
    loss: float | None = None
    ref_loss: float | None = None
    worst: list[tuple[str, float]] = field(default_factory=list)  # (tensor, max |difference|), worst first
    moved: float = 0.0  # the largest change of any weight in the step (a step that moves nothing proves nothing)


def model_class(config: transformers.PretrainedConfig, name: str | None = None) -> type:
    """The class a check trains: transformers' class ``name`` (any head, ``BertForQuestionAnswering``),
    else ``config``'s causal-LM class (its ``architectures`` entry when transformers has it)."""
    if name is not None:
        cls = getattr(transformers, name, None)
        if not isinstance(cls, type):
            raise ValueError(f"transformers {transformers.__version__} has no model class {name!r}")
        return cls
    names = getattr(config, "architectures", None) or []
    cls = getattr(transformers, names[0], None) if names else None
    if cls is not None and "ForCausalLM" in cls.__name__:
        return cls
    return transformers.AutoModelForCausalLM._model_mapping[type(config)]


def causal_lm_config(config: transformers.PretrainedConfig, name: str | None = None) -> transformers.PretrainedConfig:
    """The config the model is built from: the part its class takes (``config_part.config_taken_by``)."""
    return config_taken_by(config, model_class(config, name))


def build(config: transformers.PretrainedConfig, *, seed: int, name: str | None = None) -> torch.nn.Module:
    """The model of ``config`` (class ``name``, default its causal LM) with seeded random weights
    (modules that sample in training run as in evaluation: ``randomness.sample_as_in_evaluation``)."""
    config = causal_lm_config(config, name)
    torch.manual_seed(seed)
    model = model_class(config, name)(config).float()
    sample_as_in_evaluation(model)
    return model


def _built_wide(config: transformers.PretrainedConfig, *, seed: int, name: str | None) -> torch.nn.Module:
    """``build``'s model in float64. Fused experts run eager: transformers' default for them, grouped_mm, takes
    float32 and narrower only (MuseSpark's); eager computes the same step with a loop over the experts."""
    model = build(config, seed=seed, name=name).double()
    if getattr(model.config, "_experts_implementation", None) == "grouped_mm":
        model.set_experts_implementation("eager")
    return model


def _compare(pm, ref: torch.nn.Module, out_dir: str, *,
             rtol: float = WEIGHT_RTOL) -> tuple[list[tuple[str, float]], list[str]]:
    """Every weight and statistic of the export against the reference's own export, worst first (rank 0; empty
    elsewhere), each its excess over ``rtol`` of the tensor's largest value. Both sides go through ``save_pretrained`` -> ``from_pretrained``, so that
    what transformers' loader does to a checkpoint is done to both (Youtu's zeroes the padding row of its tied
    embedding on every load: its ``_init_weights`` writes a slice, which the loader's "initialized" flag cannot
    mark). Second, the weights the plain model's own round trip loses: transformers' loader initializes them anew
    (a class under another model type's key mapping: Gemma 3's under ShieldGemma 2's, which prefixes every key
    for its classifier's wrapper), so that no export can be compared."""
    pm.save_pretrained(out_dir)
    if dist.get_rank() != 0:
        return [], []
    dtype = next(ref.parameters()).dtype  # a float64 run's export read back in float64
    reloaded = _state(type(ref).from_pretrained(out_dir, dtype=dtype))
    with tempfile.TemporaryDirectory() as plain_dir:
        ref.save_pretrained(plain_dir)
        back, info = type(ref).from_pretrained(plain_dir, dtype=dtype, output_loading_info=True)
        plain = _state(back)
    # missing from the plain model's own checkpoint and not given back by the loader's initialization either
    before = _state(ref)
    lost = sorted(n for n in info.get("missing_keys") or () if n in plain and n in before
                  and not torch.equal(plain[n].to(before[n].dtype), before[n]))
    diffs = []
    for name, p in plain.items():
        if not p.numel():
            continue
        if name not in reloaded:
            diffs.append((f"{name} (missing from the export)", float("inf")))
            continue
        # the excess over the relative part (of the tensor's largest weight: summation errors scale with
        # the sizes summed), plus the absolute tolerance's: <= WEIGHT_ATOL passes
        wide = torch.promote_types(p.dtype, torch.float32)
        excess = (reloaded[name].to(wide) - p.to(wide)).abs() - rtol * p.to(wide).abs().max()
        diffs.append((name, max(excess.max().item(), 0.0)))
    return sorted(diffs, key=lambda d: -d[1]), lost


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights and the running statistics BatchNorm layers move in training (summed over dp: they too must be
    the plain model's): what ``_compare`` reads."""
    statistics = [f"{layer}.{kind}" for layer in batch_statistics_layers(model) for kind in ("running_mean", "running_var")
                  if model.get_submodule(layer).track_running_stats]
    return {**{n: p.detach() for n, p in model.named_parameters()}, **{n: model.get_buffer(n) for n in statistics}}


def _worst_gap(state: dict[str, torch.Tensor], exact: dict[str, torch.Tensor]) -> float:
    """The largest difference of any tensor of ``state`` from ``exact``'s (``_state``), in float64."""
    return max(((state[n].double() - t).abs().max().item() for n, t in exact.items() if n in state and t.numel()),
               default=0.0)


def amplification(*, plain: dict[str, torch.Tensor], exact: dict[str, torch.Tensor], plain_losses: list[float],
                  exact_losses: list[float]) -> float:
    """How many times its tolerances a model amplifies rounding over the steps: the plain float32 run's distance
    from the float64 run of the same model (weights ``plain`` and ``exact``, losses), in tolerances; at least 1."""
    weights = _worst_gap(plain, exact) / WEIGHT_ATOL
    losses = max((abs(a - e) / (LOSS_RTOL * max(abs(e), 1e-30)) for a, e in zip(plain_losses, exact_losses)),
                 default=0.0)
    return max(1.0, weights, losses)


def _steps(pm, batches: list[dict], *, dp: int, builtin: bool) -> list[float] | str:
    """SGD over ``batches`` (each rank its dp rows); the losses, or the first step's refusal (raised on every
    rank: its own checks of replicated gradients)."""
    optimizer = torch.optim.SGD(list(pm.parameters()), lr=LR)
    losses = []
    for batch in batches:
        local = pm.local_batch(batch)  # a packed input's items with their rows (step/packed.py)
        optimizer.zero_grad()
        try:
            losses.append(pm.train_step(local, loss_fn=None if builtin else probe_loss).item())
        except ValueError as e:
            return str(e)
        optimizer.step()
    return losses


def _shared_dir(tmp: str, out_dir: str | None) -> str:
    """Where every rank writes its export: ``out_dir``, else rank 0's temporary directory."""
    if out_dir is not None:
        return out_dir
    shared = [tmp]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def _judge(losses: list[float], reference: list[float], worst: list[tuple[str, float]], *, loss_tols: list[float],
           weight_tol: float) -> str | None:
    """Why the parallel step is not the plain one (a loss farther than its tolerance, a weight's excess over
    ``weight_tol``), or None."""
    bad = next((i for i, (a, b, tol) in enumerate(zip(losses, reference, loss_tols)) if abs(a - b) > tol), None)
    if bad is not None:
        return f"loss {losses[bad]:.7g} vs {reference[bad]:.7g} (step {bad + 1})"
    if worst and worst[0][1] > weight_tol:
        return f"{worst[0][0]} off by {worst[0][1]:.2e}"
    return None


def _float64_verdict(config: transformers.PretrainedConfig, *, seed: int, name: str | None, parallel: ParallelConfig,
                     mesh, policy, batches: list[dict], builtin: bool, plain: torch.nn.Module,
                     plain_losses: list[float]) -> tuple[str | None, str]:
    """Run on every rank where the float32 step is not equal: both steps again in float64 (``FLOAT64_SLACK``),
    each trained on ``probe_loss`` of its outputs. transformers computes its per-position losses in float32 whatever
    the dtype, so a float64 step's own loss would carry float32's rounding; the losses' code is qn_hf's for every
    model of a kind, which the float32 steps of the models float32 reproduces compare.
    (None where the parallel float64 step is equal to the plain one, else why not; the numbers): rank 0's, the
    others (None, "")."""
    if builtin:  # the plain float32 step on the probe: how far float32 is from float64 on the same loss
        plain = build(config, seed=seed, name=name)
        plain_losses, _ = _reference(plain, batches, builtin=False, probe=probe_loss)
        if isinstance(plain_losses, str):
            return f"the plain model fails on the probe: {plain_losses}", ""
    wide = [{k: v.double() if v.is_floating_point() else v for k, v in b.items()} for b in batches]
    exact = _built_wide(config, seed=seed, name=name)
    exact_losses, _ = _reference(exact, wide, builtin=False, probe=probe_loss)
    if isinstance(exact_losses, str):
        return f"the plain model fails: {exact_losses}", ""
    import qn_hf  # late, as in one_step_parity

    try:
        pm = qn_hf.parallelize(_built_wide(config, seed=seed, name=name), parallel, mesh=mesh, policy=policy)
    except ValueError as e:  # raised on every rank alike
        return f"refused: {e}", ""
    losses = _steps(pm, wide, dp=parallel.dims.dp, builtin=False)
    if isinstance(losses, str):
        return f"refused: {losses}", ""
    scale = FLOAT64_FINER * FLOAT64_SLACK * amplification(plain=_state(plain), exact=_state(exact),
                                                           plain_losses=plain_losses, exact_losses=exact_losses)
    # Where a model computes parts in float32 whatever its dtype (transformers' eager attention's softmax, RMSNorm's
    # variance, RoPE), float64 inputs that differ in their last digits round to float32 apart now and then: the
    # plain float64 step with its sums in another order (mathematically the same step) measures that floor. Its
    # batch's halves, accumulated; or, for a model with batch statistics (which its halves' would not be), the
    # same rows reversed (PP-OCRv5's float32 softmax beside its BatchNorm).
    statistics = bool(batch_statistics_layers(exact))
    floor = _built_wide(config, seed=seed, name=name)
    floor_losses, _ = _reference(floor, wide, builtin=False, probe=probe_loss, parts=1 if statistics else 2,
                                 reverse=statistics)
    if isinstance(floor_losses, str):
        floor = None
    with tempfile.TemporaryDirectory() as tmp:
        worst, _ = _compare(pm, exact, _shared_dir(tmp, None), rtol=scale * WEIGHT_RTOL)
        dist.barrier()
    if dist.get_rank() != 0:
        return None, ""
    # an order's rounding measured in float64 cannot exceed float32's own (the plain float32 step's distance from
    # the float64 one): a model whose step depends on the order of its rows (a capacity-bound router) gets no floor
    # from that dependence
    floor_weights = 0.0 if floor is None else min(_worst_gap(_state(floor), _state(exact)),
                                                  _worst_gap(_state(plain), _state(exact)))
    floor_losses = [0.0] * len(losses) if floor is None else [
        min(abs(f - e), abs(p - e)) for f, p, e in zip(floor_losses, plain_losses, exact_losses)]
    loss_tols = [max(scale * LOSS_RTOL * abs(e), FLOAT64_SLACK * f) for e, f in zip(exact_losses, floor_losses)]
    weight_tol = max(scale * WEIGHT_ATOL, FLOAT64_SLACK * floor_weights)
    loss_gap = max(abs(a - b) / abs(b) for a, b in zip(losses, exact_losses))
    numbers = (f"in float64 the losses {loss_gap:.1e} apart, {worst[0][0]} {worst[0][1]:.1e} over the tolerances "
               f"x{scale:.1e}; the plain step in another order {max(floor_losses) / abs(exact_losses[-1]):.1e} and "
               f"{floor_weights:.1e} apart")
    return _judge(losses, exact_losses, worst, loss_tols=loss_tols, weight_tol=weight_tol), numbers


def parity_config(*, microbatches: int | None = None, virtual_stages: int = 1, schedule: str | None = None,
                  **options: object) -> ParallelConfig:
    """The ``ParallelConfig`` the check runs at (``options``: the degrees and any other of its keywords), or the
    ``ValueError`` that refuses it: pp x ``virtual_stages`` microbatches unless given, ``schedule`` or else
    interleaved 1F1B when ``virtual_stages`` > 1, 1F1B otherwise."""
    stages = options.get("pp", 1) * virtual_stages
    return ParallelConfig.from_keywords(**options, microbatches=microbatches or max(1, stages),
                                        virtual_stages=virtual_stages,
                                        schedule=schedule or ("interleaved_1f1b" if virtual_stages > 1 else "1f1b"))


def one_step_parity(*, config: dict, parallel: ParallelConfig | None = None, seed: int = 0, mesh=None,
                    out_dir: str | None = None, policy=None, model_class_name: str | None = None, steps: int = 1,
                    batches: list[dict[str, torch.Tensor]] | None = None, **keywords) -> dict:
    """Run on every rank. ``config`` is ``PretrainedConfig.to_dict()`` output, ``parallel`` the
    configuration to check (or, instead, the keywords ``parity_config`` builds it from, refused the
    same way), ``policy`` an optional ``ModelPolicy`` (default: qn_hf's choice), ``model_class_name``
    the transformers class to train (default the config's causal LM; any head), ``steps`` the SGD steps
    compared (``batches``: the global batch of each, the same on every rank, instead of random ones); returns a
    ``Verdict`` as a dict on rank 0 (the others return theirs without the weight
    comparison). The head's own loss trains where the model has one qn_hf computes
    (``inputs.dummy_batch``); any other model trains ``probe_loss`` both ways. A model whose plain
    forward fails in one process is ``fails alone``, with its error."""
    import qn_hf  # late: qn_hf.check is imported by the CLI before any process group exists

    from ..config.options import LossKind
    from ..policies.task import task_head
    from .inputs import NoBatch, dummy_batch

    config_obj = transformers.AutoConfig.for_model(**config)
    model = build(config_obj, seed=seed, name=model_class_name)
    ref = copy.deepcopy(model)
    head = task_head(model)
    try:
        parallel = parallel or parity_config(**keywords)
    except ValueError as e:
        return asdict(Verdict(verdict="refused", reason=str(e)))
    dp, microbatches = parallel.dims.dp, parallel.microbatches
    one_forward = dp * parallel.dims.cp * microbatches == 1
    builtin = head.kind is not None and (head.kind is not LossKind.OWN or one_forward)
    try:
        batches = batches or [dummy_batch(ref, rows=dp * ROWS_PER_MICROBATCH * microbatches, seed=seed + 1 + step)
                              for step in range(steps)]
    except NoBatch as e:
        return asdict(Verdict(verdict="no batch", reason=str(e)))
    if not builtin:  # the probe reads the model's outputs only
        batches = [{k: v for k, v in b.items() if k not in head.label_keys and k != "labels"} for b in batches]
    reference, moved = _reference(ref, batches, builtin=builtin, probe=probe_loss)
    if isinstance(reference, str):
        return asdict(Verdict(verdict="fails alone", reason=reference))
    try:
        pm = qn_hf.parallelize(model, parallel, mesh=mesh, policy=policy)
    except ValueError as e:  # raised identically on every rank, before any collective
        return asdict(Verdict(verdict="refused", reason=str(e)))
    losses = _steps(pm, batches, dp=dp, builtin=builtin)
    if isinstance(losses, str):
        return asdict(Verdict(verdict="refused", reason=losses))
    with tempfile.TemporaryDirectory() as tmp:
        worst, lost = _compare(pm, ref, _shared_dir(tmp, out_dir))
        dist.barrier()
    # the weights are compared on rank 0 alone: its word decides, on every rank, whether float64 is asked
    why = [_judge(losses, reference, worst, loss_tols=[LOSS_RTOL * abs(b) for b in reference], weight_tol=WEIGHT_ATOL),
           lost]
    dist.broadcast_object_list(why, src=0)
    if why[1]:
        return asdict(Verdict(verdict="fails alone", reason=f"transformers' save_pretrained -> from_pretrained of the "
                                                            f"plain model loses {len(why[1])} weights ({why[1][0]}, ...)"))
    verdict, reason = "equal", ""
    if why[0] is not None:
        if draws_random(build(config_obj, seed=seed, name=model_class_name), batches[0],
                        loss=None if builtin else probe_loss):
            return asdict(Verdict(verdict="random", reason=f"the plain model's loss on one batch changes with the "
                                                           f"random state: its forward draws random numbers, which no "
                                                           f"split of the batch draws alike ({why[0]})"))
        wide, numbers = _float64_verdict(config_obj, seed=seed, name=model_class_name, parallel=parallel, mesh=mesh,
                                         policy=policy, batches=batches, builtin=builtin, plain=ref,
                                         plain_losses=reference)
        if wide is None:  # the first line is what the zoo records: no number of float32's rounding (CPUs differ)
            reason = f"in float64 (float32 rounding alone)\n{why[0]} in float32; {numbers}"
        else:
            verdict, reason = "different", f"{why[0]} in float32, and in float64 too: {wide}\n{numbers}"
    return asdict(Verdict(verdict=verdict, reason=reason, loss=losses[0], ref_loss=reference[0], worst=worst,
                          moved=moved))


def _pieces(batch: dict, config, *, parts: int, reverse: bool) -> list[dict]:
    """``batch``'s rows (in reverse order with ``reverse``) in ``parts`` parts of torch.tensor_split's sizes; a
    packed input's items with their rows (step/packed.py)."""
    if not packed_keys(batch):
        batch = {k: v.flip(0) for k, v in batch.items()} if reverse else batch
        return [batch] if parts == 1 else [{k: torch.tensor_split(v, parts)[part] for k, v in batch.items()}
                                           for part in range(parts)]
    layout = row_layout(batch, config)
    if reverse:
        batch = layout.reordered(batch, list(range(layout.rows))[::-1])
        layout = row_layout(batch, config)
    return split_microbatches(batch, microbatches=parts, layout=layout)


def _reference(ref: torch.nn.Module, batches: list[dict], *, builtin: bool, probe, parts: int = 1,
               reverse: bool = False) -> tuple[list[float] | str, float]:
    """The plain model's loss at each step of SGD over ``batches`` (its own loss, or ``probe`` of its
    outputs), and the largest change of any weight; or the error its own forward raises. ``parts`` > 1: each
    batch's rows in that many parts, their gradients accumulated, the same step with its sums in another order
    (for ``probe``, a mean over rows, whose parts' means over ``parts`` are the whole's); ``reverse``: the rows
    in reverse order (the probe's mean and batch statistics alike are the same)."""
    ref.train()
    before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    optimizer = torch.optim.SGD(list(ref.parameters()), lr=LR)
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        total = 0.0
        for rows in _pieces(batch, ref.config, parts=parts, reverse=reverse):
            try:
                outputs = ref(**rows, **no_cache(ref))
                loss = outputs.loss if builtin else probe(outputs, rows)
                if loss is None:
                    return f"{type(ref).__name__}'s forward returned no loss for labels {sorted(batch)}", 0.0
                if parts > 1:
                    loss = loss / parts
                loss.backward()
            except Exception as e:  # noqa: BLE001 -- the plain model's own failure is the verdict
                return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}", 0.0
            total += loss.item()
        optimizer.step()
        losses.append(total)
    # a parameter may hold no element (DINOv3's register tokens at num_register_tokens=0)
    moved = max(((before[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters() if p.numel()),
                default=0.0)
    return losses, moved

