"""Per-block torch.compile (inductor, CPU) equals the plain Hugging Face model; what it cannot take is refused.

Each case trains the compiled parallel model two SGD steps next to the plain model built from the same weights
(float32, no dropout) and checks the losses and every local weight after the steps, that the blocks really ran
compiled code, and which graph breaks split them. Compiling on two cores is slow: the CI-sized suite runs two
meshes, the rest is marked long.

``qn_hf.parallelize(..., compile=True)`` is the API; until parallelize takes that keyword, ``_parallelize`` calls
it without and compiles the blocks itself with ``qn_hf.step.compile.apply_compile`` (the same pass).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

import qn_hf
from qn_hf.config.features import Feature, Status
from qn_hf.step.compile import apply_compile, is_compiled
from tests.cases import error_message, mesh_for
from tests.models import dp_slice, load, make_batch
from tests.optim_cases import shard_of
from tests.test_parity import LOSS_RTOL, WEIGHT_ATOL

KEYWORD = "compile" in qn_hf.ParallelConfig.keyword_names()
# dynamo cannot trace the random streams' generator swaps at the tp regions' edges (qn_hf/step/compile.py)
RNG_BREAKS = ("get_rng_state", "set_rng_state")


def _parallelize(model, *, compile: bool, **kwargs) -> qn_hf.ParallelModel:
    if KEYWORD:
        return qn_hf.parallelize(model, compile=compile, **kwargs)
    pm = qn_hf.parallelize(model, **kwargs)
    if compile:
        apply_compile(pm.module, layers=pm.stage.plan.layers)
    return pm


def gathered(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _breaks() -> list[str]:
    """The graph breaks dynamo recorded, each by the function or reason it named."""
    from torch._dynamo.utils import counters

    out = []
    for reason in counters["graph_break"]:
        named = [f for f in RNG_BREAKS if f"`{f}`" in reason]
        out.append(named[0] if named else reason.splitlines()[0][:300])
    return sorted(set(out))


def compiled_parity(*, kind: str, model_dir: str, dp: int, tp: int, pp: int = 1, microbatches: int = 1,
                    schedule: str = "1f1b", virtual_stages: int = 1, sequence_parallel: bool = False,
                    recompute: str | None = None, zero: bool = False, steps: int = 2, dp_shard: int = 1,
                    cp: int = 1, ep: int = 1, expert_dispatch: str = "all_to_all",
                    loss_chunk_tokens: int | None = None, offload: str | None = None) -> dict:
    """The compiled parallel model against the plain one: losses of ``steps`` SGD steps, local weights after."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # a fresh cache per job: the test worlds run many models in one process
    counters.clear()
    torch.manual_seed(0)
    ref = load(kind, model_dir)
    pm = _parallelize(load(kind, model_dir), compile=True, dp=dp, tp=tp, pp=pp, microbatches=microbatches,
                      schedule=schedule, virtual_stages=virtual_stages, sequence_parallel=sequence_parallel,
                      recompute=recompute, mesh=mesh_for(dp, tp, pp, cp), cp=cp, ep=ep,
                      **({"dp_shard": dp_shard} if dp_shard > 1 else {}),
                      **({"expert_dispatch": expert_dispatch} if ep > 1 else {}),
                      **({"loss_chunk_tokens": loss_chunk_tokens} if loss_chunk_tokens else {}),
                      **({"offload": offload} if offload else {}))
    opt = qn_hf.optimizer(pm, torch.optim.SGD, lr=0.5, zero=zero)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    losses, ref_losses, graphs = [], [], []
    for step in range(steps):
        batch = make_batch(kind, size=dp * 2 * microbatches, seed=10 + step, padded=kind != "vit", seq=16)
        opt.zero_grad()
        losses.append(pm.train_step(dp_slice(batch, dp=dp, dp_rank=pm.coords["dp"])).item())
        opt.step()
        graphs.append(counters["stats"]["unique_graphs"])
        ref_opt.zero_grad()
        loss = ref(**batch).loss
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())
    full = dict(ref.named_parameters(remove_duplicate=False))  # the last stage's copy of a tied weight too
    # dp_shard: each weight gathered whole over its group (collective, in the same order on every rank)
    weight_err = max((gathered(p.detach()) - shard_of(pm, n, full[n].detach())).abs().max().item()
                     for n, p in pm.named_parameters())
    moved = max((p.detach() - q.detach()).abs().max().item()
                for (_, p), (_, q) in zip(ref.named_parameters(), load(kind, model_dir).named_parameters()))
    return {"losses": losses, "ref_losses": ref_losses, "weight_err": weight_err, "moved": moved,
            "compiled": is_compiled(pm.module, layers=pm.stage.plan.layers), "graphs": graphs, "breaks": _breaks(),
            "break_count": sum(counters["graph_break"].values())}


