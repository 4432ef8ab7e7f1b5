"""Context parallelism (ring attention over cp ranks) equals the plain model; misuse is refused."""

from __future__ import annotations

import pytest

from qn_hf.config.features import Feature
from tests import cases
from tests.releases import with_tp_plan
from tests.test_parity import GRAD_ATOL, check

CP_CASES = [  # kind, dp, tp, pp, cp, microbatches, padded, packed
    ("llama", 1, 1, 1, 2, 1, False, False),
    ("qwen3", 1, 1, 1, 2, 1, False, False),
    ("llama", 1, 1, 1, 4, 1, True, False),
    ("qwen3", 1, 1, 1, 4, 1, False, True),
    ("llama", 1, 1, 1, 2, 1, False, True),
    ("llama", 1, 2, 1, 2, 1, True, False),
    ("qwen3", 1, 2, 1, 2, 1, False, True),
    ("llama", 1, 1, 2, 2, 2, True, False),
    ("llama", 2, 1, 1, 2, 1, True, False),
]


@pytest.mark.composes((Feature.CP, Feature.PP_1F1B), case="llama-1-1-2-2-2-True-False")
@pytest.mark.composes((Feature.TP, Feature.CP), case="llama-1-2-1-2-1-True-False")
@pytest.mark.composes((Feature.CP, Feature.DP), case="llama-2-1-1-2-1-True-False")
@pytest.mark.parametrize(("kind", "dp", "tp", "pp", "cp", "microbatches", "padded", "packed"), CP_CASES)
def test_context_parallel_equals_plain_model(worlds, model_dirs, tmp_path, kind, dp, tp, pp, cp, microbatches, padded,
                                             packed):
    results = worlds.run(
        dp * tp * pp * cp, cases.parity, kind=kind, model_dir=model_dirs[kind], out_dir=str(tmp_path / "hf"),
        dp=dp, tp=tp, pp=pp, cp=cp, microbatches=microbatches, padded=padded, packed=packed, seq=16,
    )
    check(results, tp=tp)


@pytest.mark.composes((Feature.CP, Feature.PP_GPIPE))
@pytest.mark.long
def test_context_parallel_with_gpipe_equals_plain_model(worlds, model_dirs, tmp_path):
    """The composition table's cp x gpipe row: pp=2 with GPipe and cp=2, padded rows."""
    results = worlds.run(4, cases.parity, kind="llama", model_dir=model_dirs["llama"], out_dir=str(tmp_path / "hf"),
                         dp=1, tp=1, pp=2, cp=2, microbatches=2, schedule="gpipe", padded=True, seq=16)
    check(results, tp=1)


PACKED_WITHOUT_CP = [  # the rest of the engine honours packed documents too (kind, tp, pp, microbatches)
    ("llama", 2, 1, 1),
    ("qwen3", 1, 2, 2),
]


@pytest.mark.parametrize(("kind", "tp", "pp", "microbatches"), PACKED_WITHOUT_CP)
def test_packed_sequences_without_cp(worlds, model_dirs, tmp_path, kind, tp, pp, microbatches):
    results = worlds.run(tp * pp, cases.parity, kind=kind, model_dir=model_dirs[kind],
                         out_dir=str(tmp_path / "hf"), dp=1, tp=tp, pp=pp, microbatches=microbatches, packed=True, seq=16)
    check(results, tp=tp)


SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, vocab_size=97, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _meta_model(model_type: str, **overrides):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{**SMALL, **overrides})
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _error(model, **kwargs) -> str:
    from qn_hf.validation.checks import check_parallel_config

    try:
        check_parallel_config(model, dp=1, microbatches=1, schedule="1f1b", **{"tp": 1, "pp": 1, "cp": 2, **kwargs})
    except ValueError as e:
        return str(e)
    return "no error"


