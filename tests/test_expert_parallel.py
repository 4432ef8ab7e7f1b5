"""Expert parallelism (``ep``) equals the plain model; its checkpoints move between ep degrees; misuse
is refused before any communication."""

from __future__ import annotations

import pytest
import torch

from qn_hf import convert
from qn_hf.check.run import build, model_class
from qn_hf.config.features import Feature, Status
from qn_hf.peft.lora import unwrap_peft
from tests import ep_cases
from tests.cases import error_message
from tests.ep_cases import moe_config
from tests.peft_cases import expert_lora_model

LOSS_RTOL = 1e-5
WEIGHT_ATOL = 2e-5
# bf16 weights against the unsharded optimizer: the clipping norm is summed from ZeRO's pieces in
# another order, which can move a float32 master by its last bit and flip a bf16 rounding: one bf16
# step at |w| < 0.125 (the losses and norms stay equal)
BF16_WEIGHT_ATOL = 2**-9


MOE_MODELS = ("mixtral", "qwen3_moe", "olmoe", "deepseek_v3")
MESHES = [(2, 1, 1, 2, 1), (2, 2, 1, 4, 1), (2, 1, 2, 2, 2)]  # dp, tp, pp, ep, microbatches
EP_CASES = [(model_type, *mesh) for mesh in MESHES for model_type in MOE_MODELS] + [
    ("qwen3_moe", 1, 2, 1, 2, 1),  # the ep group is the tp group: tokens split over tp, experts over tp
    ("deepseek_v3", 1, 4, 1, 2, 1),  # ep inside tp: two ranks hold each expert block
    ("qwen2_moe", 2, 1, 1, 2, 1),  # a shared expert with its sigmoid gate
]


