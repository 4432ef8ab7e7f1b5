"""``pm.generate`` and ``pm.state_dict()`` equal the plain Hugging Face model's, at every mesh shape."""

from __future__ import annotations

import pytest

from qn_hf.config.features import Feature
from tests import generation_cases

KINDS = ["gpt2", "llama"]  # tied head and vocabulary 99 (padded at tp=2); GQA and vocabulary 101
MESHES = [(1, 2, 1, False, 1, 1), (1, 1, 2, False, 1, 1), (1, 2, 2, False, 1, 1),  # (dp, tp, pp, sp, V, cp)
          (2, 1, 2, False, 1, 1), (1, 2, 1, True, 1, 1), (1, 2, 2, True, 1, 1),
          (1, 1, 2, False, 2, 1), pytest.param(1, 2, 2, True, 2, 1, marks=pytest.mark.long),  # two chunks per rank
          (1, 1, 2, False, 1, 2), pytest.param(1, 2, 1, True, 1, 2, marks=pytest.mark.long)]  # ring attention off


@pytest.mark.composes((Feature.PP_1F1B, Feature.GENERATE), case="dp1-tp1-pp2")
# ring attention switched off: every cp rank holds the whole model and runs the loop on whole sequences
@pytest.mark.composes((Feature.GENERATE, Feature.CP), case="dp1-tp1-pp2-cp2")
# each generated token's forward goes round the ring of stages once per chunk
@pytest.mark.composes((Feature.PP_INTERLEAVED, Feature.GENERATE), case="dp1-tp1-pp2-v2")
@pytest.mark.composes((Feature.TP, Feature.GENERATE), case="dp1-tp2-pp1")
# generate switches sequence parallelism off: a one-token step cannot be split over the tp ranks
@pytest.mark.composes((Feature.SP, Feature.GENERATE), case="dp1-tp2-pp2-sp")
@pytest.mark.composes((Feature.DP, Feature.GENERATE), case="dp2-tp1-pp2")
@pytest.mark.parametrize(("dp", "tp", "pp", "sp", "virtual", "cp"), MESHES,
                         ids=[f"dp{d}-tp{t}-pp{p}" + ("-sp" if s else "") + (f"-v{v}" if v > 1 else "")
                              + (f"-cp{c}" if c > 1 else "")
                              for d, t, p, s, v, c in (getattr(m, "values", m) for m in MESHES)])
def test_generate_equals_plain_model(worlds, model_dirs, dp, tp, pp, sp, virtual, cp):
    """Greedy token for token (a left-padded batch with attention_mask, one prompt without), sampling
    with the same seed, the logits HF's processors see (whole vocabulary); every rank of a replica
    returns the same, each dp replica its own prompts' result; the train/eval mode is given back.
    With sequence parallelism (``-sp``) generation runs with it switched off (one-token steps cannot
    be split over tp), and the model still trains with it afterwards (``trained_after``)."""
    results = worlds.run(dp * tp * pp * cp, generation_cases.generation, model_dirs=model_dirs, kinds=KINDS,
                         dp=dp, tp=tp, pp=pp, sequence_parallel=sp, virtual_stages=virtual, cp=cp)
    for kind in KINDS:
        per_replica: dict[int, dict] = {}
        for r in results:
            got = r[kind]
            for case in ("greedy", "single", "sampled"):
                ours, ref = got[case]
                assert ours == ref, (kind, case, r["rank"], ours, ref)
            assert got["logit_err"] < 1e-4, (kind, r["rank"], got["logit_err"])
            assert got["sp_on_after"], (kind, r["rank"], "sequence parallelism was left off after generate")
            ours, ref = got["loss_after"]
            assert abs(ours - ref) <= 1e-5 * abs(ref), (kind, r["rank"], ours, ref)
            assert got["vocab"] == {"gpt2": 99, "llama": 101}[kind]
            assert got["training"] and got["generation_config"] and got["generator"], (kind, r["rank"], got)
            assert per_replica.setdefault(got["dp"], got) == got, (kind, "ranks of a replica disagree")
        if dp > 1:
            assert per_replica[0]["greedy"] != per_replica[1]["greedy"], "the replicas were given different prompts"


