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
from .inputs import probe_loss

LOSS_RTOL = 1e-5
WEIGHT_ATOL = 5e-5
# plus this much of the weight's size: with lr=1 a weight moves by its gradient, and float32 sums of a
# gradient of size g differ by ~1e-7 g between two orders of summation (a DeiT class token's is ~1500)
WEIGHT_RTOL = 1e-5
ROWS_PER_MICROBATCH = 2
LR = 1.0  # plain SGD: a weight's change is its gradient, so the weight check is a gradient check
# An ill-conditioned model (a deep conv tower, LeViT after an lr=1 step: running variances of 1e6) is not
# reproducible in float32 at all: the plain model's own float32 step is farther from its float64 step than the
# tolerances. Two float32 runs then differ by rounding alone, and the check asks instead whether the parallel
# run is as close to the float64 step as the plain float32 run is: within this factor of the plain run's gap
# (two orders of summation land at comparable distances from the exact sum, not at the same one).
FLOAT32_REACH = 4.0


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
    """The config the model is built from: a composite config (Llama 4's) gives the part its class takes,
    as ``AutoModelForCausalLM.from_config`` does."""
    cls = model_class(config, name)
    if isinstance(config, cls.config_class):
        return config
    # the text part only where the class takes it; a class built on another type's config class (GLM-GA's
    # model is GLM-4.6V's, over its own composite config) takes the whole config
    text = config.get_text_config()
    return text if isinstance(text, cls.config_class) else config


# Modules (by class name) that draw random numbers in training besides dropout: PhiMoE's router
# samples its experts (sparsemixer). No split of the batch (dp, cp, ep) or of the layers (pp) draws
# the numbers one process draws, any more than dropout masks, so the check runs them as in
# evaluation on both sides (their deterministic top-k), as it runs dropout at 0.
SAMPLES_IN_TRAINING = ("PhimoeTopKRouter", "GroupViTAssignAttention")  # router jitter; Gumbel-softmax grouping


def _sample_as_in_evaluation(module: torch.nn.Module, *_) -> None:
    module.training = False  # before each call: train() sets it back


def build(config: transformers.PretrainedConfig, *, seed: int, name: str | None = None) -> torch.nn.Module:
    """The model of ``config`` (class ``name``, default its causal LM) with seeded random weights
    (modules that sample in training run as in evaluation: ``SAMPLES_IN_TRAINING``)."""
    config = causal_lm_config(config, name)
    torch.manual_seed(seed)
    model = model_class(config, name)(config).float()
    for module in model.modules():
        if type(module).__name__ in SAMPLES_IN_TRAINING:
            module.register_forward_pre_hook(_sample_as_in_evaluation)
    return model