def check(results: list[dict]) -> None:
    for r in results:
        for loss, ref in zip(r["losses"], r["ref_losses"]):
            assert abs(loss - ref) <= LOSS_RTOL * abs(ref), r
        assert r["weight_err"] < WEIGHT_ATOL < r["moved"], r
        assert r["compiled"] and r["graphs"][0] > 0, r  # the blocks ran inductor's code
        assert r["graphs"][-1] == r["graphs"][0], r  # later steps reuse it: nothing recompiled
        assert set(r["breaks"]) <= set(RNG_BREAKS), r


@pytest.mark.composes((Feature.TP, Feature.COMPILE))
def test_compiled_tensor_parallel(worlds, model_dirs):
    """tp=2, no dropout: no random-stream hooks, so each block compiles as one graph, its tp collectives
    traced as functional collectives; nothing recompiled."""
    results = worlds.run(2, compiled_parity, kind="llama", model_dir=model_dirs["llama"],
                         dp=1, tp=2)
    check(results)
    for r in results:
        assert r["break_count"] == 0 and r["graphs"] == [1, 1], r


def test_compiled_one_rank_without_dropout_keeps_whole_graphs(worlds, model_dirs):
    """tp=1 and no dropout: the random streams put no hooks on the blocks (rng.py), so no graph break comes
    from qn_hf's hooks; equal to the plain model, nothing recompiled."""
    results = worlds.run(1, compiled_parity, kind="llama", model_dir=model_dirs["llama"], dp=1, tp=1)
    check(results)
    for r in results:
        assert r["break_count"] == 0 and r["graphs"] == [1, 1], r  # one graph for every block, as plain per-block compile