def test_state_dict_equals_plain_model(worlds, model_dirs):
    """tp=2 x pp=2: every rank holds the plain model's state dict exactly (names, order, dtypes, values,
    the tied head as one tensor), and a tiny max_bytes is refused on every rank, pointing at save_pretrained."""
    for r in worlds.run(4, generation_cases.full_state, model_dirs=model_dirs, kinds=KINDS, dp=1, tp=2, pp=2):
        for kind in KINDS:
            got = r[kind]
            assert not got["missing"] and not got["unexpected"] and not got["different"], (kind, r["rank"], got)
            assert got["keys"], (kind, "order differs from the plain model's")
            assert got["devices"] == ["cpu"]
            assert got["tied"] == (kind == "gpt2"), (kind, got["tied"])
            assert "GiB" in got["refused"] and "save_pretrained" in got["refused"] and "max_bytes=1000" in got["refused"]


def test_generate_refusals(worlds, model_dirs):
    results = worlds.run(2, generation_cases.refusals, model_dirs=model_dirs)
    for r in results:
        assert "use_cache" in r["use_cache"], r["use_cache"]
        assert "output_hidden_states" in r["hidden_states"], r["hidden_states"]
        assert "cannot generate" in r["vit"], r["vit"]
        for name in ("cache", "past_key_values"):
            assert f"does not support ['{name}']" in r[name] and "input_ids" in r[name], r[name]
        assert "max_time or stopping_criteria" in r["max_time"] and "max_new_tokens" in r["max_time"], r["max_time"]
        assert "sequence_parallel=False" in r["tp_max_time"] or "max_time" in r["tp_max_time"], r["tp_max_time"]


# HF's synced_gpus: every rank calls the forward until all replicas' loops have finished
@pytest.mark.composes((Feature.GENERATE, Feature.EP), case="dp2-pp1")
# generate runs the all-to-all: its replicas' prompts need not be alike (dispatch.GatherSwitch)
@pytest.mark.composes((Feature.EP_ALL_GATHER, Feature.GENERATE), case="dp2-pp1-all_gather")
@pytest.mark.parametrize(("dp", "pp", "tp", "sp", "dispatch"),
                         [(2, 1, 1, False, "all_to_all"), (2, 2, 1, False, "all_to_all"), (1, 1, 2, True, "all_to_all"),
                          (2, 1, 1, False, "all_gather")],
                         ids=["dp2-pp1", "dp2-pp2", "tp2-sp", "dp2-pp1-all_gather"])
def test_generate_with_expert_parallelism_equals_plain_model(worlds, dp, pp, tp, sp, dispatch):
    """ep=2 over two dp replicas generating different prompts for different lengths (3 and 6 new
    tokens): HF's synced_gpus keeps the replica that finished calling the forward, so the experts'
    all-to-alls pair up; each replica's tokens are the plain model's. With sequence parallelism
    (switched off for generate) the dispatch shares each step's tokens out over tp again. A model built
    with the all-gather dispatch generates with the all-to-all (its replicas' prompts differ in length)."""
    results = worlds.run(dp * pp * tp, generation_cases.ep_generation, dp=dp, pp=pp, ep=2, tp=tp,
                         sequence_parallel=sp, expert_dispatch=dispatch)
    for r in results:
        assert r["ours"] == r["theirs"], r
        assert "synced_gpus=False" in r["refused"] and "leave synced_gpus unset" in r["refused"], r["refused"]
    assert {len(r["ours"][0]) for r in results} == ({5 + 3, 6 + 6} if dp == 2 else {5 + 3})


@pytest.mark.composes((Feature.BF16, Feature.GENERATE), case="bf16")
@pytest.mark.composes((Feature.FP16, Feature.GENERATE), case="fp16")
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_generate_in_mixed_precision_equals_plain_model(worlds, model_dirs, precision):
    """generate under mixed_precision at pp=2: the plain model with its parameters in that dtype,
    token for token, the same greedy scores."""
    for r in worlds.run(2, generation_cases.mixed_generation, model_dirs=model_dirs, precision=precision, pp=2):
        assert r["ours"] == r["theirs"], r
        assert r["logit_err"] == 0.0, r
