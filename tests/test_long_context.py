"""Long context within memory: the causal-LM loss a chunk of tokens at a time (``loss_chunk_tokens``)."""

from __future__ import annotations

import pytest
import torch

import qn_hf
from qn_hf.validation.checks import check_parallel_config
from tests import cases, ep_cases, optim_cases, peft_cases
from tests.cases import mesh_for
from tests.models import load, make_batch
from tests.test_expert_parallel import check_experts
from tests.test_mixed_precision import check_mixed
from tests.test_parity import check
from tests.test_peft import LLAMA_TARGETS, check_lora

# (kind, dp, tp, pp, cp, extras); 2 rows of 12 tokens a microbatch, 5 tokens a chunk: 2 positions of both rows,
# so a sequence is 6 chunks (or 3 of 6 positions under cp=2) and each dp/cp rank's last chunk is a part one
CHUNK_CASES = [
    pytest.param("llama", 2, 1, 1, 1, {}, id="llama-dp2"),
    # a vocabulary of 99 over 2 ranks: vocabulary-parallel chunks with a padding column; the head tied
    pytest.param("gpt2", 1, 2, 1, 1, {"sequence_parallel": True}, id="gpt2-tp2-sp"),
    # the head's own soft-capping on each vocabulary shard, a tied head
    pytest.param("gemma2", 1, 2, 1, 1, {}, id="gemma2-tp2"),
    pytest.param("granite", 2, 1, 1, 1, {"padded": True}, id="granite-dp2-padded"),
    pytest.param("llama", 1, 1, 1, 2, {}, id="llama-cp2"),
    pytest.param("llama", 2, 1, 2, 1, {"microbatches": 2}, id="llama-dp2-pp2-1f1b"),
    pytest.param("llama", 1, 2, 2, 1, {"microbatches": 2, "schedule": "gpipe"}, id="llama-tp2-pp2-gpipe"),
    pytest.param(
        "llama_deep",
        1,
        1,
        2,
        1,
        {"microbatches": 2, "schedule": "interleaved_1f1b", "virtual_stages": 2},
        id="llama_deep-pp2-interleaved_1f1b",
    ),
    pytest.param("llama", 1, 1, 2, 1, {"microbatches": 2, "schedule": "zb_h1"}, id="llama-pp2-zb_h1"),
    pytest.param("llama", 2, 1, 1, 1, {"dp_shard": 2, "recompute": "full"}, id="llama-dp2-shard2-full"),
    # together: vocabulary-parallel, sequence-parallel chunks on a pipeline's last stage, selective recomputation
    pytest.param(
        "gpt2",
        1,
        2,
        2,
        1,
        {"sequence_parallel": True, "microbatches": 2, "recompute": "selective"},
        id="gpt2-tp2-sp-pp2-selective",
    ),
    pytest.param("llama", 2, 1, 1, 2, {"dp_shard": 2, "recompute": "selective"}, id="llama-dp2-shard2-cp2-selective"),
]

CHUNK = 5


@pytest.mark.parametrize(("kind", "dp", "tp", "pp", "cp", "extras"), CHUNK_CASES)
def test_loss_chunks_equal_plain_model(worlds, model_dirs, tmp_path, kind, dp, tp, pp, cp, extras):
    """The loss a chunk of positions at a time: loss, evaluation loss, every gradient, the norm and every
    weight after a step equal the plain model's; the head never made more than a chunk's logits."""
    results = worlds.run(
        dp * tp * pp * cp,
        cases.parity,
        kind=kind,
        model_dir=model_dirs[kind],
        out_dir=str(tmp_path / "hf"),
        dp=dp,
        tp=tp,
        pp=pp,
        cp=cp,
        loss_chunk_tokens=CHUNK,
        **extras,
    )
    check(results, tp=tp)
    microbatches = extras.get("microbatches", 1)
    for r in results:
        if r["head_rows"]:  # the last stage: a forward on no position, then 2-row chunks, forward and backward
            assert max(r["head_rows"]) <= CHUNK, r["head_rows"]
            assert len(r["head_rows"]) > 3 * microbatches, r["head_rows"]
    assert any(r["head_rows"] for r in results)