def test_random_streams_hook_only_regions_that_draw():
    """tp > 1 hooks a tp region into its random stream only where it may draw: Llama's attention with
    attention_dropout > 0, not its MLP; nothing without dropout (so no graph break from the streams)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from qn_hf.tensor_parallel.rng import region_draws

    for dropout, attention in ((0.1, True), (0.0, False)):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **_SMALL, attention_dropout=dropout))
        assert region_draws(model.model.layers[0].self_attn) is attention
        assert region_draws(model.model.layers[0].mlp) is False
    gpt2 = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=4, attn_pdrop=0.0,
                                                                 resid_pdrop=0.1, embd_pdrop=0.0))
    assert region_draws(gpt2.transformer.h[0].attn)  # its residual dropout module
    assert region_draws(gpt2.transformer.h[0].mlp)


# each block compiled in place, FSDP's hooks on it run eagerly around its graph (step/compile.py)
@pytest.mark.composes((Feature.DP_SHARD, Feature.COMPILE))
def test_compiled_sharded_data_parallel(worlds, model_dirs):
    """dp=2 x dp_shard=2: each block compiled in place under FSDP2, whose hooks dynamo leaves out of the
    graph (they run eagerly around it: all-gather before, reduce-scatter after): no other graph break,
    nothing recompiled, equal to the plain model."""
    results = worlds.run(2, compiled_parity, kind="llama", model_dir=model_dirs["llama"], dp=2, tp=1, dp_shard=2)
    check(results)


@pytest.mark.composes((Feature.PP_1F1B, Feature.COMPILE), (Feature.DP, Feature.COMPILE))
def test_compiled_data_and_pipeline_parallel(worlds, model_dirs):
    results = worlds.run(4, compiled_parity, kind="gpt2", model_dir=model_dirs["gpt2"],
                         dp=2, tp=1, pp=2, microbatches=2)
    check(results)


LONG_CASES = [  # (kind, world size, compiled_parity's mesh and options)
    # the entries must not regather their inputs under compile: parallelize(compile=True) turns that off
    pytest.param("llama", 2, dict(dp=1, tp=2, sequence_parallel=True),
                 marks=pytest.mark.skipif(not KEYWORD, reason="needs parallelize(compile=True)")),
    ("gpt2", 4, dict(dp=1, tp=2, pp=2, microbatches=2, schedule="gpipe")),
    ("llama_deep", 2, dict(dp=1, tp=1, pp=2, microbatches=2, schedule="interleaved_1f1b", virtual_stages=2)),
    ("llama", 2, dict(dp=1, tp=2, recompute="selective")),
    ("gpt2", 2, dict(dp=1, tp=2, recompute="full")),
    ("llama", 2, dict(dp=2, tp=1, zero=True)),  # ZeRO-1: parameters viewing flat buffers, hooks on every layer
    ("vit", 2, dict(dp=1, tp=2)),
]


@pytest.mark.composes((Feature.PP_GPIPE, Feature.COMPILE), case="gpt2-4-dp=1-tp=2-pp=2-microbatches=2-schedule=gpipe")
@pytest.mark.composes((Feature.RECOMPUTE, Feature.COMPILE), case="llama-2-dp=1-tp=2-recompute=selective")
@pytest.mark.composes((Feature.SP, Feature.COMPILE), case="llama-2-dp=1-tp=2-sequence_parallel=True")
@pytest.mark.composes((Feature.ZERO, Feature.COMPILE), case="llama-2-dp=2-tp=1-zero=True")
@pytest.mark.composes(
    (Feature.PP_INTERLEAVED, Feature.COMPILE),
    case="llama_deep-2-dp=1-tp=1-pp=2-microbatches=2-schedule=interleaved_1f1b-virtual_stages=2")
@pytest.mark.long
@pytest.mark.parametrize(("kind", "world", "options"), LONG_CASES, ids=lambda v: str(v) if not isinstance(v, dict) else
                         "-".join(f"{k}={x}" for k, x in v.items()))
def test_compiled_meshes(worlds, model_dirs, kind, world, options):
    results = worlds.run(world, compiled_parity, kind=kind, model_dir=model_dirs[kind], **options)
    check(results)


def compiled_mixed(*, kind: str, model_dir: str, tp: int, precision: str, steps: int = 2) -> dict:
    """bf16/fp16 compute with float32 masters, compiled against eager (the same qn_hf run): losses and the masters
    after ``steps`` SGD steps. Inductor computes a block's fused elementwise chains in float32 where eager rounds
    to the low precision after each op, so the two agree to that precision, not bit for bit."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    runs = {}
    for compile in (False, True):
        pm = _parallelize(load(kind, model_dir), compile=compile, tp=tp, mixed_precision=precision,
                          mesh=mesh_for(1, tp))
        opt = qn_hf.optimizer(pm, torch.optim.SGD, lr=0.5)
        losses = []
        for step in range(steps):
            opt.zero_grad()
            losses.append(pm.train_step(make_batch(kind, size=2, seed=10 + step, padded=True, seq=16)).item())
            opt.step()
        runs[compile] = (losses, [m.tensor.clone() for m in opt.masters], pm)
    (eager, eager_masters, _), (compiled, masters, pm) = runs[False], runs[True]
    start = [m.tensor.clone() for m in qn_hf.optimizer(_parallelize(load(kind, model_dir), compile=False, tp=tp,
                                                                    mesh=mesh_for(1, tp)),
                                                       torch.optim.SGD, lr=0.5).masters]
    return {"losses": compiled, "eager_losses": eager,
            "master_err": max((a - b).abs().max().item() for a, b in zip(masters, eager_masters)),
            "moved": max((a - b).abs().max().item() for a, b in zip(eager_masters, start)),
            "dtypes": sorted({str(p.dtype) for p in pm.parameters()}),
            "compiled": is_compiled(pm.module, layers=pm.stage.plan.layers),
            "graphs": counters["stats"]["unique_graphs"]}


