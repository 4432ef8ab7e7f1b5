"""Sharded data parallelism (``dp_shard``: FSDP2's ``fully_shard`` over groups of dp ranks, hybrid
across the groups) equals the plain Hugging Face model: loss, every gradient, the gradient norm and
every weight after one SGD step, alone and composed with tp, sp and recomputation."""

from __future__ import annotations

import pytest

from qn_hf.config.features import Feature, Status
from tests import cases, optim_cases, peft_cases, sharded_cases
from tests.models import load
from tests.test_parity import GRAD_ATOL, LOSS_RTOL, check
from tests.test_peft import LLAMA_TARGETS, LORA_ATOL

# (kind, dp, dp_shard, tp, sequence_parallel, recompute, cp)
SHARDED_CASES = [
    ("llama", 2, 2, 1, False, None, 1),
    ("llama", 4, 2, 1, False, None, 1),  # hybrid: two groups of two, all-reduced across
    ("llama", 2, 2, 2, True, None, 1),
    ("llama", 2, 2, 1, False, None, 2),  # sharded over dp_shard x cp = 4 ranks
]
# under make test-all
SHARDED_CASES_LONG = [
    ("llama", 4, 4, 1, False, None, 1),
    ("gpt2", 2, 2, 2, False, None, 1),
    ("gpt2", 2, 2, 1, False, "full", 1),
    ("llama", 8, 8, 1, False, None, 1),
]


def _ids(case) -> str:
    kind, dp, dp_shard, tp, sp, recompute, cp = case
    return (f"{kind}-dp{dp}-shard{dp_shard}-tp{tp}" + ("-sp" if sp else "") + (f"-{recompute}" if recompute else "")
            + (f"-cp{cp}" if cp > 1 else ""))


@pytest.mark.composes((Feature.DP_SHARD, Feature.RECOMPUTE), case="gpt2-dp2-shard2-tp1-full")
@pytest.mark.composes((Feature.DP_SHARD, Feature.TP), case="gpt2-dp2-shard2-tp2")
# cp ranks hold the same weights and sum their gradients as dp ranks do: sharded over dp_shard x cp
@pytest.mark.composes((Feature.DP_SHARD, Feature.CP), case="llama-dp2-shard2-tp1-cp2")
@pytest.mark.composes((Feature.DP_SHARD, Feature.SP), case="llama-dp2-shard2-tp2-sp")
@pytest.mark.composes((Feature.DP_SHARD, Feature.DP), case="llama-dp4-shard2-tp1")
@pytest.mark.parametrize("case", SHARDED_CASES + [pytest.param(c, marks=pytest.mark.long) for c in SHARDED_CASES_LONG],
                         ids=_ids)
def test_sharded_data_parallel_equals_plain_model(worlds, model_dirs, tmp_path, case):
    kind, dp, dp_shard, tp, sp, recompute, cp = case
    results = worlds.run(dp * tp * cp, cases.parity, kind=kind, model_dir=model_dirs[kind],
                         out_dir=str(tmp_path / "hf"), dp=dp, tp=tp, cp=cp, dp_shard=dp_shard, sequence_parallel=sp,
                         recompute=recompute, padded=kind != "vit", seq=16 if cp > 1 else 12)
    check(results, tp=tp)
    for r in results:  # each rank stores its rows of every tensor: 1/(dp_shard x cp) (rows do not split evenly)
        assert r["stored"] * dp_shard * cp <= r["local_total"] * 1.25, r
        assert r["stored"] * dp_shard * cp >= r["local_total"] * 0.75, r


# (kind, dp, dp_shard, tp, pp, schedule, virtual_stages, dp_shard_gather): reduced once per step
# after the last backward (and ZB-H1's last weight pass)
PIPELINE_CASES = [
    ("llama", 2, 2, 1, 2, "1f1b", 1, "step"),
    ("llama", 2, 2, 1, 2, "1f1b", 1, "microbatch"),  # the blocks gathered again for each microbatch
    ("gpt2", 2, 2, 1, 2, "gpipe", 1, "step"),  # the embedding tied across stages: its rows summed over the pair
    ("llama", 2, 2, 1, 2, "interleaved_1f1b", 2, "step"),  # FSDP's root sees both chunks' blocks
    ("llama", 2, 2, 1, 2, "zb_h1", 1, "step"),  # weight passes accumulate into the gathered weights
]
# under make test-all
PIPELINE_CASES_LONG = [
    ("gemma4", 2, 2, 1, 2, "1f1b", 1, "step"),  # per-layer embeddings on every stage: rows summed over pp
    ("llama", 4, 2, 1, 2, "1f1b", 1, "step"),  # hybrid
    ("gpt2", 2, 2, 2, 2, "1f1b", 1, "microbatch"),  # dp_shard x tp x pp
]


