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

LOSS_RTOL = 1e-5
WEIGHT_ATOL = 5e-5
SEQ_LEN = 12
ROWS_PER_MICROBATCH = 2
LR = 1.0  # plain SGD: a weight's change is its gradient, so the weight check is a gradient check


@dataclass
class Verdict:
    """``equal``, ``different`` or ``refused``, with the numbers behind it."""

    verdict: str
    reason: str = ""
    loss: float | None = None
    ref_loss: float | None = None
    worst: list[tuple[str, float]] = field(default_factory=list)  # (tensor, max |difference|), worst first
    moved: float = 0.0  # the largest change of any weight in the step (a step that moves nothing proves nothing)


def model_class(config: transformers.PretrainedConfig) -> type:
    """The causal-LM class of ``config`` (its ``architectures`` entry when transformers has it)."""
    names = getattr(config, "architectures", None) or []
    cls = getattr(transformers, names[0], None) if names else None
    if cls is not None and "ForCausalLM" in cls.__name__:
        return cls
    return transformers.AutoModelForCausalLM._model_mapping[type(config)]


def causal_lm_config(config: transformers.PretrainedConfig) -> transformers.PretrainedConfig:
    """The config the causal LM is built from: a composite config (Llama 4's) gives its text part,
    as ``AutoModelForCausalLM.from_config`` does."""
    return config if isinstance(config, model_class(config).config_class) else config.get_text_config()


# Modules (by class name) that draw random numbers in training besides dropout: PhiMoE's router
# samples its experts (sparsemixer). No split of the batch (dp, cp, ep) or of the layers (pp) draws
# the numbers one process draws, any more than dropout masks, so the check runs them as in
# evaluation on both sides (their deterministic top-k), as it runs dropout at 0.
SAMPLES_IN_TRAINING = ("PhimoeTopKRouter",)


def _sample_as_in_evaluation(module: torch.nn.Module, *_) -> None:
    module.training = False  # before each call: train() sets it back


def build(config: transformers.PretrainedConfig, *, seed: int) -> torch.nn.Module:
    """The causal LM of ``config`` with seeded random weights (modules that sample in training run
    as in evaluation: ``SAMPLES_IN_TRAINING``)."""
    config = causal_lm_config(config)
    torch.manual_seed(seed)
    model = model_class(config)(config).float()
    for module in model.modules():
        if type(module).__name__ in SAMPLES_IN_TRAINING:
            module.register_forward_pre_hook(_sample_as_in_evaluation)
    return model


def _batch(config, *, rows: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    vocab = config.get_text_config().vocab_size
    ids = torch.randint(3, vocab, (rows, SEQ_LEN), generator=gen)
    return {"input_ids": ids, "labels": ids.clone()}


def _compare(pm, ref: torch.nn.Module, config, out_dir: str) -> list[tuple[str, float]]:
    """Every weight of the export against the reference, worst first (rank 0; [] elsewhere)."""
    pm.save_pretrained(out_dir)
    if dist.get_rank() != 0:
        return []
    reloaded = dict(model_class(config).from_pretrained(out_dir).named_parameters())
    diffs = []
    for name, p in ref.named_parameters():
        if name not in reloaded:
            diffs.append((f"{name} (missing from the export)", float("inf")))
            continue
        diffs.append((name, (reloaded[name].float() - p.detach().float()).abs().max().item()))
    return sorted(diffs, key=lambda d: -d[1])


def parity_config(*, dp: int = 1, tp: int = 1, pp: int = 1, microbatches: int | None = None, ep: int = 1,
                  cp: int = 1, dp_shard: int = 1, sequence_parallel: bool = False, virtual_stages: int = 1,
                  recompute: str | None = None) -> ParallelConfig:
    """The ``ParallelConfig`` the check runs at (or the ``ValueError`` that refuses it): ``pp`` x
    ``virtual_stages`` microbatches unless given, interleaved 1F1B when ``virtual_stages`` > 1."""
    return ParallelConfig.from_keywords(dp=dp, tp=tp, pp=pp, ep=ep, cp=cp, dp_shard=dp_shard,
                                        microbatches=microbatches or max(1, pp * virtual_stages),
                                        sequence_parallel=sequence_parallel, virtual_stages=virtual_stages,
                                        recompute=recompute,
                                        schedule="interleaved_1f1b" if virtual_stages > 1 else "1f1b")


def one_step_parity(*, config: dict, parallel: ParallelConfig | None = None, seed: int = 0, mesh=None,
                    out_dir: str | None = None, policy=None, **keywords) -> dict:
    """Run on every rank. ``config`` is ``PretrainedConfig.to_dict()`` output, ``parallel`` the
    configuration to check (or, instead, the keywords ``parity_config`` builds it from, refused the
    same way), ``policy`` an optional ``ModelPolicy`` (default: qn_hf's choice); returns a
    ``Verdict`` as a dict on rank 0 (the others return theirs without the weight comparison)."""
    import qn_hf  # late: qn_hf.check is imported by the CLI before any process group exists

    config_obj = transformers.AutoConfig.for_model(**config)
    model = build(config_obj, seed=seed)
    ref = copy.deepcopy(model)
    try:
        parallel = parallel or parity_config(**keywords)
        pm = qn_hf.parallelize(model, parallel, mesh=mesh, policy=policy)
    except ValueError as e:  # raised identically on every rank, before any collective
        return asdict(Verdict(verdict="refused", reason=str(e)))
    dp, microbatches = parallel.dims.dp, parallel.microbatches
    batch = _batch(config_obj, rows=dp * ROWS_PER_MICROBATCH * microbatches, seed=seed + 1)
    rows = batch["input_ids"].shape[0] // dp
    local = {k: v[pm.coords.dp * rows : (pm.coords.dp + 1) * rows] for k, v in batch.items()}

    try:
        loss = pm.train_step(local).item()
    except ValueError as e:  # the first step's own checks (replicated gradients), raised on every rank
        return asdict(Verdict(verdict="refused", reason=str(e)))
    ref.train()
    ref_loss = ref(**batch, use_cache=False).loss
    ref_loss.backward()
    before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    for params in (list(pm.parameters()), list(ref.parameters())):
        torch.optim.SGD(params, lr=LR).step()
    moved = max((before[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    with tempfile.TemporaryDirectory() as tmp:
        target = out_dir or tmp
        if out_dir is None:  # every rank must write to the same directory: rank 0's
            shared = [tmp]
            dist.broadcast_object_list(shared, src=0)
            target = shared[0]
        worst = _compare(pm, ref, config_obj, target)
        dist.barrier()
    loss_ok = abs(loss - ref_loss.item()) <= LOSS_RTOL * abs(ref_loss.item())
    weights_ok = all(d <= WEIGHT_ATOL for _, d in worst)
    verdict = "equal" if loss_ok and weights_ok else "different"
    reason = "" if verdict == "equal" else (
        f"loss {loss:.7g} vs {ref_loss.item():.7g}" if not loss_ok else f"{worst[0][0]} off by {worst[0][1]:.2e}")
    return asdict(Verdict(verdict=verdict, reason=reason, loss=loss, ref_loss=ref_loss.item(), worst=worst, moved=moved))