# bf16 only runs: its masters land 4.03% of the distance moved from eager's, past the 4% bound (below); a run
# warns of the pair, and make test needs no run of it
@pytest.mark.composes((Feature.BF16, Feature.COMPILE), case="bf16", status=Status.RUNS)
@pytest.mark.composes((Feature.FP16, Feature.COMPILE), case="fp16", status=Status.EQUIVALENT)
@pytest.mark.long
@pytest.mark.parametrize("precision", [
    # measured on torch 2.13 CPU (2026-12-02), every run alike: the masters 0.00775 apart against a bound of 0.00770
    # (4% of the 0.1925 moved): the bound's premise (each run within 2% of the float32 reference) is not checked
    # here; which run leaves it is not found yet. Recorded, not hidden: strict, so a pass says it is mended.
    pytest.param("bf16", marks=pytest.mark.xfail(strict=True, reason="compiled bf16 masters 4.03% of the distance "
                                                                     "moved from eager's, past the 4% bound")),
    "fp16"])
def test_compiled_mixed_precision(worlds, model_dirs, precision):
    for r in worlds.run(2, compiled_mixed, kind="llama", model_dir=model_dirs["llama"], tp=2,
                        precision=precision):
        dtype = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[precision]
        assert r["dtypes"] == [dtype] and r["compiled"] and r["graphs"] > 0, r
        for loss, eager in zip(r["losses"], r["eager_losses"]):
            assert abs(loss - eager) <= 1e-2 * abs(eager), r  # bfloat16 keeps 8 bits of mantissa
        # the mixed-precision tests bound eager against the hand-made reference by 2% of the distance moved; two
        # runs rounding differently each within that are within twice it of each other
        assert r["master_err"] <= 0.04 * r["moved"], r


def compiled_lora(*, model_dir: str, tp: int, steps: int = 2) -> dict:
    """peft's LoRA on the tp layers, compiled against the same parallel model in eager (which test_peft.py checks
    against the plain PEFT model): losses and every trainable weight after ``steps`` SGD steps."""
    from torch._dynamo.utils import counters

    from tests.peft_cases import lora_model

    torch._dynamo.reset()
    counters.clear()
    runs = {}
    for compile in (False, True):
        model = lora_model("llama", model_dir, targets=["q_proj", "v_proj", "o_proj", "down_proj"])
        pm = _parallelize(model, compile=compile, tp=tp, mesh=mesh_for(1, tp))
        opt = qn_hf.optimizer(pm, torch.optim.SGD, lr=0.5)
        losses = []
        for step in range(steps):
            opt.zero_grad()
            losses.append(pm.train_step(make_batch("llama", size=2, seed=10 + step, padded=True, seq=16)).item())
            opt.step()
        runs[compile] = (losses, {n: p.detach().clone() for n, p in pm.named_parameters() if p.requires_grad})
    (eager, weights), (compiled, compiled_weights) = runs[False], runs[True]
    return {"losses": compiled, "ref_losses": eager, "trainable": len(weights),
            "weight_err": max((compiled_weights[n] - w).abs().max().item() for n, w in weights.items()),
            "graphs": counters["stats"]["unique_graphs"], "breaks": _breaks()}


@pytest.mark.composes((Feature.LORA, Feature.COMPILE), status=Status.EQUIVALENT)
@pytest.mark.long
def test_compiled_lora(worlds, model_dirs):
    pytest.importorskip("peft")
    for r in worlds.run(2, compiled_lora, model_dir=model_dirs["llama"], tp=2):
        assert r["trainable"] > 0 and r["graphs"] > 0 and set(r["breaks"]) <= set(RNG_BREAKS), r
        for loss, ref in zip(r["losses"], r["ref_losses"]):
            assert abs(loss - ref) <= LOSS_RTOL * abs(ref), r
        assert r["weight_err"] < WEIGHT_ATOL, r


def _meta(kind: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **_SMALL))


_SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, vocab_size=97, bos_token_id=1, eos_token_id=2, pad_token_id=0)


@pytest.mark.parametrize(("kind", "kwargs", "expected"), [
    ("llama", dict(compile="yes"), "compile='yes' must be True or False"),
])
def test_refused_combinations(kind, kwargs, expected):
    """Refused before any collective, by the check parallelize and the planner share."""
    from qn_hf.validation.checks import check_parallel_config

    config = {"dp": 1, "tp": 1, "pp": 1, "microbatches": 1, "schedule": "1f1b", "compile": True, **kwargs}
    message = error_message(lambda: check_parallel_config(_meta(kind), **config))
    assert expected in message, message
    assert "compile" not in error_message(lambda: check_parallel_config(_meta(kind), **{**config, "compile": False}))