# each stage's own FSDP groups, reduced once per step after its last backward and weight pass
@pytest.mark.composes((Feature.DP_SHARD, Feature.PP_GPIPE), case="gpt2-dp2-shard2-tp1-pp2-gpipe-step")
@pytest.mark.composes((Feature.DP_SHARD, Feature.PP_1F1B), case="llama-dp2-shard2-tp1-pp2-1f1b-step")
@pytest.mark.composes((Feature.DP_SHARD, Feature.PP_INTERLEAVED), case="llama-dp2-shard2-tp1-pp2-interleaved_1f1b-step")
@pytest.mark.composes((Feature.DP_SHARD, Feature.PP_ZB_H1), case="llama-dp2-shard2-tp1-pp2-zb_h1-step")
@pytest.mark.parametrize(("kind", "dp", "dp_shard", "tp", "pp", "schedule", "virtual", "gather"),
                         PIPELINE_CASES + [pytest.param(*c, marks=pytest.mark.long) for c in PIPELINE_CASES_LONG],
                         ids=[f"{k}-dp{d}-shard{s}-tp{t}-pp{p}-{sch}-{g}"
                              for k, d, s, t, p, sch, _, g in PIPELINE_CASES + PIPELINE_CASES_LONG])
def test_sharded_data_parallel_with_pipeline_equals_plain_model(worlds, model_dirs, tmp_path, kind, dp, dp_shard, tp,
                                                                pp, schedule, virtual, gather):
    results = worlds.run(dp * tp * pp, cases.parity, kind=kind, model_dir=model_dirs[kind],
                         out_dir=str(tmp_path / "hf"), dp=dp, tp=tp, pp=pp, dp_shard=dp_shard, schedule=schedule,
                         virtual_stages=virtual, microbatches=2 * pp, padded=True, dp_shard_gather=gather)
    # Gemma 4's tied, scaled embedding: tp=1 here, but FSDP sums its rows in another order (test_every_stage.py)
    check(results, tp=tp, grad_atol=1e-5 if kind == "gemma4" else GRAD_ATOL)
    for r in results:
        assert r["stored"] * dp_shard <= r["local_total"] * 1.25, r
        assert r["stored"] * dp_shard >= r["local_total"] * 0.75, r


def test_gathering_per_microbatch_is_refused_with_weight_passes():
    from qn_hf.config.parallel_config import ParallelConfig

    with pytest.raises(ValueError, match="dp_shard_gather='microbatch' with schedule='zb_h1'"):
        ParallelConfig.from_keywords(dp=2, pp=2, dp_shard=2, microbatches=2, schedule="zb_h1",
                                     dp_shard_gather="microbatch")
    with pytest.raises(ValueError, match="dp_shard_gather"):
        ParallelConfig.from_keywords(dp=2, pp=2, dp_shard=2, microbatches=2, dp_shard_gather="layer")


# FSDP's own mixed precision: float32 sharded parameters (the masters), gathered in the compute dtype
@pytest.mark.composes((Feature.DP_SHARD, Feature.BF16), case="bf16", status=Status.EQUIVALENT)
@pytest.mark.composes((Feature.DP_SHARD, Feature.FP16), case="fp16", status=Status.EQUIVALENT)
@pytest.mark.long
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_sharded_data_parallel_in_mixed_precision_trains_like_one_process(worlds, model_dirs, precision):
    """30 AdamW steps in bf16 (fp16) at dp=4 with hybrid sharding (two groups of two) follow one
    process's mixed-precision run (itself compared with the plain model by hand) within 1%: FSDP
    keeps float32 shards as the masters and computes in the low precision, as qn_hf's own masters do."""
    kw = dict(model_dir=model_dirs["llama"], precision=precision, steps=30)
    [one] = worlds.run(1, cases.mixed_precision_steps, dp=1, dp_shard=1, **kw)
    sharded = worlds.run(4, cases.mixed_precision_steps, dp=4, dp_shard=2, **kw)
    assert sharded[0]["dtypes"] == ["torch.float32"], sharded[0]["dtypes"]  # the sharded parameters are the masters
    assert one["losses"][-1] < one["losses"][0] * 0.9, one["losses"]  # it learns
    for r in sharded:
        assert r["losses"] == sharded[0]["losses"]
        for ours, theirs in zip(r["losses"], one["losses"]):
            assert abs(ours - theirs) <= 0.01 * abs(theirs), (r["losses"], one["losses"])