def check_experts(results: list[dict], *, ep: int) -> None:
    first = results[0]
    for r in results:
        assert abs(r["loss"] - r["ref_loss"]) <= LOSS_RTOL * abs(r["ref_loss"]), r
        assert r["grad_err"] < 2e-6, r
        assert abs(r["norm"] - r["ref_norm"]) <= 1e-5 * r["ref_norm"], r
        assert r["expert_params"] > 0 and r["expert_rows"] == [first["expert_counts"].__len__() // ep], r
    assert first["weight_err"] <= WEIGHT_ATOL and first["moved"] > 1e-3, first


@pytest.mark.composes((Feature.EP, Feature.DP), case="mixtral-2-1-1-2-1")
@pytest.mark.composes((Feature.PP_1F1B, Feature.EP), case="mixtral-2-1-2-2-2")
@pytest.mark.composes((Feature.TP, Feature.EP), case="mixtral-2-2-1-4-1")
@pytest.mark.parametrize(("model_type", "dp", "tp", "pp", "ep", "microbatches"), EP_CASES)
def test_expert_parallel_equals_plain_model(worlds, tmp_path, model_type, dp, tp, pp, ep, microbatches):
    results = worlds.run(dp * tp * pp, ep_cases.ep_parity, model_type=model_type, out_dir=str(tmp_path / "hf"),
                         dp=dp, tp=tp, pp=pp, ep=ep, microbatches=microbatches)
    check_experts(results, ep=ep)
    assert all(r["ep_gathers"] == 0 for r in results), results  # the default: the all-to-all


@pytest.mark.composes((Feature.PP_GPIPE, Feature.EP))
@pytest.mark.long
def test_expert_parallel_with_gpipe_equals_plain_model(worlds, tmp_path):
    """The composition table's ep x gpipe row: dp=2 x pp=2 with GPipe, experts over ep=2."""
    results = worlds.run(4, ep_cases.ep_parity, model_type="mixtral", out_dir=str(tmp_path / "hf"), dp=2, tp=1, pp=2,
                         ep=2, microbatches=2, schedule="gpipe")
    check_experts(results, ep=2)


@pytest.mark.parametrize(("model_type", "skew", "dp", "tp", "ep"), [
    ("deepseek_v3", "empty_rank", 2, 1, 2),
    ("mixtral", "uneven", 1, 2, 2),
])
def test_expert_parallel_with_skewed_routing(worlds, tmp_path, model_type, skew, dp, tp, ep):
    results = worlds.run(dp * tp, ep_cases.ep_parity, model_type=model_type, out_dir=str(tmp_path / "hf"),
                         dp=dp, tp=tp, pp=1, ep=ep, skew=skew)
    check_experts(results, ep=ep)
    counts = results[0]["expert_counts"]
    if skew == "empty_rank":  # every token at experts 0 and 1: the second ep rank received no rows
        assert counts[2] == counts[3] == 0 and counts[0] > 0, counts
    else:
        assert max(counts) >= 4 * max(min(counts), 1), counts


@pytest.mark.parametrize(("model_type", "dp", "tp", "ep", "padded"), [
    ("mixtral", 2, 1, 2, True),
    ("qwen3_moe", 2, 2, 4, False),
    ("olmoe", 2, 1, 2, True),
])
def test_router_aux_loss_equals_plain_model(worlds, tmp_path, model_type, dp, tp, ep, padded):
    """output_router_logits=True: transformers' load-balancing term, pooled over every layer and the
    whole batch (dp ranks included, padding left out), is in the loss and its gradient."""
    overrides = {"output_router_logits": True, "router_aux_loss_coef": 0.5}  # large: a wrong term shows
    results = worlds.run(dp * tp, ep_cases.ep_parity, model_type=model_type, out_dir=str(tmp_path / "hf"),
                         dp=dp, tp=tp, pp=1, ep=ep, overrides=overrides, padded=padded)
    check_experts(results, ep=ep)


def test_expert_parallel_with_fewer_tokens_than_tp_ranks(worlds, tmp_path):
    """3 tokens over tp=4: the last tp rank's share is empty; it still takes part in every exchange."""
    results = worlds.run(4, ep_cases.ep_parity, model_type="mixtral", out_dir=str(tmp_path / "hf"), dp=1, tp=4,
                         pp=1, ep=2, per_rank=1, seq=3)
    check_experts(results, ep=2)


@pytest.mark.composes((Feature.TP, Feature.RECOMPUTE), case="deepseek_v3-2-2-1-4-selective")
@pytest.mark.composes((Feature.PP_1F1B, Feature.RECOMPUTE), case="mixtral-2-1-2-2-selective")
@pytest.mark.composes((Feature.EP, Feature.RECOMPUTE), (Feature.DP, Feature.RECOMPUTE), case="qwen3_moe-2-1-1-2-full")
@pytest.mark.parametrize(("model_type", "dp", "tp", "pp", "ep", "recompute"), [
    ("qwen3_moe", 2, 1, 1, 2, "full"),
    ("deepseek_v3", 2, 2, 1, 4, "selective"),
    ("mixtral", 2, 1, 2, 2, "selective"),
])
def test_expert_parallel_with_recomputation(worlds, tmp_path, model_type, dp, tp, pp, ep, recompute):
    """Recomputing a block in backward runs its all-to-alls again, on every rank of the ep group alike."""
    results = worlds.run(dp * tp * pp, ep_cases.ep_parity, model_type=model_type, out_dir=str(tmp_path / "hf"),
                         dp=dp, tp=tp, pp=pp, ep=ep, microbatches=max(pp, 1), recompute=recompute)
    check_experts(results, ep=ep)


def test_expert_parallel_checkpoints_move_between_ep_degrees(worlds, tmp_path):
    """Saved at ep=2 (dp=2), resumed at ep=4 (dp x tp = 2 x 2) and saved again, resumed at ep=1: each
    next step equals the uninterrupted ep=2 run; qn-hf-convert to-hf equals save_pretrained."""
    model_dir = str(tmp_path / "model")
    config = moe_config("qwen3_moe")
    build(config, seed=0).save_pretrained(model_dir)
    first, second = str(tmp_path / "ckpt-ep2"), str(tmp_path / "ckpt-ep4")
    plain = str(tmp_path / "uninterrupted")
    expected = worlds.run(2, ep_cases.ep_checkpoint_run, model_dir=model_dir, dp=2, tp=1, pp=1, ep=2,
                          load=None, steps=[1, 2, 3], save=first, export=plain)[0]
    assert convert.main(["to-hf", first, str(tmp_path / "to-hf")]) == 0
    exported = model_class(config).from_pretrained(str(tmp_path / "to-hf")).state_dict()
    gathered = model_class(config).from_pretrained(plain + "-1").state_dict()
    assert exported.keys() == gathered.keys() and all(torch.equal(exported[k], gathered[k]) for k in gathered)
    runs = [((2, 2, 1, 4), first, [2, 3], second), ((1, 1, 1, 1), second, [3], None), ((1, 1, 2, 1), first, [2], None)]
    for mesh, source, steps, save in runs:
        assert_resumes_like(worlds, tmp_path, config, model_dir=model_dir, plain=plain, expected=expected, mesh=mesh,
                            source=source, steps=steps, save=save)


def assert_resumes_like(worlds, tmp_path, config, *, model_dir: str, plain: str, expected: list[float],
                        mesh: tuple[int, int, int, int], source: str, steps: list[int], save: str | None = None,
                        zero: bool | None = None) -> None:
    """``source`` resumed at ``mesh`` (dp, tp, pp, ep) runs ``steps`` (``ep_checkpoint_run``): each step's
    loss and exported weights equal the uninterrupted run's (``expected`` losses, ``plain``'s exports)."""
    dp, tp, pp, ep = mesh
    out = str(tmp_path / f"resumed-{dp}{tp}{pp}{ep}")
    losses = worlds.run(dp * tp * pp, ep_cases.ep_checkpoint_run, model_dir=model_dir, dp=dp, tp=tp, pp=pp, ep=ep,
                        load=source, steps=steps, save=save, export=out, zero=zero)[0]
    for step, loss in zip(steps, losses):
        assert abs(loss - expected[step - 1]) <= LOSS_RTOL * abs(expected[step - 1]), (mesh, step)
        resumed = dict(model_class(config).from_pretrained(f"{out}-{step}").named_parameters())
        reference = dict(model_class(config).from_pretrained(f"{plain}-{step}").named_parameters())
        err = max((resumed[n] - p).abs().max().item() for n, p in reference.items())
        assert err < WEIGHT_ATOL, f"resumed at {mesh}, step {step}: max weight difference {err}"


def _meta(model_type: str, **overrides):
    from transformers import AutoModelForCausalLM

    config = moe_config(model_type, **overrides)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _refusal(model, **kwargs) -> str:
    from qn_hf.validation.checks import check_parallel_config

    return error_message(lambda: check_parallel_config(model, microbatches=1, schedule="1f1b",
                                                       **{"dp": 2, "tp": 1, "pp": 1, "ep": 2, **kwargs}))


def test_expert_parallel_refusals():
    assert _refusal(_meta("mixtral")) == "no error"
    assert "ep=3 must divide dp*tp = 2*2 = 4" in _refusal(_meta("mixtral"), tp=2, ep=3)
    assert "ep=4 and tp=" not in _refusal(_meta("mixtral"), dp=2, tp=2, ep=4)
    assert "ep=2 and tp=3" in _refusal(_meta("mixtral"), dp=2, tp=3, ep=2)
    message = _refusal(_meta("mixtral", num_local_experts=6), dp=4, ep=4)
    assert "ep=4 must divide the 6 experts of model.layers.0.mlp.experts" in message, message
    dense = _refusal(_meta("llama"))
    assert "ep=2: llama has no mixture-of-experts layers; use ep=1" in dense, dense
    assert _refusal(_meta("llama4_text")) == "no error"  # experts stacked on dim 0 (stacked.py)
    odd = _meta("mixtral")
    odd.model.layers[0].mlp.experts = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(4)])
    unfused = _refusal(odd)
    assert "experts model.layers.0.mlp.experts (ModuleList) are neither transformers' fused experts form" in unfused, \
        unfused
    assert _refusal(_meta("mixtral"), cp=2) == "no error"  # ep x cp composes
    assert "ep=0 must be a positive integer" in _refusal(_meta("mixtral"), ep=0)
    # transformers' own ep plan is read: the experts it dispatches to must be those ep shards
    forged = _meta("mixtral")
    forged.config.base_model_ep_plan = {"layers.*.mlp.gate": "ep_dispatch_experts"}
    message = _refusal(forged)
    assert "base_model_ep_plan of mixtral names model.layers.0.mlp.gate as experts, which qn_hf does not" in message, \
        message
    lora, _ = unwrap_peft(expert_lora_model("qwen3_moe"))  # as parallelize sees it: LoRA layers in place
    assert _refusal(lora) == "no error"  # the LoRA wrapper stands where transformers' plan names the experts