def test_context_parallel_refusals():
    assert _error(_meta_model("llama")) == "no error"
    assert "cp=0 must be a positive integer" in _error(_meta_model("llama"), cp=0)
    # what mixes positions is named first, whatever else is missing (transformers before 5.21 plans no
    # Jamba: Qwen3-Next's linear-attention layers stand in)
    hybrid = _error(_meta_model(with_tp_plan("jamba", "qwen3_next")))
    assert "layers of kind ['linear_attention'] (config.layer_types) mix positions outside attention" in hybrid, hybrid
    opaque = _meta_model("llama")  # an attention of its own, not through the interface
    opaque.__class__ = type("OpaqueForCausalLM", (type(opaque),), {"_supports_attention_backend": False})
    message = _error(opaque)
    assert "OpaqueForCausalLM does not run its attention through transformers' attention interface" in message, message
    hybrid = _meta_model("llama")
    hybrid.config.layer_types = ["linear_attention", "full_attention"]  # as hybrid models declare them
    message = _error(hybrid)
    assert "layers of kind ['linear_attention'] (config.layer_types)" in message, message
    windowed = _meta_model("llama")
    windowed.model.layers[1].self_attn.sliding_window = 4  # the ring computes windows (test_ring_attention.py)
    assert _error(windowed) == "no error"
    message = _error(_meta_model("llama", attention_chunk_size=8))
    assert "attention_chunk_size=8 (chunked attention) is not supported by ring attention" in message, message
    # Llama 4 without chunks still counts its temperature positions over the tokens a rank holds
    llama4 = _error(_meta_model("llama4_text", attention_chunk_size=None, intermediate_size_mlp=64, num_local_experts=2,
                                no_rope_layers=[1, 0], layer_types=["full_attention"] * 2))
    assert "attn_temperature_tuning=True scales the queries of the layers without RoPE" in llama4, llama4
    assert _error(_meta_model("llama4_text", attention_chunk_size=None, intermediate_size_mlp=64, num_local_experts=2,
                              no_rope_layers=[1, 0], layer_types=["full_attention"] * 2,
                              attn_temperature_tuning=False)) == "no error"
    doge = _error(_meta_model("doge"))
    assert "cp=2 (doge): its attention adds a learned per-key dynamic mask" in doge, doge
    dropout = _error(_meta_model("llama", attention_dropout=0.1))
    assert "attention_dropout=0.1: ring attention has no attention dropout" in dropout, dropout
    assert _error(_meta_model("llama"), tp=2, sequence_parallel=True) == "no error"  # cp x sp composes


def test_context_parallel_batch_errors(worlds, model_dirs):
    messages = worlds.run(2, cases.cp_batch_errors, model_dir=model_dirs["llama"])
    for m in messages:
        assert "sequence length 12 is not a multiple of 8 (cp=4" not in m["odd"]  # cp=2 here
        assert "sequence length 14 is not a multiple of 4 (cp=2 cuts it into 2*cp pieces)" in m["odd"], m
        assert "cp=2: batch keys ['token_type_ids'] cannot be cut along the sequence" in m["keys"], m
        loss, ref_loss = m["window"]  # a window of 8 on 16 tokens at cp=2: computed, not refused
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), m
        assert m["mesh_dims"] == ("dp", "pp", "cp", "tp"), m
    assert [m["coords"]["cp"] for m in messages] == [0, 1]


def case_cp_train_save_continue(*, model_dir: str, ckpt: str, out: str, zero: bool) -> float:
    """(tp=2, cp=2): one AdamW step, a checkpoint, a second step; the weights after it."""
    import torch

    import qn_hf
    from tests.cases import mesh_for
    from tests.models import load, make_batch

    pm = qn_hf.parallelize(load("llama", model_dir), tp=2, cp=2, mesh=mesh_for(1, 2, 1, 2))
    opt = qn_hf.optimizer(pm, torch.optim.AdamW, zero=zero, lr=1e-3)
    for seed in (1, 2):
        opt.zero_grad()
        loss = pm.train_step(make_batch("llama", size=2, seed=seed, seq=16, padded=True))
        opt.step()
        if seed == 1:
            pm.save_checkpoint(ckpt, optimizer=opt, step=1)
    pm.save_pretrained(out)
    return loss.item()


def case_cp_resume(*, model_dir: str, ckpt: str, out: str, dp: int, tp: int, cp: int) -> float:
    import torch

    import qn_hf
    from tests.cases import mesh_for
    from tests.models import dp_slice, load, make_batch

    pm = qn_hf.parallelize(load("llama", model_dir), dp=dp, tp=tp, cp=cp, mesh=mesh_for(dp, tp, 1, cp))
    opt = qn_hf.optimizer(pm, torch.optim.AdamW, lr=1e-3)
    assert pm.load_checkpoint(ckpt, optimizer=opt)["step"] == 1
    opt.zero_grad()
    batch = dp_slice(make_batch("llama", size=2, seed=2, seq=16, padded=True), dp=dp, dp_rank=pm.coords["dp"])
    loss = pm.train_step(batch)
    opt.step()
    pm.save_pretrained(out)
    return loss.item()