def test_stacked_experts_with_expert_parallelism_are_refused():
    """Llama 4's experts stacked on dim 0 take ep's dispatch through hooks no compiled test covers: refused at
    ep > 1, accepted at ep=1 (their call has fixed shapes)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from qn_hf.step.compile import check_compile

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
            "llama4_text", **_SMALL, num_local_experts=4, intermediate_size_mlp=64))
    assert "experts stacked on dim 0" in error_message(
        lambda: check_compile(model, compile=True, schedule="1f1b", cp=1, ep=2, layers="model.layers"))
    check_compile(model, compile=True, schedule="1f1b", cp=1, ep=1, layers="model.layers")  # accepted
    check_compile(_meta("llama"), compile=True, schedule="zb_h1", cp=2, ep=1, layers="model.layers")  # accepted


def test_trainer_torch_compile_arguments(tmp_path):
    """TrainingArguments(torch_compile=True) asks parallelize to compile the blocks; what it cannot honour is
    refused (pure checks, before any collective)."""
    from qn_hf.integrations.hf_trainer.args import check_compiled, check_training_args, trainer_mesh
    from tests.trainer_cases import training_args

    args = training_args(str(tmp_path), batch=2, eval_batch=2, accumulation=1, max_grad_norm=1.0)
    assert "compile" not in trainer_mesh(dict(tp=2), args=args).parallelize
    args.torch_compile = True
    mesh = trainer_mesh(dict(tp=2), args=args)
    assert mesh.parallelize["compile"] is True
    check_training_args(args, mesh=mesh, world_size=2)  # inductor, the default mode: accepted
    if KEYWORD:  # else parallel= has no key "compile" yet
        assert "parallel compile=False" in error_message(lambda: trainer_mesh(dict(compile=False), args=args))
    for key, value, expected in (("torch_compile_backend", "eager", "torch_compile_backend='eager'"),
                                 ("torch_compile_mode", "max-autotune", "torch_compile_mode='max-autotune'")):
        bad = training_args(str(tmp_path), batch=2, eval_batch=2, accumulation=1, max_grad_norm=1.0)
        bad.torch_compile = True
        setattr(bad, key, value)
        assert expected in error_message(lambda: check_training_args(bad, mesh=trainer_mesh({}, args=bad),
                                                                     world_size=1))
    assert "ParallelModel whose blocks are not compiled" in error_message(lambda: check_compiled(args, compiled=False))
    check_compiled(args, compiled=True)


def compiled_trainer(*, model_dir: str, out_dir: str, tp: int, compile: bool) -> list[float]:
    """qn_hf.Trainer's logged losses over 4 steps, with TrainingArguments.torch_compile as given."""
    from tests.trainer_cases import token_dataset, training_args

    torch._dynamo.reset()
    args = training_args(out_dir, batch=2, eval_batch=2, accumulation=1, max_grad_norm=1.0, steps=4)
    args.torch_compile = compile
    trainer = qn_hf.Trainer(model=load("llama", model_dir), args=args, train_dataset=token_dataset(16, seed=1),
                            parallel=dict(tp=tp, mesh=mesh_for(1, tp)))
    assert is_compiled(trainer.pm.module, layers=trainer.pm.stage.plan.layers) == compile
    trainer.train()
    return [r["loss"] for r in trainer.state.log_history if "loss" in r]


@pytest.mark.composes((Feature.TRAINER, Feature.COMPILE), status=Status.EQUIVALENT)
@pytest.mark.long
@pytest.mark.skipif(not KEYWORD, reason="the Trainer compiles through parallelize(compile=True)")
def test_trainer_with_torch_compile(worlds, model_dirs, tmp_path):
    pytest.importorskip("accelerate")
    runs = {c: worlds.run(2, compiled_trainer, model_dir=model_dirs["llama"],
                          out_dir=str(tmp_path / str(c)), tp=2, compile=c)[0] for c in (True, False)}
    assert len(runs[True]) == 4 and runs[True] == pytest.approx(runs[False], rel=LOSS_RTOL), runs