def test_all_gather_dispatch_refusals():
    gathered = {"expert_dispatch": "all_gather"}
    message = _refusal(_meta("llama"), ep=1, **gathered)
    assert "expert_dispatch='all_gather' with ep=1: no experts live on other ranks" in message, message
    assert "expert_dispatch='all_scatter' is unknown" in _refusal(_meta("mixtral"), expert_dispatch="all_scatter")
    assert _refusal(_meta("llama4_text"), **gathered) == "no error"  # stacked experts: equal all-to-alls
    eager = _meta("mixtral")
    eager.set_experts_implementation("eager")  # reads the device per expert; a model's own need not skip sentinels
    message = _refusal(eager, **gathered)
    assert "model.layers.0.mlp.experts runs the 'eager' experts implementation" in message, message
    assert _refusal(_meta("mixtral"), **gathered) == "no error"  # grouped_mm, transformers' default
    batched = _meta("mixtral")
    batched.set_experts_implementation("batched_mm")
    assert _refusal(batched, **gathered) == "no error"


def test_all_gather_dispatch_refuses_batches_of_other_shapes(worlds):
    """The all-gather dispatch sizes its exchanges from this rank's own tokens: a step whose replicas hold
    batches of different lengths is refused on every rank, before any collective of the step."""
    for r in worlds.run(2, ep_cases.ep_unequal_batches):
        assert "rank(s) 1 were given batches of other shapes" in r["error"], r
        assert "expert_dispatch='all_to_all'" in r["error"] and r["after"] == "trained", r