def _compare(pm, ref: torch.nn.Module, out_dir: str) -> tuple[list[tuple[str, float]], dict[str, torch.Tensor]]:
    """Every weight of the export against the reference's own export, worst first, and the export's weights and
    statistics (rank 0; empty elsewhere). Both sides go through ``save_pretrained`` -> ``from_pretrained``, so that
    what transformers' loader does to a checkpoint is done to both (Youtu's zeroes the padding row of its tied
    embedding on every load: its ``_init_weights`` writes a slice, which the loader's "initialized" flag cannot
    mark)."""
    pm.save_pretrained(out_dir)
    if dist.get_rank() != 0:
        return [], {}
    reloaded = _state(type(ref).from_pretrained(out_dir))
    with tempfile.TemporaryDirectory() as plain_dir:
        ref.save_pretrained(plain_dir)
        plain = _state(type(ref).from_pretrained(plain_dir))
    diffs = []
    for name, p in plain.items():
        if not p.numel():
            continue
        if name not in reloaded:
            diffs.append((f"{name} (missing from the export)", float("inf")))
            continue
        # the excess over the relative part (of the tensor's largest weight: summation errors scale with
        # the sizes summed), plus the absolute tolerance's: <= WEIGHT_ATOL passes
        excess = (reloaded[name].float() - p.float()).abs() - WEIGHT_RTOL * p.float().abs().max()
        diffs.append((name, max(excess.max().item(), 0.0)))
    return sorted(diffs, key=lambda d: -d[1]), reloaded


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights and the running statistics BatchNorm layers move in training (summed over dp: they too must be
    the plain model's): what ``_compare`` reads."""
    statistics = [f"{layer}.{kind}" for layer in batch_statistics_layers(model) for kind in ("running_mean", "running_var")
                  if model.get_submodule(layer).track_running_stats]
    return {**{n: p.detach() for n, p in model.named_parameters()}, **{n: model.get_buffer(n) for n in statistics}}


def within_float32_reach(exact: torch.nn.Module, batches: list[dict], *, builtin: bool, plain: torch.nn.Module,
                          plain_losses: list[float], losses: list[float], export: dict[str, torch.Tensor]) -> str | None:
    """Where the plain float32 step is itself beyond the tolerances from the float64 step of the same model
    (``exact``, its initial weights), whether the parallel one is within FLOAT32_REACH of that gap: a reason
    saying so, else None (the plain float32 run is reproducible, or ours is farther)."""
    exact.double()
    wide = [{k: v.double() if v.is_floating_point() else v for k, v in b.items()} for b in batches]
    exact_losses, _ = _reference(exact, wide, builtin=builtin, probe=probe_loss)
    if isinstance(exact_losses, str):
        return None
    loss_gaps = [(abs(a - e), abs(b - e)) for a, b, e in zip(losses, plain_losses, exact_losses)]
    exact_state, plain_state = _state(exact), _state(plain)
    weight_gaps = {n: ((export[n].double() - t).abs().max().item(), (plain_state[n].double() - t).abs().max().item())
                   for n, t in exact_state.items() if n in export and t.numel()}
    # the worst tensor's gap of each run: in a model this far from reproducible a tensor's own gap is itself
    # chaotic (LeViT's attention biases: ours 4.3x the plain run's on one tensor, 0.6x on another)
    plain_worst = max((p for _, p in weight_gaps.values()), default=0.0)
    ours_worst = max((o for o, _ in weight_gaps.values()), default=0.0)
    plain_apart = plain_worst > WEIGHT_ATOL or any(p > LOSS_RTOL * abs(e) for (_, p), e in zip(loss_gaps, exact_losses))
    ours_close = all(o <= FLOAT32_REACH * p + LOSS_RTOL * abs(e) for (o, p), e in zip(loss_gaps, exact_losses)) and \
        ours_worst <= FLOAT32_REACH * plain_worst + WEIGHT_ATOL
    if not (plain_apart and ours_close):
        return None
    return (f"within float32's reach of the float64 step: the plain float32 model is itself {plain_worst:.2e} from it "
            f"(losses {max(p for _, p in loss_gaps):.2e}), ours {ours_worst:.2e} ({max(o for o, _ in loss_gaps):.2e}), "
            f"within {FLOAT32_REACH:g}x")


def parity_config(*, dp: int = 1, tp: int = 1, pp: int = 1, microbatches: int | None = None, ep: int = 1,
                  cp: int = 1, dp_shard: int = 1, sequence_parallel: bool = False, virtual_stages: int = 1,
                  recompute: str | None = None, schedule: str | None = None) -> ParallelConfig:
    """The ``ParallelConfig`` the check runs at (or the ``ValueError`` that refuses it): ``pp`` x
    ``virtual_stages`` microbatches unless given, ``schedule`` or else interleaved 1F1B when
    ``virtual_stages`` > 1, 1F1B otherwise."""
    return ParallelConfig.from_keywords(dp=dp, tp=tp, pp=pp, ep=ep, cp=cp, dp_shard=dp_shard,
                                        microbatches=microbatches or max(1, pp * virtual_stages),
                                        sequence_parallel=sequence_parallel, virtual_stages=virtual_stages,
                                        recompute=recompute,
                                        schedule=schedule or ("interleaved_1f1b" if virtual_stages > 1 else "1f1b"))


def one_step_parity(*, config: dict, parallel: ParallelConfig | None = None, seed: int = 0, mesh=None,
                    out_dir: str | None = None, policy=None, model_class_name: str | None = None, steps: int = 1,
                    **keywords) -> dict:
    """Run on every rank. ``config`` is ``PretrainedConfig.to_dict()`` output, ``parallel`` the
    configuration to check (or, instead, the keywords ``parity_config`` builds it from, refused the
    same way), ``policy`` an optional ``ModelPolicy`` (default: qn_hf's choice), ``model_class_name``
    the transformers class to train (default the config's causal LM; any head), ``steps`` the SGD steps
    compared; returns a ``Verdict`` as a dict on rank 0 (the others return theirs without the weight
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
        batches = [dummy_batch(ref, rows=dp * ROWS_PER_MICROBATCH * microbatches, seed=seed + 1 + step)
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
    optimizer = torch.optim.SGD(list(pm.parameters()), lr=LR)
    losses = []
    for batch in batches:
        rows = batch[next(iter(batch))].shape[0] // dp
        local = {k: v[pm.coords.dp * rows : (pm.coords.dp + 1) * rows] for k, v in batch.items()}
        optimizer.zero_grad()
        try:
            losses.append(pm.train_step(local, loss_fn=None if builtin else probe_loss).item())
        except ValueError as e:  # the first step's own checks (replicated gradients), raised on every rank
            return asdict(Verdict(verdict="refused", reason=str(e)))
        optimizer.step()
    with tempfile.TemporaryDirectory() as tmp:
        target = out_dir or tmp
        if out_dir is None:  # every rank must write to the same directory: rank 0's
            shared = [tmp]
            dist.broadcast_object_list(shared, src=0)
            target = shared[0]
        worst, export = _compare(pm, ref, target)
        loss_ok = all(abs(a - b) <= LOSS_RTOL * abs(b) for a, b in zip(losses, reference))
        weights_ok = all(d <= WEIGHT_ATOL for _, d in worst)
        # rank 0 (the one holding the export) asks float64 where float32 cannot tell; the others wait here
        reach = None if loss_ok and weights_ok or dist.get_rank() != 0 else within_float32_reach(
            build(config_obj, seed=seed, name=model_class_name), batches, builtin=builtin, plain=ref,
            plain_losses=reference, losses=losses, export=export)
        dist.barrier()
    verdict = "equal" if loss_ok and weights_ok or reach else "different"
    bad = next((i for i, (a, b) in enumerate(zip(losses, reference)) if abs(a - b) > LOSS_RTOL * abs(b)), 0)
    reason = reach or "" if verdict == "equal" else (
        f"loss {losses[bad]:.7g} vs {reference[bad]:.7g} (step {bad + 1})" if not loss_ok
        else f"{worst[0][0]} off by {worst[0][1]:.2e}")
    return asdict(Verdict(verdict=verdict, reason=reason, loss=losses[0], ref_loss=reference[0], worst=worst,
                          moved=moved))


def _reference(ref: torch.nn.Module, batches: list[dict], *, builtin: bool, probe) -> tuple[list[float] | str, float]:
    """The plain model's loss at each step of SGD over ``batches`` (its own loss, or ``probe`` of its
    outputs), and the largest change of any weight; or the error its own forward raises."""
    ref.train()
    before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    optimizer = torch.optim.SGD(list(ref.parameters()), lr=LR)
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        try:
            outputs = ref(**batch, **no_cache(ref))
            loss = outputs.loss if builtin else probe(outputs, batch)
            if loss is None:
                return f"{type(ref).__name__}'s forward returned no loss for labels {sorted(batch)}", 0.0
            loss.backward()
        except Exception as e:  # noqa: BLE001 -- the plain model's own failure is the verdict
            return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}", 0.0
        optimizer.step()
        losses.append(loss.item())
    # a parameter may hold no element (DINOv3's register tokens at num_register_tokens=0)
    moved = max(((before[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters() if p.numel()),
                default=0.0)
    return losses, moved