@pytest.mark.parametrize("zero", [False, True])
def test_checkpoint_moves_between_cp_and_other_meshes(worlds, model_dirs, tmp_path, zero):
    from tests.models import load

    ckpt, uninterrupted = str(tmp_path / "ckpt"), str(tmp_path / "uninterrupted")
    expected = worlds.run(4, case_cp_train_save_continue, model_dir=model_dirs["llama"],
                          ckpt=ckpt, out=uninterrupted, zero=zero)[0]
    reference = dict(load("llama", uninterrupted).named_parameters())
    for dp, tp, cp in [(1, 1, 1), (2, 1, 1), (1, 1, 4)]:
        out = str(tmp_path / f"resumed-{dp}-{tp}-{cp}")
        loss = worlds.run(dp * tp * cp, case_cp_resume, model_dir=model_dirs["llama"],
                          ckpt=ckpt, out=out, dp=dp, tp=tp, cp=cp)[0]
        assert abs(loss - expected) <= 1e-5 * abs(expected), (dp, tp, cp, loss, expected)
        resumed = dict(load("llama", out).named_parameters())
        err = max((resumed[n] - p).abs().max().item() for n, p in reference.items())
        assert err < 2e-5, f"resumed at dp={dp} tp={tp} cp={cp}: max weight difference {err}"


@pytest.mark.composes((Feature.PP_INTERLEAVED, Feature.CP), case="interleaved_1f1b-2-2")
@pytest.mark.composes((Feature.PP_ZB_H1, Feature.CP), case="zb_h1-1-2")
@pytest.mark.parametrize(("schedule", "virtual_stages", "microbatches"), [("interleaved_1f1b", 2, 2), ("zb_h1", 1, 2)])
def test_context_parallel_with_schedules_equals_plain_model(worlds, model_dirs, tmp_path, schedule, virtual_stages,
                                                            microbatches):
    """The composition table's cp x interleaved_1f1b and cp x zb_h1 rows: pp=2 x cp=2 with padded
    rows; ring attention's sends run on the cp group while the schedule's run on pp, each group's
    in the same order on every rank of it."""
    results = worlds.run(4, cases.parity, kind="llama", model_dir=model_dirs["llama"], out_dir=str(tmp_path / "hf"),
                         dp=1, tp=1, pp=2, cp=2, microbatches=microbatches, schedule=schedule,
                         virtual_stages=virtual_stages, padded=True, seq=16)
    check(results, tp=1)


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_loss_fn_with_context_parallelism_equals_plain_model(worlds, model_dirs, tp, pp):
    """A user loss_fn (its own shifted cross-entropy, a microbatch's mean) at cp=2: it sees the whole
    sequences' logits (gathered over cp, and over tp's vocabulary) and the whole batch, on every cp
    rank; each takes half, and backward hands each its own positions' gradient. Microbatches of 2
    and 1 rows."""
    for r in worlds.run(2 * tp * pp, cases.uneven_loss_fn, model_dir=model_dirs["llama"], dp=1, tp=tp, pp=pp, cp=2,
                        microbatches=2, rows=[3]):
        assert abs(r["loss"] - r["ref_loss"]) <= 1e-5 * abs(r["ref_loss"]), r
        assert r["grad_err"] < GRAD_ATOL, r


# slices of slices: each cp rank's two pieces split again over tp between the tp regions
@pytest.mark.composes((Feature.SP, Feature.CP), case="llama-1-2-1-1")
@pytest.mark.parametrize(("kind", "dp", "tp", "pp", "microbatches"), [
    ("llama", 1, 2, 1, 1),
    ("qwen3", 1, 2, 2, 2),
])
def test_context_parallel_with_sequence_parallelism_equals_plain_model(worlds, model_dirs, tmp_path, kind, dp, tp,
                                                                       pp, microbatches):
    """cp=2 x tp=2 with sequence parallelism: slices of slices. cp gives each rank two chunks of every
    sequence (L/cp tokens); sequence parallelism splits those over tp between the tp regions, its
    entries gather them back, and ring attention runs over cp on the gathered part. Padded rows."""
    results = worlds.run(dp * tp * pp * 2, cases.parity, kind=kind, model_dir=model_dirs[kind],
                         out_dir=str(tmp_path / "hf"), dp=dp, tp=tp, pp=pp, cp=2, microbatches=microbatches,
                         padded=True, seq=16, sequence_parallel=True)
    check(results, tp=tp)


def test_context_parallel_with_attention_sinks_equals_plain_model(worlds):
    """gpt-oss: a sink logit per head in every softmax (its gradient summed over cp), sliding windows
    on every other layer, MoE; one step at cp=2 equals the plain model."""
    from transformers import CONFIG_MAPPING

    from qn_hf.check.shrink import shrink_config
    from tests import zoo_cases

    config = shrink_config(CONFIG_MAPPING["gpt_oss"]())
    assert config.sliding_window < 12 and "sliding_attention" in config.layer_types  # the windows are exercised
    verdict = worlds.run(2, zoo_cases.gpt_oss_cp_step, config=config.to_dict(), cp=2)[0]
    assert verdict["verdict"] == "equal" and verdict["moved"] > 1e-3, verdict