@pytest.mark.parametrize(("model_type", "dp", "tp", "ep"), [("mixtral", 2, 1, 2), ("qwen3_moe", 1, 2, 2)])
def test_meta_model_reads_per_expert_hf_layout(worlds, tmp_path, model_type, dp, tp, ep):
    """transformers' save_pretrained writes experts one by one (Mixtral's w1/w3/w2, the Qwen family's
    gate/up/down_proj); a meta-device model reads them as boxes of its fused tensors, each ep rank
    only its own experts, and its first step equals the plain model's."""
    from safetensors import safe_open

    model_dir = str(tmp_path / "model")
    build(moe_config(model_type), seed=0).save_pretrained(model_dir)
    with safe_open(f"{model_dir}/model.safetensors", "pt") as f:
        assert any(".experts.0." in k for k in f.keys()), "transformers saved fused experts: nothing to test"
    for r in worlds.run(dp * tp, ep_cases.ep_meta_load, model_dir=model_dir, dp=dp, tp=tp, ep=ep):
        assert r["weight_err"] == 0.0 and abs(r["loss"] - r["ref_loss"]) <= LOSS_RTOL * r["ref_loss"], r


@pytest.mark.composes((Feature.EP, Feature.BF16), status=Status.EQUIVALENT)
@pytest.mark.composes((Feature.EP_ALL_GATHER, Feature.BF16), case="bf16-all_gather", status=Status.EQUIVALENT)
@pytest.mark.composes((Feature.EP, Feature.FP16), case="fp16", status=Status.EQUIVALENT)
@pytest.mark.composes((Feature.EP_ALL_GATHER, Feature.FP16), case="fp16-all_gather", status=Status.EQUIVALENT)
@pytest.mark.parametrize(("precision", "dispatch"), [("bf16", "all_to_all"), ("fp16", "all_to_all"),
                                                   ("bf16", "all_gather"),
                                                   ("fp16", "all_gather")],
                         ids=["bf16", "fp16", "bf16-all_gather", "fp16-all_gather"])