@pytest.mark.composes((Feature.DP_SHARD, Feature.LORA), (Feature.DP_SHARD, Feature.GENERATE))
def test_sharded_data_parallel_with_lora_equals_peft(worlds, model_dirs, tmp_path):
    """LoRA on a dp_shard=2 model: the frozen base sharded, the adapters trained, equal to peft's one
    process; generate after the step gives peft's tokens, save_pretrained peft's adapter."""
    results = worlds.run(2, peft_cases.lora_parity, kind="llama", model_dir=model_dirs["llama"],
                         out_dir=str(tmp_path / "adapter"), targets=LLAMA_TARGETS, dp=2, dp_shard=2)
    assert len({r["loss"] for r in results}) == 1
    for r in results:
        assert abs(r["loss"] - r["ref_loss"]) <= LOSS_RTOL * abs(r["ref_loss"]), r
        assert r["grad_err"] < GRAD_ATOL, r
        assert r["frozen_with_grad"] == [] and r["trained"] > 0 and r["base_moved"] == 0.0, r
        assert r["lora_err"] < LORA_ATOL < r["lora_moved"], r
        assert r["merged_err"] < LORA_ATOL, r
        assert r["generated"] is True, r


@pytest.mark.parametrize("pp", [1, 2])
def test_sharded_data_parallel_accumulates_inside_no_sync(worlds, model_dirs, pp):
    """``pm.no_sync()`` keeps FSDP's gradients unreduced; the next step reduces both batches' at once
    (under pp, the stage's gradients kept whole past the step's end, then reduced once)."""
    for r in worlds.run(2 * pp, cases.accumulation, kind="llama", model_dir=model_dirs["llama"], dp=2, dp_shard=2,
                        pp=pp):
        assert r["grad_err"] < GRAD_ATOL, r
        assert r["deferred"], r


def _resume_everywhere(worlds, model_dirs, tmp_path, *, saved_at: tuple[int, ...], meshes, kind: str = "llama") -> None:
    """Two AdamW steps at ``saved_at`` (dp, tp, dp_shard[, pp]), a checkpoint with the optimizer, a
    third step; each of ``meshes`` (dp, tp, dp_shard, zero[, pp]) loads the checkpoint and takes the
    third step: the same loss and weights."""
    dp, tp, dp_shard, pp = (*saved_at, 1)[:4]
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "uninterrupted")
    common = dict(kind=kind, model_dir=model_dirs[kind], ckpt=ckpt, precision=None)
    loss = worlds.run(dp * tp * pp, optim_cases.save_and_continue, out=out, dp=dp, tp=tp, pp=pp, zero=False,
                      dp_shard=dp_shard, **common)[0]
    expected = dict(load(kind, out).named_parameters())
    for mesh in meshes:
        dp, tp, dp_shard, zero, pp = (*mesh, 1)[:5]
        resumed = str(tmp_path / f"resumed-{dp}-{tp}-{dp_shard}-{zero}-{pp}")
        r = worlds.run(dp * tp * pp, optim_cases.resume, out=resumed, dp=dp, tp=tp, pp=pp, zero=zero,
                       dp_shard=dp_shard, **common)[0]
        assert r["step"] == 2
        assert abs(r["loss"] - loss) <= 1e-5 * loss, (mesh, r, loss)
        got = dict(load(kind, resumed).named_parameters())
        err = max((got[n] - p).abs().max().item() for n, p in expected.items())
        assert err <= 2e-5, (mesh, err)


