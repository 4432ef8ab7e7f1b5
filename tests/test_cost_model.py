"""The calibrated time model (planner/cost.py): each figure of a calibration moves the part of a step
it prices, and only that part; the pipeline is timed with each stage's own costs; a calibration file
from before compute_scale reads as 1."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import LlamaConfig

from qn_hf.config.parallel_config import ParallelConfig
from qn_hf.pipeline.schedule import Op, schedule_actions
from qn_hf.pipeline.schedule_check import timed
from qn_hf.planner.calibration import NO_WAITS, Calibration, Fit, MatmulTable, WaitTable, assumed
from qn_hf.planner.cost import Hardware, optimizer_seconds, step_time
from qn_hf.planner.estimate import Planner

CONFIG = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, tie_word_embeddings=False,
                     architectures=["LlamaForCausalLM"])
HW = Hardware(gpu_memory=1 << 30, gpus_per_node=4)


@pytest.fixture(scope="module")
def planner() -> Planner:
    return Planner(CONFIG, seq_len=32, micro_batch_size=2)


def _machine(**changes) -> Calibration:
    base = assumed(tflops=0.05, nvlink_gbps=1, ib_gbps=1, gpus_per_node=4, gpu_memory=1 << 30, world_size=4)
    return dataclasses.replace(base, **{"device": "cpu", "op": Fit(20e-6, 5e9), "overlap": 0.0, **changes})


def _faster_matmuls(cal: Calibration, factor: float) -> Calibration:
    table = cal.matmul["float32"]
    return dataclasses.replace(cal, matmul={"float32": MatmulTable(
        rows=table.rows, widths=table.widths, rates=tuple(tuple(r * factor for r in row) for row in table.rates))})


def _slower_collectives(cal: Calibration, factor: float) -> Calibration:
    return dataclasses.replace(cal, collectives=tuple(
        dataclasses.replace(c, fit=Fit(c.fit.latency * factor, c.fit.rate / factor)) for c in cal.collectives))


def test_each_figure_moves_its_own_part(planner):
    cal = _machine()
    tp = planner.estimate(ParallelConfig(tp=2, dp=2, microbatches=2))
    base = step_time(tp, HW, cal)
    fast = step_time(tp, HW, _faster_matmuls(cal, 2.0))
    assert fast.compute < base.compute and fast.tp == pytest.approx(base.tp) and fast.dp == pytest.approx(base.dp)
    slow = step_time(tp, HW, _slower_collectives(cal, 10.0))
    assert slow.compute == pytest.approx(base.compute)
    assert slow.tp == pytest.approx(10 * base.tp, rel=1e-6) and slow.dp > 5 * base.dp
    scaled = step_time(tp, HW, dataclasses.replace(cal, compute_scale=2.0))
    assert scaled.compute == pytest.approx(2 * base.compute) and scaled.tp == pytest.approx(base.tp)


def test_overlap_hides_the_buckets_behind_backward(planner):
    dp = planner.estimate(ParallelConfig(dp=4, microbatches=1))
    hidden = step_time(dp, HW, _machine(overlap=1.0))
    exposed = step_time(dp, HW, _machine(overlap=0.0))
    assert hidden.dp < exposed.dp and hidden.compute == pytest.approx(exposed.compute)


def test_without_a_calibration_every_figure_is_named_as_assumed(planner):
    t = step_time(planner.estimate(ParallelConfig(dp=4, microbatches=1)), HW)
    assert len(t.assumed) == 7 and any("FLOP rate" in a for a in t.assumed) and NO_WAITS in t.assumed
    assert "host-device copy bandwidth" in t.assumed
    assert step_time(planner.estimate(ParallelConfig(dp=4, microbatches=1)), HW, _machine()).assumed == \
        _machine().assumed


def test_the_pipeline_waits_for_its_slowest_stage_only_where_it_does():
    # two stages, one microbatch: the step is F0 + F1 + B1 + B0, not twice the slower stage
    actions = [list(a) for a in schedule_actions(stages=2, microbatches=1, schedule="1f1b")]
    costs = [{Op.FWD: 1.0, Op.BWD: 2.0}, {Op.FWD: 3.0, Op.BWD: 6.0}]
    assert timed(actions, costs=costs).makespan == pytest.approx(12.0)
    assert timed(actions, costs=costs[1]).makespan == pytest.approx(18.0)  # one cost for every rank


def test_a_calibration_without_compute_scale_reads_as_one(tmp_path):
    data = _machine().to_json()
    del data["compute_scale"]
    assert Calibration.from_json(data).compute_scale == 1.0
    with pytest.raises(ValueError, match="calibration format"):
        Calibration.from_json({**data, "format": 99})


def test_selective_recomputation_costs_its_redone_elementwise_work(planner):
    cal = _machine()
    plain = step_time(planner.estimate(ParallelConfig(dp=4, microbatches=1)), HW, cal)
    selective = step_time(planner.estimate(ParallelConfig(dp=4, microbatches=1, recompute="selective")), HW, cal)
    full = step_time(planner.estimate(ParallelConfig(dp=4, microbatches=1, recompute="full")), HW, cal)
    assert plain.seconds < selective.seconds < full.seconds


def test_the_optimizer_is_priced_at_its_measured_fit_and_without_one_at_the_op_fit(planner):
    est = planner.estimate(ParallelConfig(dp=4, microbatches=1))
    stage = est.stages[0]
    measured = _machine(optimizer=Fit(latency=1e-4, rate=1e9))
    assert optimizer_seconds(stage, measured) == pytest.approx(1e-4 * stage.param_tensors + stage.state_bytes / 1e9)
    slower = step_time(est, HW, _machine(optimizer=Fit(latency=1e-3, rate=1e9)))
    base = step_time(est, HW, measured)
    assert slower.optimizer > base.optimizer and slower.compute == pytest.approx(base.compute)
    # a file from before the optimizer was measured: the op fit, a few ops per tensor on a CPU
    data = measured.to_json()
    del data["optimizer"]
    old = Calibration.from_json(data)
    assert old.optimizer is None
    assert optimizer_seconds(stage, old) == pytest.approx(old.op.seconds(2 * stage.state_bytes, calls=10 * stage.param_tensors))
    assert Calibration.from_json(measured.to_json()) == measured


def test_routed_experts_are_priced_at_the_grouped_rate_and_without_one_at_the_matmul_rate():
    from transformers import Qwen3MoeConfig

    moe = Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_experts=4,
                         num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, vocab_size=256, max_position_embeddings=64, architectures=["Qwen3MoeForCausalLM"])
    est = Planner(moe, seq_len=32, micro_batch_size=2).estimate(ParallelConfig(dp=2, microbatches=1))
    dense = Planner(CONFIG, seq_len=32, micro_batch_size=2).estimate(ParallelConfig(dp=2, microbatches=1))
    cal = _machine()
    table = cal.matmul["float32"]
    slow = dataclasses.replace(cal, grouped={"float32": MatmulTable(
        rows=table.rows, widths=table.widths, rates=tuple(tuple(r / 4 for r in row) for row in table.rates))})
    assert cal.grouped_rate("float32", rows=32, width=64) == cal.matmul_rate("float32", rows=32, width=64)
    assert slow.grouped_rate("float32", rows=32, width=64) == pytest.approx(cal.matmul_rate("float32", rows=32, width=64) / 4)
    assert step_time(est, HW, slow).compute > step_time(est, HW, cal).compute
    assert step_time(dense, HW, slow).compute == pytest.approx(step_time(dense, HW, cal).compute)
    assert Calibration.from_json(slow.to_json()) == slow


def test_waits_are_priced_at_each_blocking_exchange_after_its_share_of_the_compute(planner):
    waits = WaitTable(segments=(1e-3, 1e-1), waits=(1e-4, 2e-2))
    cal = _machine(waits=waits, assumed=())  # as measured
    dp = planner.estimate(ParallelConfig(dp=4, microbatches=1))
    tp = planner.estimate(ParallelConfig(tp=2, dp=2, microbatches=2))
    base_dp, base_tp = step_time(dp, HW, _machine()), step_time(tp, HW, _machine())
    with_dp, with_tp = step_time(dp, HW, cal), step_time(tp, HW, cal)
    assert base_dp.wait == base_tp.wait == 0.0 and NO_WAITS not in with_dp.assumed
    assert NO_WAITS in step_time(dp, HW, _machine(assumed=())).assumed  # a file from before waits were measured
    # dp: one exchange a step (its end), after the whole step's compute
    assert with_dp.wait == pytest.approx(waits.wait(base_dp.compute), rel=1e-6)
    assert with_dp.seconds == pytest.approx(base_dp.seconds + with_dp.wait, rel=1e-6)
    # tp: every collective of every microbatch waits, each after its share of the compute
    exchanges = tp.stages[0].comm["tp"].calls + 1
    assert with_tp.wait == pytest.approx(waits.total(base_tp.compute, exchanges), rel=1e-6)
    assert with_tp.seconds > base_tp.seconds and with_tp.compute == pytest.approx(base_tp.compute)
    one = step_time(Planner(CONFIG, seq_len=32, micro_batch_size=2).estimate(ParallelConfig()), HW, cal)
    assert one.wait == 0.0  # a single rank waits for no one
    assert Calibration.from_json(cal.to_json()) == cal