def test_expert_parallel_in_bf16_trains_like_replicated_experts(worlds, precision, dispatch):
    """bf16 (fp16, loss-scaled) compute with float32 gradients and masters: three AdamW steps at ep=2
    follow the same losses as the same dp=2 run with every expert on every rank (rounding apart)."""
    sharded = worlds.run(2, ep_cases.ep_bf16_losses, model_type="mixtral", ep=2, precision=precision,
                         expert_dispatch=dispatch)[0]
    replicated = worlds.run(2, ep_cases.ep_bf16_losses, model_type="mixtral", ep=1, precision=precision)[0]
    assert sharded["grad_dtypes"] == sharded["master_dtypes"] == ["torch.float32"], sharded
    for a, b in zip(sharded["losses"], replicated["losses"]):
        assert abs(a - b) <= 2e-3 * abs(b), (sharded, replicated)
    assert sharded["losses"][-1] < sharded["losses"][0] - 0.05, sharded


@pytest.mark.composes((Feature.EP_ALL_GATHER, Feature.ZERO), case="qwen3_moe-2-2-1-2-None-all_gather")
@pytest.mark.composes((Feature.ZERO, Feature.EP), case="qwen3_moe-2-2-1-2-None-all_to_all")
@pytest.mark.parametrize(("model_type", "dp", "tp", "pp", "ep", "precision", "dispatch"), [
    ("qwen3_moe", 2, 2, 1, 2, None, "all_to_all"),  # experts' state split over their 2 holders, the rest over dp=2
    ("mixtral", 1, 4, 1, 2, None, "all_to_all"),  # dp=1: only the experts have replicas to shard over
    # one holder per block: whole masters
    pytest.param("deepseek_v3", 2, 1, 1, 2, None, "all_to_all", marks=pytest.mark.long),
    ("qwen3_moe", 2, 2, 1, 2, "bf16", "all_to_all"),
    ("qwen3_moe", 2, 2, 1, 2, None, "all_gather"),
])
def test_expert_parallel_with_zero_equals_plain_model(worlds, model_type, dp, tp, pp, ep, precision, dispatch):
    """ZeRO-1 with ep: the experts' masters and AdamW state are split over the ranks holding the same
    expert block (dp x tp / ep of them), the rest over dp; two AdamW steps with clipping equal the
    plain model (float32) or the unsharded optimizer at the same mesh (bf16)."""
    results = worlds.run(dp * tp * pp, ep_cases.ep_zero_parity, model_type=model_type, dp=dp, tp=tp, pp=pp, ep=ep,
                         precision=precision, expert_dispatch=dispatch)
    for r in results:
        for loss, ref in zip(r["losses"], r["ref_losses"]):
            assert abs(loss - ref) <= LOSS_RTOL * abs(ref), r
        for norm, ref in zip(r["norms"], r["ref_norms"]):
            assert abs(norm - ref) <= 1e-5 * ref, r
        assert r["weight_err"] <= (WEIGHT_ATOL if precision is None else BF16_WEIGHT_ATOL), r
        full = 2 * 4 * r["expert_elements"]  # exp_avg and exp_avg_sq, float32
        share = r["expert_replicas"]
        assert full <= r["expert_state_bytes"] * share <= full + 2 * 4 * share * 64, r  # 1/share, padding aside


def test_expert_parallel_zero_checkpoints_move_between_meshes(worlds, tmp_path):
    """ZeRO-1 with ep: saved at dp=2 x tp=2 x ep=2 (expert state in halves over the two holders of
    each block), resumed at tp=4 x ep=2, at dp=2 x ep=2 (one holder per block) and at ep=1 with
    torch's AdamW: each next step equals the uninterrupted run."""
    model_dir = str(tmp_path / "model")
    config = moe_config("qwen3_moe")
    build(config, seed=0).save_pretrained(model_dir)
    ckpt, plain = str(tmp_path / "ckpt"), str(tmp_path / "uninterrupted")
    expected = worlds.run(4, ep_cases.ep_checkpoint_run, model_dir=model_dir, dp=2, tp=2, pp=1, ep=2, load=None,
                          steps=[1, 2, 3], save=ckpt, export=plain, zero=True)[0]
    for mesh, zero in [((1, 4, 1, 2), True), ((2, 1, 1, 2), True), ((1, 1, 1, 1), None)]:
        assert_resumes_like(worlds, tmp_path, config, model_dir=model_dir, plain=plain, expected=expected, mesh=mesh,
                            source=ckpt, steps=[2, 3], zero=zero)


