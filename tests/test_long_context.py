"""Long context within memory: the causal-LM loss a chunk of tokens at a time (``loss_chunk_tokens``) and the
blocks' saved inputs held on the host (``offload="activations"``), each with every feature and together."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

import qn_hf
from qn_hf.config.features import Feature
from qn_hf.memory.offload import ActivationOffload
from qn_hf.memory.recompute import apply_recompute
from qn_hf.planner.estimate import Planner
from qn_hf.tensor_parallel.rng import RngStreams
from qn_hf.validation.checks import check_parallel_config
from tests import cases, ep_cases, optim_cases, peft_cases
from tests.cases import mesh_for, model_inputs
from tests.models import CONFIGS, load, make_batch
from tests.test_expert_parallel import check_experts
from tests.test_mixed_precision import check_mixed
from tests.test_parity import check
from tests.test_peft import LLAMA_TARGETS, check_lora

CHUNK = 5
CHUNKS = {"loss_chunk_tokens": CHUNK}
OFFLOAD = {"offload": "activations"}
BOTH = {**CHUNKS, **OFFLOAD}
# Each option with every feature: the same configurations with the loss in chunks (2 rows of 12 tokens a
# microbatch, 5 tokens a chunk: 2 positions of both rows, so 6 chunks a sequence, or 3 under cp=2, the last a
# part one), with the blocks' saved inputs held on the host (which needs recomputation), and with both.
SHAPES = [  # (name, kind, dp, tp, pp, cp, extras)
    ("llama-dp2", "llama", 2, 1, 1, 1, {"recompute": "full"}),
    # a vocabulary of 99 over 2 ranks: vocabulary-parallel chunks with a padding column; the head tied
    ("gpt2-tp2-sp", "gpt2", 1, 2, 1, 1, {"sequence_parallel": True, "recompute": "selective"}),
    # the head's own soft-capping on each vocabulary shard, a tied head
    ("gemma2-tp2", "gemma2", 1, 2, 1, 1, {"recompute": "full"}),
    ("granite-dp2-padded", "granite", 2, 1, 1, 1, {"padded": True, "recompute": "full"}),
    ("llama-cp2", "llama", 1, 1, 1, 2, {"recompute": "full"}),
    ("llama-dp2-pp2-1f1b", "llama", 2, 1, 2, 1, {"microbatches": 2, "recompute": "full"}),
    ("llama-tp2-pp2-gpipe", "llama", 1, 2, 2, 1, {"microbatches": 2, "schedule": "gpipe", "recompute": "selective"}),
    ("llama_deep-pp2-interleaved_1f1b", "llama_deep", 1, 1, 2, 1,
     {"microbatches": 2, "schedule": "interleaved_1f1b", "virtual_stages": 2, "recompute": "full"}),
    ("llama-pp2-zb_h1", "llama", 1, 1, 2, 1, {"microbatches": 2, "schedule": "zb_h1", "recompute": "full"}),
    ("llama-dp2-shard2", "llama", 2, 1, 1, 1, {"dp_shard": 2, "recompute": "full"}),
    # together: vocabulary-parallel, sequence-parallel chunks on a pipeline's last stage, selective recomputation
    ("gpt2-tp2-sp-pp2", "gpt2", 1, 2, 2, 1, {"sequence_parallel": True, "microbatches": 2, "recompute": "selective"}),
    ("llama-dp2-shard2-cp2", "llama", 2, 1, 1, 2, {"dp_shard": 2, "recompute": "selective"}),
]
LONG_CASES = [pytest.param(kind, dp, tp, pp, cp, {**extras, **options}, id=f"{label}-{name}")
              for label, options in (("chunks", CHUNKS), ("offload", OFFLOAD)) for name, kind, dp, tp, pp, cp, extras in SHAPES]
LONG_CASES += [pytest.param(kind, dp, tp, pp, cp, {**extras, **BOTH}, id=f"both-{name}")
               for name, kind, dp, tp, pp, cp, extras in SHAPES if name in ("gpt2-tp2-sp-pp2", "llama-dp2-shard2-cp2")]
# a frozen base: no block needs a gradient, FSDP's root reduces the head's all the same
LONG_CASES.append(pytest.param("llama", 2, 1, 1, 1, {**CHUNKS, "dp_shard": 2, "frozen": ("model.",)},
                               id="chunks-llama-dp2-shard2-frozen", marks=pytest.mark.core))


# the loss a chunk of positions at a time (loss_chunk_tokens): the task forward's own head code (step/loss_chunks.py)
@pytest.mark.composes((Feature.LOSS_CHUNKS, Feature.OFFLOAD), case="both-llama-dp2-shard2-cp2")
# each chunk's loss over the vocabulary shards
@pytest.mark.composes((Feature.LOSS_CHUNKS, Feature.TP), case="chunks-gemma2-tp2")
@pytest.mark.composes((Feature.LOSS_CHUNKS, Feature.SP), case="chunks-gpt2-tp2-sp")
@pytest.mark.composes((Feature.LOSS_CHUNKS, Feature.CP), case="chunks-llama-cp2")
@pytest.mark.composes(
    (Feature.LOSS_CHUNKS, Feature.DP), (Feature.LOSS_CHUNKS, Feature.RECOMPUTE), case="chunks-llama-dp2")
@pytest.mark.composes((Feature.LOSS_CHUNKS, Feature.PP_1F1B), case="chunks-llama-dp2-pp2-1f1b")
# inside FSDP's root gather
@pytest.mark.composes((Feature.LOSS_CHUNKS, Feature.DP_SHARD), case="chunks-llama-dp2-shard2")
@pytest.mark.composes((Feature.LOSS_CHUNKS, Feature.PP_ZB_H1), case="chunks-llama-pp2-zb_h1")
@pytest.mark.composes((Feature.LOSS_CHUNKS, Feature.PP_GPIPE), case="chunks-llama-tp2-pp2-gpipe")
@pytest.mark.composes((Feature.LOSS_CHUNKS, Feature.PP_INTERLEAVED), case="chunks-llama_deep-pp2-interleaved_1f1b")
# what recomputation keeps of each block, held on the host (offload="activations", memory/offload.py)
@pytest.mark.composes((Feature.OFFLOAD, Feature.TP), case="offload-gemma2-tp2")
# each tp rank's slice of the sequence
@pytest.mark.composes((Feature.OFFLOAD, Feature.SP), case="offload-gpt2-tp2-sp")
@pytest.mark.composes((Feature.OFFLOAD, Feature.CP), case="offload-llama-cp2")
# offload needs recomputation (refused without it)
@pytest.mark.composes((Feature.OFFLOAD, Feature.DP), (Feature.OFFLOAD, Feature.RECOMPUTE), case="offload-llama-dp2")
@pytest.mark.composes((Feature.OFFLOAD, Feature.PP_1F1B), case="offload-llama-dp2-pp2-1f1b")
@pytest.mark.composes((Feature.OFFLOAD, Feature.DP_SHARD), case="offload-llama-dp2-shard2")
@pytest.mark.composes((Feature.OFFLOAD, Feature.PP_ZB_H1), case="offload-llama-pp2-zb_h1")
@pytest.mark.composes((Feature.OFFLOAD, Feature.PP_GPIPE), case="offload-llama-tp2-pp2-gpipe")
@pytest.mark.composes((Feature.OFFLOAD, Feature.PP_INTERLEAVED), case="offload-llama_deep-pp2-interleaved_1f1b")
@pytest.mark.parametrize(("kind", "dp", "tp", "pp", "cp", "extras"), LONG_CASES)
def test_long_context_equals_plain_model(worlds, model_dirs, tmp_path, kind, dp, tp, pp, cp, extras):
    """The loss a chunk of positions at a time, the blocks' saved inputs held on the host, or both: loss,
    evaluation loss, every gradient, the norm and every weight after a step equal the plain model's; the head
    never made more than a chunk's logits; every offloaded tensor came back."""
    results = worlds.run(dp * tp * pp * cp, cases.parity, kind=kind, model_dir=model_dirs[kind],
                         out_dir=str(tmp_path / "hf"), dp=dp, tp=tp, pp=pp, cp=cp, **extras)
    check(results, tp=tp)
    microbatches = extras.get("microbatches", 1)
    if "loss_chunk_tokens" in extras:
        chunks = -(-12 // cp // (CHUNK // 2))  # 2 rows of 12 / cp positions, 2 positions a chunk
        for r in results:
            if r["head_rows"]:  # the last stage: a forward on no position, then each chunk, and again in backward
                assert max(r["head_rows"]) <= CHUNK, r["head_rows"]
                assert len(r["head_rows"]) == microbatches * (1 + 2 * chunks), r["head_rows"]
        assert any(r["head_rows"] for r in results)
    for r in results:
        if "offload" in extras:
            packed, unpacked = r["offloaded"]
            assert packed == unpacked >= microbatches, r["offloaded"]  # at least a block's input per microbatch
        else:
            assert r["offloaded"] is None


def test_long_context_refusals(model_dirs):
    """Refused before anything runs: a loss that is not a causal LM's, a count that is not one, offload without
    recomputation (nothing then is kept apart from the blocks' internals) or of something unknown. (The planner
    prices both.)"""
    vit = load("vit", model_dirs["vit"])
    with pytest.raises(ValueError, match=r"loss_chunk_tokens=8: ViTForImageClassification's loss is 'classification'"):
        check_parallel_config(vit, loss_chunk_tokens=8)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=rf"loss_chunk_tokens={bad!r} must be a positive integer"):
            qn_hf.ParallelConfig(loss_chunk_tokens=bad)
    with pytest.raises(ValueError, match=r"offload='activations' holds on the host what recomputation keeps .* set "
                                         r"recompute='full'"):
        qn_hf.ParallelConfig(offload="activations")
    with pytest.raises(ValueError, match=r"offload='weights'"):
        qn_hf.ParallelConfig(offload="weights", recompute="full")
    # the planner prices both (test_planner_memory.py): the offload's bytes leave the device for the host
    planner = Planner(CONFIGS["llama"], seq_len=12, micro_batch_size=2)
    assert planner.estimate(qn_hf.ParallelConfig(loss_chunk_tokens=CHUNK)).peak_bytes > 0
    kept = planner.estimate(qn_hf.ParallelConfig(recompute="full"))
    held = planner.estimate(qn_hf.ParallelConfig(recompute="full", offload="activations"))
    assert held.host_peak_bytes > 0 and kept.host_peak_bytes == 0
    assert held.peak_bytes + held.host_peak_bytes == kept.peak_bytes