def test_sharded_checkpoint_resumes_at_other_meshes(worlds, model_dirs, tmp_path):
    """Saved at dp_shard=2 (each rank writes its rows and their AdamW moments, as ZeRO-1's pieces):
    resumed at the same mesh, at tp=2, at dp=2 with ZeRO-1 and hybrid at dp=4 x dp_shard=2."""
    _resume_everywhere(worlds, model_dirs, tmp_path, saved_at=(2, 1, 2),
                       meshes=[(2, 1, 2, False), (1, 2, 1, False), (2, 1, 1, True), (4, 1, 2, False)])


def test_sharded_pipeline_checkpoint_resumes_at_other_meshes(worlds, model_dirs, tmp_path):
    """GPT-2 saved at dp=2 x dp_shard=2 x pp=2 (each stage's first group writes its rows; the embedding
    tied across stages once): resumed at the same mesh, in one process, at pp=2 without dp_shard and
    at dp_shard=2 without a pipeline."""
    _resume_everywhere(worlds, model_dirs, tmp_path, kind="gpt2", saved_at=(2, 1, 2, 2),
                       meshes=[(2, 1, 2, False, 2), (1, 1, 1, None), (1, 1, 1, False, 2), (2, 1, 2, False)])


@pytest.mark.long
def test_checkpoint_resumes_into_dp_shard(worlds, model_dirs, tmp_path):
    """And back: saved at tp=2, resumed at dp_shard=2 and at dp_shard=4 (each rank keeps its rows of
    what it reads; 101 vocabulary rows over 4 leave the last rank 23 of 26)."""
    _resume_everywhere(worlds, model_dirs, tmp_path, saved_at=(1, 2, 1), meshes=[(2, 1, 2, False), (4, 1, 4, False)])


@pytest.mark.long
def test_checkpoint_saved_at_dp_shard_4_resumes_at_other_meshes(worlds, model_dirs, tmp_path):
    """Saved at dp_shard=4 (the rows of uneven tensors padded on the last rank, not written): resumed at
    the same mesh, at tp=2 and at dp=2."""
    _resume_everywhere(worlds, model_dirs, tmp_path, saved_at=(4, 1, 4),
                       meshes=[(4, 1, 4, False), (1, 2, 1, False), (2, 1, 1, False)])


# the experts in FSDP groups of their own over the ranks holding the same experts
@pytest.mark.composes((Feature.DP_SHARD, Feature.EP))
@pytest.mark.parametrize(("dp", "dp_shard", "tp", "ep", "pp"),
                         [(4, 2, 1, 2, 1), pytest.param(2, 2, 2, 2, 1, marks=pytest.mark.long),
                          pytest.param(4, 2, 1, 2, 2, marks=pytest.mark.long)],
                         ids=["dp4-shard2-ep2", "dp2-shard2-tp2-ep2", "dp4-shard2-ep2-pp2"])
def test_sharded_data_parallel_with_expert_parallelism_equals_plain_model(worlds, tmp_path, dp, dp_shard, tp, ep, pp):
    """Experts sharded over ep get FSDP groups of their own over the ranks holding the same experts
    (their gradients summed there, as without dp_shard); the rest is sharded over dp_shard. Under a
    pipeline the experts' groups are gathered once a step, as the blocks are."""
    from tests.ep_cases import ep_parity
    from tests.test_expert_parallel import check_experts

    results = worlds.run(dp * tp * pp, ep_parity, model_type="qwen3_moe", out_dir=str(tmp_path / "hf"), dp=dp, tp=tp,
                         pp=pp, ep=ep, dp_shard=dp_shard, microbatches=2 if pp > 1 else 1)
    check_experts(results, ep=ep)


