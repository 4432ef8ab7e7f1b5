"""``mesh="auto"`` and ``auto_config``: the planner's choice trains exactly the global batch, fits,
follows the calibration, keeps what the caller fixed, refuses with the closest miss, and trains
equal to the plain model like every other mesh."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import qn_hf
from qn_hf.planner.auto import auto_choice, auto_config
from qn_hf.planner.calibration import Calibration, Fit, assumed

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=64, tie_word_embeddings=False)
GLOBAL_BATCH, SEQ = 8, 32


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY)).float()


def _calibrations() -> dict[str, Calibration]:
    """Two hand-made machines: one where every op costs 20 us (small models are launch-bound), one
    where ops are free and only FLOPs and bytes count."""
    base = assumed(tflops=0.05, nvlink_gbps=1, ib_gbps=1, gpus_per_node=2, gpu_memory=1 << 30, world_size=2)
    bound = dataclasses.replace(base, device="cpu", op=Fit(20e-6, 5e9), overlap=0.0)
    free = dataclasses.replace(bound, op=Fit(1e-9, 5e12))
    return {"launch-bound": bound, "flops-bound": free}


def test_every_candidate_trains_the_global_batch_and_the_choice_is_deterministic():
    cal = _calibrations()["launch-bound"]
    first = auto_choice(_model(), global_batch=GLOBAL_BATCH, seq_len=SEQ, world_size=2, calibration=cal)
    again = auto_choice(_model(), global_batch=GLOBAL_BATCH, seq_len=SEQ, world_size=2, calibration=cal)
    assert first.config == again.config and first.micro_batch_size == again.micro_batch_size
    assert len(first.feasible) > 3
    for c in first.feasible:
        p = c.estimate.parallel
        assert p.dims.world_size == 2
        assert p.dims.dp * p.microbatches * c.estimate.micro_batch_size == GLOBAL_BATCH
    times = [c.time.seconds for c in first.feasible]
    assert times == sorted(times) and first.time.seconds == times[0]
    assert first.runner_up is first.feasible[1] and "slower" in first.why


def test_the_calibration_decides():
    chosen = {name: auto_choice(_model(), global_batch=GLOBAL_BATCH, seq_len=SEQ, world_size=2, calibration=cal)
              for name, cal in _calibrations().items()}
    a, b = chosen.values()
    assert (a.config, a.micro_batch_size) != (b.config, b.micro_batch_size)
    assert a.time.seconds > b.time.seconds  # launches cost time on the first machine only


def test_only_what_fits_is_chosen():
    cal = _calibrations()["launch-bound"]
    roomy = auto_choice(_model(), global_batch=GLOBAL_BATCH, seq_len=SEQ, world_size=2, calibration=cal,
                        device_memory=1 << 30)
    limit = roomy.peak_bytes - 1  # the fastest no longer fits
    tight = auto_choice(_model(), global_batch=GLOBAL_BATCH, seq_len=SEQ, world_size=2, calibration=cal,
                        device_memory=limit)
    assert tight.peak_bytes <= limit and all(c.peak_bytes <= limit for c in tight.feasible)
    assert (tight.config, tight.micro_batch_size) != (roomy.config, roomy.micro_batch_size)
    assert tight.time.seconds >= roomy.time.seconds


def test_fits_nowhere_names_the_closest_miss_and_the_fix():
    # every mesh's state alone is over 1 KiB: recomputation, skipped while something might fit, is tried
    # for the closest miss once nothing does
    with pytest.raises(ValueError, match=r"no configuration of llama fits .*closest, [^:]*recompute=full[^:]*, "
                                         r"needs .*GiB.*more devices"):
        auto_choice(_model(), global_batch=GLOBAL_BATCH, seq_len=SEQ, world_size=2, device_memory=1024,
                    calibration=_calibrations()["launch-bound"])


def test_fixed_options_are_kept_and_microbatches_refused():
    cal = _calibrations()["launch-bound"]
    config = auto_config(_model(), global_batch=GLOBAL_BATCH, seq_len=SEQ, world_size=2, calibration=cal,
                         fixed={"tp": 2})
    assert config.dims.tp == 2
    with pytest.raises(ValueError, match="microbatches=2 with mesh='auto'"):
        auto_config(_model(), global_batch=GLOBAL_BATCH, seq_len=SEQ, world_size=2, calibration=cal,
                    fixed={"microbatches": 2})


def test_the_all_gather_dispatch_is_planned_when_fixed():
    """expert_dispatch="all_gather" beside mesh='auto': kept, priced (expert_parallel/costs.py), ep chosen > 1 (ep=1
    refuses it: a dense model fits nowhere, naming why)."""
    from qn_hf.check.run import build
    from tests.ep_cases import moe_config

    cal = _calibrations()["launch-bound"]
    config = auto_config(build(moe_config("qwen3_moe"), seed=0), global_batch=GLOBAL_BATCH, seq_len=SEQ, world_size=2,
                         calibration=cal, fixed={"expert_dispatch": "all_gather"})
    assert config.dims.ep == 2 and config.expert_dispatch == "all_gather", config
    with pytest.raises(ValueError, match="expert_dispatch='all_gather' with ep=1: no experts live on other ranks"):
        auto_config(_model(), global_batch=GLOBAL_BATCH, seq_len=SEQ, world_size=2, calibration=cal,
                    fixed={"expert_dispatch": "all_gather"})


def test_the_calibration_file_is_read(tmp_path):
    cal = _calibrations()["flops-bound"]
    cal.save(str(tmp_path / "machine.json"))
    assert Calibration.load(str(tmp_path / "machine.json")) == cal
    by_file = auto_config(_model(), global_batch=GLOBAL_BATCH, seq_len=SEQ, world_size=2,
                          calibration=str(tmp_path / "machine.json"))
    assert by_file == auto_config(_model(), global_batch=GLOBAL_BATCH, seq_len=SEQ, world_size=2, calibration=cal)


@pytest.mark.parametrize("settings, message", [
    (dict(mesh="auto", seq_len=SEQ), "mesh='auto' needs global_batch= and seq_len="),
    (dict(global_batch=8, seq_len=SEQ), "go with mesh='auto' only"),
    (dict(mesh="automatic", global_batch=8, seq_len=SEQ), "mesh='automatic' with global_batch"),
])
def test_parallelize_auto_refusals(settings, message):
    with pytest.raises(ValueError, match=message):
        qn_hf.parallelize(_model(), **settings)


def case_auto_parity(*, calibration: dict) -> dict:
    cal = Calibration.from_json(calibration)
    model = _model()
    ref = copy.deepcopy(model)
    expected = auto_config(ref, global_batch=GLOBAL_BATCH, seq_len=SEQ, calibration=cal)
    pm = qn_hf.parallelize(model, mesh="auto", global_batch=GLOBAL_BATCH, seq_len=SEQ, calibration=cal)
    ids = torch.randint(0, TINY["vocab_size"], (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    rows = GLOBAL_BATCH // pm.parallel_config.dims.dp
    local = ids[pm.coords.dp * rows:(pm.coords.dp + 1) * rows]
    loss = pm.train_step({"input_ids": local, "labels": local.clone()}).item()
    ref.train()
    ref_loss = ref(input_ids=ids, labels=ids, use_cache=False).loss
    ref_loss.backward()
    for params in (list(pm.parameters()), list(ref.parameters())):
        torch.optim.SGD(params, lr=1.0).step()
    state = pm.state_dict()
    worst = max((state[n].float() - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    chosen = repr(pm.parallel_config)
    pm.close()
    return {"loss": loss, "ref_loss": ref_loss.item(), "worst": worst, "chosen": chosen, "expected": repr(expected)}


@pytest.mark.parametrize("machine", ["launch-bound", "flops-bound"])
def test_parallelize_auto_equals_the_plain_model(worlds, machine):
    results = worlds.run(2, case_auto_parity, calibration=_calibrations()[machine].to_json())
    for r in results:
        assert r["chosen"] == r["expected"]
        assert abs(r["loss"] - r["ref_loss"]) <= 1e-5 * abs(r["ref_loss"])
        assert r["worst"] <= 2e-5, r
    assert results[0]["chosen"] == results[1]["chosen"]


LONG = dict(TINY, vocab_size=8192, max_position_embeddings=4096)  # the loss's logits outweigh the blocks'


def test_what_fits_nowhere_else_is_tried_with_the_loss_in_chunks_then_offload():
    """Shrinking the memory, the choice moves to the loss in chunks and then to the blocks' inputs on the
    host (shapes.MEMORY_OPTIONS), each only where the same configuration without it does not fit; what the
    caller fixes stays (a chunk size of its own) while the rest are tried, and the closest miss was tried under
    all of them."""
    from qn_hf.planner.estimate import Planner

    torch.manual_seed(0)
    model, cal = LlamaForCausalLM(LlamaConfig(**LONG)), _calibrations()["launch-bound"]
    memory, chosen = 1 << 34, []
    with pytest.raises(ValueError, match=r"closest, [^:]*loss_chunk_tokens=1024, offload=activations, needs"):
        while True:
            c = auto_choice(model, global_batch=2, seq_len=4096, world_size=2, calibration=cal, device_memory=memory)
            chosen.append((c, memory))
            memory = c.peak_bytes - 1  # the next configuration down
    planners = {}
    for c, memory in chosen:
        p = c.config
        planner = planners.setdefault(c.micro_batch_size, Planner(model.config, seq_len=4096, model_class=type(model),
                                                                  micro_batch_size=c.micro_batch_size))
        # each needed: without it (chunks: without offload either) the same configuration is over the memory
        lighter = ([dataclasses.replace(p, offload=None)] if p.offload else []) + (
            [dataclasses.replace(p, offload=None, loss_chunk_tokens=None)] if p.loss_chunk_tokens else [])
        for without in lighter:
            assert planner.estimate(without).peak_bytes > memory, (p, without)
    options = {(c.config.recompute, c.config.loss_chunk_tokens, c.config.offload) for c, _ in chosen}
    assert any(chunks and offload is None for _, chunks, offload in options), options
    assert any(offload is not None for _, _, offload in options), options
    tight = chosen[-1][0].peak_bytes
    fixed = auto_choice(model, global_batch=2, seq_len=4096, world_size=2, calibration=cal, device_memory=tight,
                        fixed={"loss_chunk_tokens": 512})
    assert fixed.config.loss_chunk_tokens == 512 and fixed.config.recompute is not None and fixed.peak_bytes <= tight
    with pytest.raises(ValueError, match=r"offload='activations' holds on the host .* set recompute="):
        auto_choice(model, global_batch=2, seq_len=4096, world_size=2, calibration=cal,
                    fixed={"offload": "activations"})