def one_process_chunks(*, kind: str, model_dir: str) -> dict:
    torch.manual_seed(0)
    ref = load(kind, model_dir)
    batch = make_batch(kind, size=3, seed=3, padded=True)
    ref.train()
    ref_loss = ref(**batch).loss
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    out = {"ref_loss": ref_loss.item(), "losses": {}, "grad_errs": {}}
    for tokens in (1, 3, 7, 100):
        pm = qn_hf.parallelize(load(kind, model_dir), loss_chunk_tokens=tokens, mesh=mesh_for(1, 1))
        out["losses"][tokens] = pm.train_step(batch).item()
        out["grad_errs"][tokens] = max((p.grad - ref_grads[n]).abs().max().item() for n, p in pm.named_parameters())
        if tokens == 100:
            try:
                pm.train_step(batch, loss_fn=lambda outputs, b: outputs.logits.sum())
            except ValueError as e:
                out["loss_fn"] = str(e)
            # pm.logits computes no loss: the whole logits, as without the option
            ref.eval()
            out["logits_err"] = (pm.logits(batch) - ref(**model_inputs(batch)).logits).abs().max().item()
    # a loss_fn giving a loss per row (not a scalar) is refused as it was before the chunks' refactor
    pm = qn_hf.parallelize(load(kind, model_dir), mesh=mesh_for(1, 1))
    try:
        pm.train_step(batch, loss_fn=lambda outputs, b: outputs.logits.float().mean(dim=(1, 2)))
    except RuntimeError as e:
        out["per_row_loss_fn"] = str(e)
    return out