@pytest.mark.composes((Feature.PP_INTERLEAVED, Feature.EP), case="interleaved_1f1b-2")
@pytest.mark.composes((Feature.PP_ZB_H1, Feature.EP), case="zb_h1-1")
@pytest.mark.parametrize(("schedule", "virtual_stages"), [("interleaved_1f1b", 2), ("zb_h1", 1)])
def test_expert_parallel_with_schedules_equals_plain_model(worlds, tmp_path, schedule, virtual_stages):
    """The composition table's ep x interleaved_1f1b and ep x zb_h1 rows: dp=2 x pp=2, experts over
    ep=2. Every rank of an ep group runs the same chunks in the same order, so their all-to-alls
    pair up; the experts' fused weights are not deferred linears, their gradients come in B."""
    results = worlds.run(4, ep_cases.ep_parity, model_type="qwen3_moe", out_dir=str(tmp_path / "hf"), dp=2, tp=1,
                         pp=2, ep=2, microbatches=2, schedule=schedule, virtual_stages=virtual_stages)
    check_experts(results, ep=2)


# every cp rank routes its own tokens within its grid's ep group; the experts' gradients sum over cp too
@pytest.mark.composes((Feature.CP, Feature.EP), case="qwen3_moe-2-1-2-2-True")
@pytest.mark.parametrize(("model_type", "dp", "tp", "cp", "ep", "router_loss"), [
    ("qwen3_moe", 2, 1, 2, 2, True),  # each cp rank's grid shares out the experts; the router loss pools dp x cp
    ("mixtral", 1, 2, 2, 2, False),  # the ep group is the tp group of each cp rank
])
def test_expert_parallel_with_context_parallel_equals_plain_model(worlds, tmp_path, model_type, dp, tp, cp, ep,
                                                                  router_loss):
    """ep x cp: every cp rank routes the tokens of its chunks of the sequences to the ep group of its
    own dp x tp grid; the ranks holding the same experts in every cp rank sum their gradients, and
    the load-balancing term counts every real token of the batch once (padded rows)."""
    overrides = {"output_router_logits": True, "router_aux_loss_coef": 0.5} if router_loss else {}
    results = worlds.run(dp * tp * cp, ep_cases.ep_parity, model_type=model_type, out_dir=str(tmp_path / "hf"),
                         dp=dp, tp=tp, pp=1, ep=ep, cp=cp, overrides=overrides, padded=router_loss)
    check_experts(results, ep=ep)


# the MoE block runs on this rank's slice of the sequence: its tokens are distinct, nothing is shared out over tp
@pytest.mark.composes((Feature.EP, Feature.SP), case="qwen3_moe-1-2-1-2-False")
@pytest.mark.parametrize(("model_type", "dp", "tp", "cp", "ep", "router_loss"), [
    ("qwen3_moe", 1, 2, 1, 2, False),  # the ep group is the tp group: each rank routes its own slice
    ("mixtral", 2, 2, 1, 4, True),  # ep over dp x tp; the load-balancing term pools dp x tp slices
    ("qwen2_moe", 2, 2, 1, 2, False),  # a shared expert (replicated) on the slice, its gradient summed over tp
    ("qwen3_moe", 1, 2, 2, 2, True),  # cp x sp x ep: slices of cp's chunks routed
])
def test_expert_parallel_with_sequence_parallelism_equals_plain_model(worlds, tmp_path, model_type, dp, tp, cp, ep,
                                                                       router_loss):
    """ep x sp: the MoE block runs on this rank's slice of the sequence; its router (and a shared
    expert) see those tokens only (gradients summed over tp), and the dispatch sends them as they are,
    without sharing tokens out over tp or gathering them back. Padded rows with the router loss."""
    overrides = {"output_router_logits": True, "router_aux_loss_coef": 0.5} if router_loss else {}
    results = worlds.run(dp * tp * cp, ep_cases.ep_parity, model_type=model_type, out_dir=str(tmp_path / "hf"),
                         dp=dp, tp=tp, pp=1, ep=ep, cp=cp, overrides=overrides, padded=router_loss,
                         sequence_parallel=True)
    check_experts(results, ep=ep)


@pytest.mark.composes((Feature.EP_ALL_GATHER, Feature.LORA), case="qwen3_moe-2-1-2-all_gather")
@pytest.mark.parametrize(("model_type", "dp", "tp", "ep", "dispatch"), [
    ("qwen3_moe", 2, 1, 2, "all_to_all"), ("mixtral", 1, 2, 2, "all_to_all"),
    ("qwen3_moe", 2, 1, 2, "all_gather")])