def test_loss_chunks_refusals(model_dirs):
    """Refused before anything runs: a loss that is not a causal LM's, a count that is not one."""
    vit = load("vit", model_dirs["vit"])
    with pytest.raises(ValueError, match=r"loss_chunk_tokens=8: ViTForImageClassification's loss is 'classification'"):
        check_parallel_config(vit, loss_chunk_tokens=8)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=rf"loss_chunk_tokens={bad!r} must be a positive integer"):
            qn_hf.ParallelConfig(loss_chunk_tokens=bad)


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
    return out


@pytest.mark.parametrize("kind", ["llama", "gemma2", "granite", "gpt2"])
def test_loss_chunks_one_process(worlds, model_dirs, kind):
    """One process, chunks of 1 to 100 tokens: the same loss and gradients as the plain model (chunks that
    divide the sequence, that do not, a position at a time, one for all); a loss_fn is refused."""
    (r,) = worlds.run(1, one_process_chunks, kind=kind, model_dir=model_dirs[kind])
    for tokens, loss in r["losses"].items():
        assert abs(loss - r["ref_loss"]) <= 1e-5 * abs(r["ref_loss"]), (tokens, r)
        assert r["grad_errs"][tokens] < 2e-6, (tokens, r)
    assert "a loss_fn with loss_chunk_tokens=100" in r.get("loss_fn", ""), r


def test_loss_chunks_with_lora_zero_and_generate(worlds, model_dirs, tmp_path):
    """LoRA (an adapter's gradients through the chunks), ZeRO-1, zb_h1's weight passes at dp=2 x pp=2, and
    generate (which never computes the loss) with the chunked loss on: equal to PEFT's model."""
    results = worlds.run(
        4,
        peft_cases.lora_parity,
        kind="llama",
        model_dir=model_dirs["llama"],
        out_dir=str(tmp_path / "adapter"),
        targets=LLAMA_TARGETS,
        dp=2,
        pp=2,
        microbatches=2,
        schedule="zb_h1",
        zero=True,
        loss_chunk_tokens=CHUNK,
    )
    check_lora(results, generated=True)


@pytest.mark.parametrize(
    ("dp", "tp", "zero", "precision", "sp"),
    [(2, 1, True, "bf16", False), (1, 2, False, "fp16", True)],
    ids=["dp2-zero-bf16", "tp2-sp-fp16"],
)
def test_loss_chunks_in_mixed_precision(worlds, model_dirs, dp, tp, zero, precision, sp):
    """bf16 and fp16 (its loss scale): logits in the compute dtype a chunk at a time, the loss in float32; the
    same comparison as mixed precision's own with a hand-made reference."""
    results = worlds.run(
        dp * tp,
        optim_cases.mixed_parity,
        kind="llama",
        model_dir=model_dirs["llama"],
        dp=dp,
        tp=tp,
        pp=1,
        microbatches=2,
        zero=zero,
        precision=precision,
        sequence_parallel=sp,
        loss_chunk_tokens=CHUNK,
    )
    check_mixed(results, precision)


@pytest.mark.parametrize("dispatch", ["all_to_all", "all_gather"])
def test_loss_chunks_with_expert_parallelism(worlds, tmp_path, dispatch):
    """ep=2 over dp=2, either dispatch: the router's loss term beside the chunked loss; equal to the plain model."""
    results = worlds.run(
        2,
        ep_cases.ep_parity,
        model_type="qwen3_moe",
        out_dir=str(tmp_path / "hf"),
        dp=2,
        tp=1,
        pp=1,
        ep=2,
        expert_dispatch=dispatch,
        loss_chunk_tokens=CHUNK,
    )
    check_experts(results, ep=2)