@pytest.mark.core  # the one check of each head's tail (soft-capping, a divisor, a tied head) at every chunk size
@pytest.mark.parametrize("kind", ["llama", "gemma2", "granite", "gpt2"])
def test_loss_chunks_one_process(worlds, model_dirs, kind):
    """One process, chunks of 1 to 100 tokens: the same loss and gradients as the plain model (chunks that
    divide the sequence, that do not, a position at a time, one for all); a loss_fn is refused."""
    (r,) = worlds.run(1, one_process_chunks, kind=kind, model_dir=model_dirs[kind])
    for tokens, loss in r["losses"].items():
        assert abs(loss - r["ref_loss"]) <= 1e-5 * abs(r["ref_loss"]), (tokens, r)
        assert r["grad_errs"][tokens] < 2e-6, (tokens, r)
    assert "a loss_fn with loss_chunk_tokens=100" in r.get("loss_fn", ""), r
    assert r["logits_err"] < 1e-5, r
    assert "per_row_loss_fn" in r, r


def _offloaded_llama(offload: ActivationOffload | None):
    torch.manual_seed(0)
    model = LlamaForCausalLM(CONFIGS["llama"])
    if offload is not None:
        apply_recompute(model, recompute="full", layers="model.layers",
                        rng=RngStreams(device=torch.device("cpu"), seeds={"shared": 0}), offload=offload)
    return model.train()