@pytest.mark.long
def test_sharded_expert_checkpoint_resumes_at_other_meshes(worlds, tmp_path):
    """Saved at dp=4 x dp_shard=2 with ep=2 (the experts' rows written by each holder of a block, the
    rest by the first group) and resumed at ep=2 without dp_shard and at dp_shard=2 x ep=2 on two
    ranks: each step's loss and weights are the uninterrupted run's."""
    from tests import ep_cases
    from tests.test_expert_parallel import WEIGHT_ATOL

    config = ep_cases.moe_config("qwen3_moe")
    model_dir, ckpt, plain = str(tmp_path / "model"), str(tmp_path / "ckpt"), str(tmp_path / "uninterrupted")
    ep_cases.build(config, seed=0).save_pretrained(model_dir)
    common = dict(model_dir=model_dir, tp=1, pp=1, ep=2)
    expected = worlds.run(4, ep_cases.ep_checkpoint_run, dp=4, dp_shard=2, load=None, steps=[1, 2], save=ckpt,
                          export=plain, **common)[0]
    model_class = ep_cases.model_class(config)
    for dp, dp_shard in [(2, 1), (2, 2)]:
        out = str(tmp_path / f"resumed-{dp}-{dp_shard}")
        [loss] = worlds.run(dp, ep_cases.ep_checkpoint_run, dp=dp, dp_shard=dp_shard, load=ckpt, steps=[2], save=None,
                            export=out, **common)[0]
        assert abs(loss - expected[1]) <= LOSS_RTOL * abs(expected[1]), (dp, dp_shard, loss, expected)
        resumed = dict(model_class.from_pretrained(f"{out}-2").named_parameters())
        reference = dict(model_class.from_pretrained(f"{plain}-2").named_parameters())
        err = max((resumed[n] - p).abs().max().item() for n, p in reference.items())
        assert err < WEIGHT_ATOL, (dp, dp_shard, err)


TRAFFIC_CASES = [  # dp, dp_shard, pp, microbatches, dp_shard_gather
    (2, 2, 1, 2, "step"),  # FSDP's own hooks: every microbatch gathers and reduces
    (2, 2, 2, 4, "step"),  # a pipeline stage: one all-gather and one reduce-scatter per group per step
    (2, 2, 2, 4, "microbatch"),  # blocks freed after each forward: gathered again before the next use
    (4, 2, 1, 1, "step"),  # hybrid: the reduced shards all-reduced across the two groups
]


@pytest.mark.parametrize(("dp", "dp_shard", "pp", "microbatches", "gather"), TRAFFIC_CASES)
def test_traffic_per_step_is_theory(worlds, model_dirs, dp, dp_shard, pp, microbatches, gather):
    """What CommMeter counts on the dp_shard (and dp_replicate) groups in one step, call for call and
    byte for byte, against what the groups must move. Each group's all-gather input is this rank's
    shard of its parameters (rows padded to ceil(rows / dp_shard)), a reduce-scatter's input the whole
    gradient (dp_shard times that), both float32 here. Without a pipeline the root group (embedding,
    norm, head) is gathered once per microbatch and each block twice (forward, and again for backward
    after FSDP freed it), every group reduced per microbatch; a stage gathers each group once per
    step and reduces it once; gathering per microbatch, its blocks twice per microbatch (freed after
    each forward and each backward)."""
    for r in worlds.run(dp * pp, sharded_cases.step_traffic, kind="llama", model_dir=model_dirs["llama"], dp=dp,
                        dp_shard=dp_shard, pp=pp, microbatches=microbatches, gather=gather):
        root, blocks = r["unit_bytes"][0], r["unit_bytes"][1:]
        if pp == 1:
            gathers = (microbatches * (1 + 2 * len(blocks)), microbatches * (root + 2 * sum(blocks)))
            reduces = microbatches
        else:
            per_block = 1 if gather == "step" else 2 * microbatches
            gathers = (1 + per_block * len(blocks), root + per_block * sum(blocks))
            reduces = 1
        expected = {
            "dp_shard:all_gather_into_tensor": gathers,
            "dp_shard:reduce_scatter_tensor": (reduces * len(r["unit_bytes"]), reduces * dp_shard * sum(r["unit_bytes"])),
        }
        if dp > dp_shard:
            expected["dp_replicate:all_reduce"] = (reduces * len(r["unit_bytes"]), reduces * sum(r["unit_bytes"]))
        assert {k: tuple(v) for k, v in r["totals"].items()} == expected, r


def test_forward_only_passes_leave_the_weights_sharded(worlds, model_dirs, tmp_path):
    for r in worlds.run(4, cases.sharded_after_forward_only, model_dir=model_dirs["gpt2"], tmp=str(tmp_path / "ckpt")):
        assert r["sharded"] == {"eval_step": True, "logits": True, "generate": True}, r
        assert r["loaded"] == 1, r
        assert len(r["files"]) == 2 and all(r["files"].values()), r  # the first group's two ranks write
