"""The search's floors (``cost.step_floor``): a mesh shape's floor is at most the predicted step time
of every configuration of it (any dp_shard, any recomputation; full recomputation's own floor at most
its), on GPU figures and on CPU ones, and equal to it where only matmuls and attention cost time; and
leaving the shapes above the runner-up unpriced changes neither the choice nor the runner-up nor any
candidate ranked up to it, against a search that prices every one (``exhaustive=True``)."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import LlamaConfig, MixtralConfig

from qn_hf.config.options import Recompute
from qn_hf.config.schedule import Schedule
from qn_hf.planner.auto import auto_plan
from qn_hf.planner.calibration import Fit, assumed
from qn_hf.planner.cost import Hardware, step_floor, step_time
from qn_hf.planner.estimate import Planner
from qn_hf.planner.search import mesh_groups

GIB = 1 << 30
LLAMA = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=8,
                    num_key_value_heads=4, vocab_size=512)
WIDE = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                   num_key_value_heads=4, vocab_size=32000)
MIXTRAL = MixtralConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
                        num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2, vocab_size=512)


def _calibrations() -> dict[str, object]:
    cpu = dataclasses.replace(assumed(tflops=0.05, nvlink_gbps=1, ib_gbps=1, gpus_per_node=4, gpu_memory=GIB,
                                      world_size=8), device="cpu", op=Fit(20e-6, 5e9), overlap=1.0)
    # nothing but matmuls and attention costs time: each step's time is its floor, or the recomputation more
    compute = dataclasses.replace(cpu, op=Fit(0.0, 1e30), collectives=tuple(
        dataclasses.replace(c, fit=Fit(0.0, 1e30)) for c in cpu.collectives))
    return {"stated GPU figures": None, "cpu, full overlap": cpu, "compute alone": compute}


@pytest.mark.parametrize("calibration", list(_calibrations()))
@pytest.mark.parametrize("model", ["llama", "mixtral"])
def test_a_shape_floor_is_below_each_of_its_configurations(model, calibration):
    config = {"llama": LLAMA, "mixtral": MIXTRAL}[model]
    cal = _calibrations()[calibration]
    hw = Hardware(gpu_memory=GIB, gpus_per_node=4)
    planner = Planner(config, seq_len=256, micro_batch_size=2)
    checked = tight = 0
    for schedule, chunks in ((Schedule.ONE_F_ONE_B, 1), (Schedule.INTERLEAVED_1F1B, 2), (Schedule.ZB_H1, 1)):
        groups, _ = mesh_groups(planner, {"schedule": schedule, "virtual_stages": chunks}, gpus=8, hw=hw,
                                global_batch=16, ep=None, dp_shard=None)
        for group in groups:
            floor = None
            for parallel in group.configs:
                for recompute in (None, Recompute.SELECTIVE, Recompute.FULL):
                    config = dataclasses.replace(parallel, recompute=recompute)
                    try:
                        est = planner.estimate(config)
                    except ValueError:
                        continue
                    if floor is None:  # the first configuration a search prices stands for them all
                        work = planner.work(config)
                        floor, untimed = step_floor(work, hw, cal), step_floor(work, hw, cal, timed=False)
                        assert untimed <= floor * (1 + 1e-12)
                    # (up to float rounding, which the search's margin absorbs: auto._CLEAR)
                    assert floor <= step_time(est, hw, cal).seconds * (1 + 1e-12), (parallel, recompute)
                    assert floor == pytest.approx(step_floor(est, hw, cal), rel=1e-12)  # its estimate's compute
                    # under full recomputation, its own floor: the backward's matmuls and attention a third more
                    full = step_floor(work, hw, cal, recompute=Recompute.FULL)
                    if recompute is Recompute.FULL:
                        assert full <= step_time(est, hw, cal).seconds * (1 + 1e-12), parallel
                    if calibration == "compute alone" and recompute in (None, Recompute.FULL):
                        exact = floor if recompute is None else full
                        assert exact == pytest.approx(step_time(est, hw, cal).seconds, rel=1e-9)
                        tight += 1
                    checked += 1
    assert checked > 100 and (tight > 30 or calibration != "compute alone")


def test_an_overlap_above_one_gives_no_floor():
    cal = dataclasses.replace(_calibrations()["cpu, full overlap"], overlap=1.5)
    est = Planner(LLAMA, seq_len=256, micro_batch_size=2).estimate(
        dataclasses.replace(mesh_groups(Planner(LLAMA, seq_len=256, micro_batch_size=2), {}, gpus=8,
                                        hw=Hardware(gpu_memory=GIB, gpus_per_node=4), global_batch=16)[0][0].configs[0]))
    assert step_floor(est, Hardware(gpu_memory=GIB, gpus_per_node=4), cal) == 0.0


CASES = {
    "llama, 8 GPUs": (LLAMA, dict(global_batch=16, seq_len=1024, world_size=8, device_memory=GIB // 8)),
    # wide enough that matmuls are most of a step: shapes' floors part them
    "wider llama, 16 GPUs, bf16": (WIDE, dict(global_batch=32, seq_len=4096, world_size=16, device_memory=3 * GIB,
                                              fixed={"mixed_precision": "bf16"})),
    "mixtral, 8 GPUs": (MIXTRAL, dict(global_batch=16, seq_len=1024, world_size=8, device_memory=GIB // 8)),
}


def _ranked(choice) -> list[tuple]:
    return [(c.estimate.parallel, c.estimate.micro_batch_size, c.time.seconds, c.peak_bytes) for c in choice.feasible]


@pytest.mark.parametrize("case", list(CASES))
def test_unpriced_shapes_change_no_answer(case):
    config, keywords = CASES[case]
    every = auto_plan(config, **keywords, exhaustive=True)
    some = auto_plan(config, **keywords)
    assert every.unpriced == 0
    assert (some.config, some.micro_batch_size, some.time, some.peak_bytes) == (
        every.config, every.micro_batch_size, every.time, every.peak_bytes)
    assert some.runner_up.estimate.parallel == every.runner_up.estimate.parallel and some.why == every.why
    # every candidate up to the runner-up, in order; those priced beyond it priced alike
    up_to = every.runner_up.time.seconds
    assert [r for r in _ranked(some) if r[2] <= up_to] == [r for r in _ranked(every) if r[2] <= up_to]
    assert set(_ranked(some)) <= set(_ranked(every))
    assert "left unpriced" in some.summary() or some.unpriced == 0


def test_some_shapes_are_left_unpriced():
    config, keywords = CASES["wider llama, 16 GPUs, bf16"]
    choice = auto_plan(config, **keywords)
    assert choice.unpriced > 0 and f"{choice.unpriced:,} configurations left unpriced" in choice.summary()