def test_offload_hands_back_what_it_saved():
    """Each block's input goes to the host in the forward and comes back once in the backward, the one
    before it prefetched; nothing stays held after the step; a forward left without its backward does not
    reach into the next step's chain; the gradients are the plain model's bit for bit."""
    offload = ActivationOffload()
    model, plain = _offloaded_llama(offload), _offloaded_llama(None)
    ids = torch.randint(3, 101, (2, 12), generator=torch.Generator().manual_seed(0))
    blocks = CONFIGS["llama"].num_hidden_layers
    offload.chained(lambda: model(input_ids=ids, labels=ids))()  # a forward whose backward never comes
    assert offload.packed == blocks and offload.host_bytes > 0
    offload.packed = offload.unpacked = offload.prefetched = 0
    loss = offload.chained(lambda: model(input_ids=ids, labels=ids).loss)()
    loss.backward()
    plain(input_ids=ids, labels=ids).loss.backward()
    assert offload.packed == offload.unpacked == blocks and offload.prefetched == blocks - 1
    grads = dict(plain.named_parameters())
    assert all(torch.equal(p.grad, grads[n].grad) for n, p in model.named_parameters())


def test_offload_refuses_a_saved_input_written_in_place():
    offload = ActivationOffload()
    x = torch.randn(4, requires_grad=True)
    y = x * 2
    with offload.hooks():
        z = y.sin()  # saves y, made by autograd and requiring a gradient: held on the host
    y.add_(1)
    with pytest.raises(RuntimeError, match=r"modified in place after it was saved \(version 0 -> 1\)"):
        z.sum().backward()


# generate computes no loss
@pytest.mark.composes(
    (Feature.LOSS_CHUNKS, Feature.ZERO), (Feature.LOSS_CHUNKS, Feature.LORA), (Feature.LOSS_CHUNKS, Feature.GENERATE),
    case="chunks")
# generate recomputes nothing
@pytest.mark.composes(
    (Feature.OFFLOAD, Feature.ZERO), (Feature.OFFLOAD, Feature.LORA), (Feature.OFFLOAD, Feature.GENERATE),
    case="offload")