def compiled_generate(*, model_dir: str, tp: int, pp: int) -> dict:
    """Greedy generation with compiled blocks (a KV cache at pp=1, the whole sequence per token at pp=2):
    the tokens of the plain model's generate."""
    torch._dynamo.reset()
    ref = load("llama", model_dir).eval()
    pm = _parallelize(load("llama", model_dir), compile=True, tp=tp, pp=pp, microbatches=pp, mesh=mesh_for(1, tp, pp))
    ids = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(3))
    common = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ours, theirs = pm.generate(ids, **common), ref.generate(ids, **common)
    return {"ours": ours.tolist(), "theirs": theirs.tolist(), "compiled": is_compiled(pm.module, layers=pm.stage.plan.layers)}


@pytest.mark.composes((Feature.GENERATE, Feature.COMPILE), case="2-1")
@pytest.mark.long
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_compiled_generate_equals_plain_model(worlds, model_dirs, tp, pp):
    """The composition table's generate x compile row: greedy tokens of compiled blocks equal the plain model's."""
    for r in worlds.run(tp * pp, compiled_generate, model_dir=model_dirs["llama"], tp=tp, pp=pp):
        assert r["compiled"] and r["ours"] == r["theirs"], r


# dynamo's reason for the break around a function qn_hf runs eagerly (``torch.compiler.disable``)
DISABLED = "Skip calling `torch.compiler.disable()`d function"


@pytest.mark.composes((Feature.COMPILE, Feature.CP), case="cp2")
@pytest.mark.composes((Feature.COMPILE, Feature.EP), case="dp2-ep2")
@pytest.mark.composes((Feature.EP_ALL_GATHER, Feature.COMPILE), case="dp2-ep2-all_gather")
@pytest.mark.composes((Feature.LOSS_CHUNKS, Feature.COMPILE), case="dp2-loss_chunks")
@pytest.mark.composes((Feature.OFFLOAD, Feature.COMPILE), case="dp2-offload")
# compile: what dynamo cannot trace runs eagerly between a block's compiled pieces (step/compile.py)
@pytest.mark.composes((Feature.COMPILE, Feature.PP_ZB_H1), case="zb_h1")
@pytest.mark.parametrize(("kind", "world", "options"), [
    pytest.param("llama", 2, dict(dp=1, tp=1, cp=2), id="cp2"),
    pytest.param("qwen3_moe", 2, dict(dp=2, tp=1, ep=2), id="dp2-ep2"),
    pytest.param("qwen3_moe", 2, dict(dp=2, tp=1, ep=2, expert_dispatch="all_gather"), id="dp2-ep2-all_gather"),
    pytest.param("qwen3_moe", 1, dict(dp=1, tp=1), id="ep1", marks=pytest.mark.long),
    pytest.param("llama", 2, dict(dp=1, tp=1, pp=2, microbatches=2, schedule="zb_h1"), id="zb_h1"),
    # the head and the loss run eagerly after the compiled blocks, a chunk of tokens at a time
    pytest.param("llama", 2, dict(dp=2, tp=1, loss_chunk_tokens=5), id="dp2-loss_chunks"),
    # each compiled block's inputs held on the host by the hooks around its checkpoint
    pytest.param("llama", 2, dict(dp=2, tp=1, recompute="full", offload="activations"), id="dp2-offload"),
    pytest.param("llama", 4, dict(dp=1, tp=2, pp=2, microbatches=2, sequence_parallel=True), id="tp2-pp2-sp",
                 marks=pytest.mark.long),
])
def test_compiled_with_ring_experts_and_zero_bubble(worlds, model_dirs, kind, world, options):
    """Ring attention, the experts' calls (ep's dispatch or the model's own, at data-dependent sizes) and
    ZB-H1's deferring projections run eagerly between the compiled pieces of a block; the rest compiles
    once. Equal to the plain model, nothing recompiled on the second step."""
    results = worlds.run(world, compiled_parity, kind=kind, model_dir=model_dirs[kind], **options)
    for r in results:
        for loss, ref in zip(r["losses"], r["ref_losses"]):
            assert abs(loss - ref) <= LOSS_RTOL * abs(ref), r
        assert r["weight_err"] < WEIGHT_ATOL < r["moved"], r
        assert r["compiled"] and r["graphs"][0] > 0 and r["graphs"][-1] == r["graphs"][0], r
        assert set(r["breaks"]) <= {DISABLED}, r  # nothing else splits a block