def test_lora_with_expert_parallelism_equals_peft(worlds, model_type, dp, tp, ep, dispatch):
    """The composition table's ep x lora row: peft LoRA on the attention of an MoE model whose frozen
    experts ep shards; loss and every adapter gradient equal peft's in one process."""
    for r in worlds.run(dp * tp, ep_cases.ep_lora_parity, model_type=model_type, dp=dp, tp=tp, ep=ep,
                        targets=["q_proj", "v_proj", "o_proj"], expert_dispatch=dispatch):
        assert abs(r["loss"] - r["ref_loss"]) <= LOSS_RTOL * abs(r["ref_loss"]), r
        assert r["grad_err"] < 2e-6 and r["trained"] > 0 and r["experts_frozen"], r


@pytest.mark.parametrize(("dp", "tp", "dispatch", "rows", "seq"), [
    (2, 1, "all_to_all", 2, 12), (1, 2, "all_to_all", 2, 12), (1, 2, "all_gather", 1, 13)])
def test_stacked_experts_under_expert_parallelism_equal_plain_model(worlds, dp, tp, dispatch, rows, seq):
    """Llama 4's experts take every token once per expert and are outside transformers' experts
    registry: hooks move each expert's rows to its holder and back (with tp, each tp rank moves its
    share of the tokens); loss and every gradient equal the plain model's. With the all-gather dispatch
    every member's share is known from the shapes: equal all-to-alls, no count exchanged (13 tokens: tp
    shares of 7 and 6, the second padded)."""
    for r in worlds.run(dp * tp, ep_cases.stacked_ep_parity, model_type="llama4_text", dp=dp, tp=tp, ep=2,
                        expert_dispatch=dispatch, rows=rows, seq=seq):
        assert abs(r["loss"] - r["ref_loss"]) <= LOSS_RTOL * abs(r["ref_loss"]), r
        assert r["grad_err"] < 2e-6, r
        assert r["local_experts"] == [r["experts"] // 2], r


@pytest.mark.parametrize("mesh", ["ep2", "pp2"])
def test_gemma4_with_its_moe_block(worlds, mesh):
    """Gemma 4 with its MoE block switched on (off in the default config, so the zoo's gemma4_text has
    no experts): one SGD step at dp=2 x ep=2 equal to the plain model (a run on transformers' own tiny
    Gemma 4 was reported to end one rank with status 1 and no message), and at pp=2, where every stage
    also holds the per-layer embeddings."""
    from transformers import AutoConfig

    from qn_hf.check.shrink import shrink_config
    from qn_hf.check.zoo import COLUMNS
    from tests import zoo_cases

    config = shrink_config(AutoConfig.for_model("gemma4_text", enable_moe_block=True, num_experts=4, top_k_experts=2))
    verdict = worlds.run(COLUMNS[mesh].size, zoo_cases.zoo_step, config=config.to_dict(), mesh=COLUMNS[mesh])[0]
    assert verdict["verdict"] == "equal" and verdict["moved"] > 1e-3, verdict


# expert_dispatch="all_gather" (no device read per MoE call): model, dp, tp, pp, cp, ep, microbatches, extras
GATHER_CASES = [
    pytest.param("mixtral", 2, 1, 1, 1, 2, 1, {}, id="mixtral-dp2-ep2"),
    # every token to experts 0 and 1: the second rank's experts get sentinels only
    pytest.param("deepseek_v3", 2, 1, 1, 1, 2, 1, {"skew": "empty_rank"}, id="deepseek_v3-dp2-ep2-empty_rank"),
    # the ep group is the tp group; 13 tokens: tp shares of 7 and 6, the second padded with a token routed nowhere
    pytest.param("qwen3_moe", 1, 2, 1, 1, 2, 1, {"per_rank": 1, "seq": 13}, id="qwen3_moe-tp2-ep2-odd"),
    pytest.param("qwen3_moe", 1, 2, 1, 1, 2, 1, {"sequence_parallel": True}, id="qwen3_moe-tp2-ep2-sp"),
    pytest.param("deepseek_v3", 2, 2, 1, 1, 4, 1, {"recompute": "selective"}, id="deepseek_v3-dp2-tp2-ep4-selective"),
    pytest.param("mixtral", 2, 1, 2, 1, 2, 2, {}, id="mixtral-dp2-pp2-ep2"),
    pytest.param("qwen3_moe", 2, 1, 1, 2, 2, 1, {}, id="qwen3_moe-dp2-cp2-ep2"),
    pytest.param("qwen3_moe", 2, 1, 1, 1, 2, 1, {"recompute": "full", "dp_shard": 2}, id="qwen3_moe-dp2-shard2-ep2-full"),
    pytest.param("qwen3_moe", 2, 1, 2, 1, 2, 2, {"schedule": "gpipe"}, id="qwen3_moe-dp2-pp2-ep2-gpipe"),
    pytest.param("qwen3_moe", 2, 1, 2, 1, 2, 2, {"schedule": "interleaved_1f1b", "virtual_stages": 2},
                 id="qwen3_moe-dp2-pp2-ep2-interleaved_1f1b"),
    pytest.param("qwen3_moe", 2, 1, 2, 1, 2, 2, {"schedule": "zb_h1"}, id="qwen3_moe-dp2-pp2-ep2-zb_h1"),
]


# ep's all-gather dispatch (expert_dispatch="all_gather"): a way of running ep, tested with each feature
@pytest.mark.composes((Feature.EP_ALL_GATHER, Feature.RECOMPUTE), case="deepseek_v3-dp2-tp2-ep4-selective")
@pytest.mark.composes((Feature.EP_ALL_GATHER, Feature.EP), (Feature.EP_ALL_GATHER, Feature.DP), case="mixtral-dp2-ep2")
@pytest.mark.composes((Feature.EP_ALL_GATHER, Feature.PP_1F1B), case="mixtral-dp2-pp2-ep2")
@pytest.mark.composes((Feature.EP_ALL_GATHER, Feature.CP), case="qwen3_moe-dp2-cp2-ep2")
@pytest.mark.composes((Feature.EP_ALL_GATHER, Feature.PP_GPIPE), case="qwen3_moe-dp2-pp2-ep2-gpipe")
@pytest.mark.composes((Feature.EP_ALL_GATHER, Feature.PP_INTERLEAVED), case="qwen3_moe-dp2-pp2-ep2-interleaved_1f1b")
@pytest.mark.composes((Feature.EP_ALL_GATHER, Feature.PP_ZB_H1), case="qwen3_moe-dp2-pp2-ep2-zb_h1")
@pytest.mark.composes((Feature.EP_ALL_GATHER, Feature.DP_SHARD), case="qwen3_moe-dp2-shard2-ep2-full")
# tokens shared out over tp: a share one token short padded with a token routed nowhere
@pytest.mark.composes((Feature.EP_ALL_GATHER, Feature.TP), case="qwen3_moe-tp2-ep2-odd")
@pytest.mark.composes((Feature.EP_ALL_GATHER, Feature.SP), case="qwen3_moe-tp2-ep2-sp")
@pytest.mark.parametrize(("model_type", "dp", "tp", "pp", "cp", "ep", "microbatches", "extras"), GATHER_CASES)
def test_all_gather_dispatch_equals_plain_model(worlds, tmp_path, model_type, dp, tp, pp, cp, ep, microbatches,
                                                extras):
    """expert_dispatch="all_gather": every member gathers the ep group's tokens, runs its experts on the
    pairs routed to them (the rest are transformers' sentinels) and the partial outputs are summed back;
    loss, every gradient, the norm and every weight after a step equal the plain model's."""
    results = worlds.run(dp * tp * pp * cp, ep_cases.ep_parity, model_type=model_type, out_dir=str(tmp_path / "hf"),
                         dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, microbatches=microbatches, expert_dispatch="all_gather",
                         **extras)
    check_experts(results, ep=ep)
    assert all(r["ep_gathers"] > 0 for r in results), results  # the step ran the all-gather dispatch
    if extras.get("skew") == "empty_rank":  # the second rank's experts got no token: sentinels only
        assert results[0]["expert_counts"][2:] == [0, 0], results[0]