@pytest.mark.parametrize("options", [CHUNKS, {**OFFLOAD, "recompute": "full"}], ids=["chunks", "offload"])
def test_long_context_with_lora_zero_and_generate(worlds, model_dirs, tmp_path, options):
    """LoRA (an adapter's gradients through the chunks or the offloaded inputs), ZeRO-1, zb_h1's weight passes at
    dp=2 x pp=2, and generate (no loss, no recomputation) with either option on: equal to PEFT's model."""
    results = worlds.run(4, peft_cases.lora_parity, kind="llama", model_dir=model_dirs["llama"],
                         out_dir=str(tmp_path / "adapter"), targets=LLAMA_TARGETS, dp=2, pp=2, microbatches=2,
                         schedule="zb_h1", zero=True, **options)
    check_lora(results, generated=True)


@pytest.mark.composes((Feature.LOSS_CHUNKS, Feature.BF16), case="chunks-dp2-zero-bf16")
@pytest.mark.composes((Feature.LOSS_CHUNKS, Feature.FP16), case="chunks-tp2-sp-fp16")
@pytest.mark.composes((Feature.OFFLOAD, Feature.BF16), case="offload-dp2-zero-bf16")
@pytest.mark.composes((Feature.OFFLOAD, Feature.FP16), case="offload-tp2-sp-fp16")
@pytest.mark.parametrize(("dp", "tp", "zero", "precision", "sp", "options"), [
    pytest.param(2, 1, True, "bf16", False, CHUNKS, id="chunks-dp2-zero-bf16"),
    pytest.param(1, 2, False, "fp16", True, CHUNKS, id="chunks-tp2-sp-fp16"),
    pytest.param(2, 1, True, "bf16", False, {**OFFLOAD, "recompute": "full"}, id="offload-dp2-zero-bf16"),
    pytest.param(1, 2, False, "fp16", True, {**OFFLOAD, "recompute": "selective"}, id="offload-tp2-sp-fp16"),
])
def test_long_context_in_mixed_precision(worlds, model_dirs, dp, tp, zero, precision, sp, options):
    """bf16 and fp16 (its loss scale): logits in the compute dtype a chunk at a time, the loss in float32; or the
    16-bit block inputs on the host. The same comparison as mixed precision's own with a hand-made reference."""
    results = worlds.run(dp * tp, optim_cases.mixed_parity, kind="llama", model_dir=model_dirs["llama"], dp=dp, tp=tp,
                         pp=1, microbatches=2, zero=zero, precision=precision, sequence_parallel=sp, **options)
    check_mixed(results, precision)


@pytest.mark.composes((Feature.LOSS_CHUNKS, Feature.EP_ALL_GATHER), case="chunks-all_gather")
@pytest.mark.composes((Feature.LOSS_CHUNKS, Feature.EP), case="chunks-all_to_all")
@pytest.mark.composes((Feature.OFFLOAD, Feature.EP_ALL_GATHER), case="offload-all_gather")
@pytest.mark.composes((Feature.OFFLOAD, Feature.EP), case="offload-all_to_all")
@pytest.mark.parametrize("dispatch", ["all_to_all", "all_gather"])
@pytest.mark.parametrize("options", [CHUNKS, {**OFFLOAD, "recompute": "full"}], ids=["chunks", "offload"])
def test_long_context_with_expert_parallelism(worlds, tmp_path, dispatch, options):
    """ep=2 over dp=2, either dispatch: the router's loss term beside the chunked loss, or the MoE blocks' inputs
    on the host; equal to the plain model."""
    results = worlds.run(2, ep_cases.ep_parity, model_type="qwen3_moe", out_dir=str(tmp_path / "hf"), dp=2, tp=1, pp=1,
                         ep=2, expert_dispatch=dispatch, **options)
    check_experts(results, ep=2)
