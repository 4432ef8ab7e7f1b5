"""The planner's calibration: the figures' reading (calibration.py) and their measurement
(calibrate.py: quick mode on a 2-rank gloo world, and ``qn-hf-plan --calibrate`` at one rank)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from transformers import LlamaConfig

from qn_hf.comm_meter import Collective
from qn_hf.planner.allocations import count_ops
from qn_hf.planner.calibrate import layouts, measure
from qn_hf.planner.calibration import (
    FORMAT,
    Calibration,
    CollectiveFit,
    Fit,
    Link,
    MatmulTable,
    WaitTable,
    assumed,
    fit_line,
    fit_per_call,
)
from qn_hf.planner.cli import main
from qn_hf.planner.compute_timing import elementwise_call, seconds_in_turn
from qn_hf.planner.overheads import measure_overheads

GIB = 1024**3


def _calibration(*fits: CollectiveFit) -> Calibration:
    table = MatmulTable(rows=(1,), widths=(1,), rates=((1e12,),))
    return Calibration(device="cpu", backend="gloo", world_size=2, ranks_per_node=2, matmul={"float32": table},
                       attention={"float32": Fit(0.0, 1e12)}, op=Fit(1e-5, 1e10), collectives=fits, overlap=0.5,
                       memory_bytes=GIB)


# -- reading ------------------------------------------------------------------------------------------


def test_matmul_table_reads_grid_points_between_them_log_bilinearly_and_clamps_outside():
    table = MatmulTable(rows=(1, 100), widths=(1, 100), rates=((1.0, 100.0), (100.0, 10000.0)))
    assert table.rate(100, 1) == pytest.approx(100.0)
    assert table.rate(1, 100) == pytest.approx(100.0)
    assert table.rate(10, 1) == pytest.approx(10.0)  # halfway in log rows: the geometric mean
    assert table.rate(10, 10) == pytest.approx(100.0)
    assert table.rate(0.5, 1) == pytest.approx(1.0)  # clamped below
    assert table.rate(1e6, 1e6) == pytest.approx(10000.0)  # and above
    assert table.rate(1e6, 10) == pytest.approx(1000.0)


def test_collective_fit_exact_extrapolated_by_ring_factors_p2p_unchanged_unknown_op_as_all_reduce():
    reduce2 = Fit(latency=1e-5, rate=1e9)
    gather2 = Fit(latency=2e-5, rate=4e9)
    send2 = Fit(latency=3e-6, rate=2e9)
    cal = _calibration(CollectiveFit(Collective.ALL_REDUCE, 2, Link.NODE, reduce2),
                       CollectiveFit(Collective.ALL_GATHER_INTO_TENSOR, 2, Link.NODE, gather2),
                       CollectiveFit(Collective.SEND, 2, Link.NODE, send2))
    assert cal.collective(Collective.ALL_REDUCE, ranks=2, link=Link.NODE) == reduce2
    at8 = cal.collective(Collective.ALL_REDUCE, ranks=8, link=Link.NODE)
    # latency grows as the ring's n-1 steps; an all-reduce's seconds per payload byte as (n-1)/n
    assert at8.latency == pytest.approx(7e-5)
    assert at8.rate == pytest.approx(1e9 / ((7 / 8) / (1 / 2)))
    gather8 = cal.collective(Collective.ALL_GATHER_INTO_TENSOR, ranks=8, link=Link.NODE)
    assert gather8.rate == pytest.approx(4e9 / 7)  # an all-gather's own piece crosses n-1 links
    assert cal.collective(Collective.SEND, ranks=8, link=Link.NODE) == send2
    assert cal.collective(Collective.BROADCAST, ranks=2, link=Link.NODE) == reduce2
    # a link never measured is read from the other's fits
    assert cal.collective(Collective.ALL_REDUCE, ranks=2, link=Link.NETWORK) == reduce2


def test_assumed_figures_name_what_they_assume():
    cal = assumed(tflops=400, nvlink_gbps=200, ib_gbps=50, gpus_per_node=8, gpu_memory=80 * GIB, world_size=16)
    assert cal.matmul_rate("bfloat16", rows=4096, width=4096) == pytest.approx(400e12)
    assert cal.attention_fit("bfloat16") == Fit(0.0, 400e12)
    node8 = cal.collective(Collective.ALL_REDUCE, ranks=8, link=Link.NODE)
    assert node8 == Fit(latency=pytest.approx(7 * 10e-6), rate=pytest.approx(200e9 / (2 * 7 / 8)))
    assert cal.collective(Collective.SEND, ranks=2, link=Link.NETWORK) == Fit(20e-6, 50e9)
    assert {c.ranks for c in cal.collectives} == {2, 4, 8, 16}
    assert cal.overlap == 1.0 and cal.memory_bytes == 80 * GIB
    assert len(cal.assumed) == 7 and any("overlap" in a for a in cal.assumed)
    assert cal.host_copy == Fit(10e-6, 25e9 / 2)  # a byte goes to the host and back: PCIe 5's both ways


def test_from_json_refuses_a_wrong_format_naming_the_fix():
    data = assumed(tflops=1, nvlink_gbps=1, ib_gbps=1, gpus_per_node=8, gpu_memory=GIB).to_json()
    with pytest.raises(ValueError, match="run qn-hf-plan --calibrate again"):
        Calibration.from_json({**data, "format": FORMAT + 1})
    with pytest.raises(ValueError, match="not a qn_hf calibration file"):
        Calibration.from_json({k: v for k, v in data.items() if k != "matmul"})


def test_json_round_trip(tmp_path):
    cal = assumed(tflops=1, nvlink_gbps=2, ib_gbps=3, gpus_per_node=4, gpu_memory=GIB, world_size=8)
    assert Calibration.from_json(json.loads(json.dumps(cal.to_json()))) == cal
    cal.save(str(tmp_path / "c.json"))
    assert Calibration.load(str(tmp_path / "c.json")) == cal


def test_wait_table_reads_between_its_points_and_in_proportion_outside_them():
    table = WaitTable(segments=(1e-3, 1e-2, 1e-1), waits=(1e-4, 1e-3, 2e-2))
    assert table.wait(1e-2) == pytest.approx(1e-3)
    assert table.wait(5.5e-2) == pytest.approx((1e-3 + 2e-2) / 2)
    assert table.wait(5e-4) == pytest.approx(5e-5) and table.wait(0.2) == pytest.approx(4e-2)
    assert table.total(0.1, 10) == pytest.approx(10 * table.wait(1e-2)) and table.total(0.1, 0) == 0.0


# -- measuring: the pure parts ------------------------------------------------------------------------


def test_fit_line_recovers_a_line_and_stays_finite_on_noise():
    assert fit_line([1e3, 1e5, 1e6], [1e-4 + a / 1e9 for a in (1e3, 1e5, 1e6)]) == Fit(
        latency=pytest.approx(1e-4), rate=pytest.approx(1e9))
    through_origin = fit_line([1.0, 2.0, 3.0], [0.0, 2.0, 3.0])  # intercept < 0: refitted through 0
    assert through_origin.latency == 0.0 and through_origin.rate > 0
    flat = fit_line([1.0, 2.0], [5.0, 4.0])  # time fell as the amount grew: all latency
    assert flat.latency == 4.0 and math.isfinite(flat.rate) and flat.seconds(2.0) == pytest.approx(4.0 * 1.01)


def test_fit_per_call_recovers_latency_per_call_and_rate_and_stays_finite_on_noise():
    points = [(c, a, c * 2e-5 + a / 5e9) for c, a in ((64, 1e6), (4, 1e8), (16, 1e7))]
    assert fit_per_call(points) == Fit(latency=pytest.approx(2e-5), rate=pytest.approx(5e9))
    no_latency = fit_per_call([(64, 1e6, 1e-4), (4, 1e8, 1e-1)])  # negative latency: refitted as zero
    assert no_latency.latency == 0.0 and no_latency.rate > 0
    flat = fit_per_call([(10, 1e3, 1.0), (10, 1e6, 0.5)])  # time fell as the bytes grew: all latency
    assert flat.latency > 0 and math.isfinite(flat.rate) and flat.rate > 0


def test_count_ops_counts_what_writes_memory_as_the_trace_does():
    x = torch.ones(8, 4)
    # two ops write 32 floats each; a view and a product's output (priced by FLOPs) add no bytes
    assert count_ops(lambda: (x * 2).view(-1) + 1) == (2, 2 * 32 * 4)
    assert count_ops(lambda: x @ x.T) == (1, 0)
    ops, nbytes, fn = elementwise_call(4, 16, torch.device("cpu"))
    assert ops > 8 and nbytes >= ops * 4 * 4  # every round's ops, at least a row each
    calls = []
    seconds = seconds_in_turn([lambda: calls.append("a"), fn, lambda: calls.append("b")], torch.device("cpu"), repeats=3)
    assert len(seconds) == 3 and all(t > 0 for t in seconds)
    # samples in turn: after the warm-ups, a's calls and b's alternate sample by sample
    runs = [k for i, k in enumerate(calls) if i == 0 or calls[i - 1] != k]
    assert runs[-6:] == ["a", "b"] * 3


def test_layouts_lay_groups_out_as_a_mesh_does():
    one_node = layouts(4, 4)
    assert [(lay.ranks, lay.link, lay.groups) for lay in one_node] == [
        (2, Link.NODE, ((0, 1), (2, 3))), (4, Link.NODE, ((0, 1, 2, 3),))]
    two_nodes = {(lay.ranks, lay.link): lay.groups for lay in layouts(8, 4)}
    assert two_nodes[(2, Link.NODE)] == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert two_nodes[(2, Link.NETWORK)] == ((0, 4), (1, 5), (2, 6), (3, 7))  # one rank per node
    assert two_nodes[(4, Link.NODE)] == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert two_nodes[(8, Link.NETWORK)] == (tuple(range(8)),)
    assert len(two_nodes) == 4
    for lay in layouts(12, 4):  # every layout partitions the world
        assert sorted(r for g in lay.groups for r in g) == list(range(12))
    assert layouts(1, 1) == []
    with pytest.raises(ValueError, match="ranks_per_node=3 does not divide world_size=4"):
        layouts(4, 3)


def test_measure_outside_a_process_group_says_what_to_call():
    with pytest.raises(RuntimeError, match=r"calibrate\(world_size\)"):
        measure(quick=True)


# -- measuring on ranks -------------------------------------------------------------------------------


def case_measure_quick() -> Calibration:
    return measure(dtypes=("bfloat16", "float16"), quick=True)


def _figures(cal: Calibration) -> list[Fit]:
    return [*cal.attention.values(), cal.op, cal.optimizer, *(c.fit for c in cal.collectives)]


def test_measure_quick_at_two_ranks_agrees_and_is_sane(worlds, tmp_path):
    first, second = worlds.run(2, case_measure_quick)
    assert first == second  # every timing agreed with an all-reduce MAX
    cal = first
    assert (cal.device, cal.backend, cal.world_size, cal.ranks_per_node) == ("cpu", "gloo", 2, 2)
    assert list(cal.matmul) == ["float32", "bfloat16"]  # float16 on a CPU: skipped and named
    assert any(a.startswith("float16") for a in cal.assumed)
    for fit in _figures(cal):
        assert math.isfinite(fit.latency) and fit.latency >= 0
        assert math.isfinite(fit.rate) and fit.rate > 0
    for table in cal.matmul.values():
        assert all(math.isfinite(r) and r > 0 for row in table.rates for r in row)
    table = cal.matmul["float32"]
    assert table.rates[-1][-1] > table.rates[0][0], table
    assert "float32" in cal.grouped and set(cal.grouped) <= set(cal.matmul)  # the experts' products
    assert all(math.isfinite(r) and r > 0 for t in cal.grouped.values() for row in t.rates for r in row)  # the largest product runs nearer the peak
    measured = {(c.op, c.ranks, c.link) for c in cal.collectives}
    assert measured == {(op, 2, Link.NODE) for op in (
        Collective.ALL_REDUCE, Collective.ALL_GATHER_INTO_TENSOR, Collective.REDUCE_SCATTER_TENSOR,
        Collective.ALL_TO_ALL_SINGLE, Collective.SEND, Collective.RECV)}
    assert 0.0 <= cal.overlap <= 1.0 and "overlap" in cal.notes
    assert cal.memory_bytes > 0 and cal.threads == 1
    assert 0.5 <= cal.compute_scale <= 4.0
    waits = cal.waits  # one point per wait segment, every wait finite and not negative
    assert len(waits.segments) == len(waits.waits) == 2 and list(waits.segments) == sorted(waits.segments)
    assert all(math.isfinite(w) and w >= 0 for w in waits.waits)
    # offload's copies on a CPU: a block input's host copy (its own code, ActivationOffload.round_trip)
    assert cal.host_copy is not None and cal.host_copy.rate > 1e8
    cal.save(str(tmp_path / "c.json"))
    assert Calibration.load(str(tmp_path / "c.json")) == cal


def case_overheads() -> tuple[Calibration, dict[str, float]]:
    from qn_hf.planner.tiny_steps import tiny_step_seconds

    cal = measure(quick=True)
    return cal, measure_overheads(cal, torch.device("cpu"), step_seconds=tiny_step_seconds)


def test_overheads_measured_on_tiny_models_agree_and_are_priced(worlds):
    (cal, first), (_, second) = worlds.run(2, case_overheads)
    assert first == second  # every step the slowest rank's, the same predictions on every rank
    assert set(first) == {"step", "tp", "cp", "pp", "dp_shard", "ep"}
    assert all(math.isfinite(v) and v >= 0 for v in first.values())
    assert first["step"] > 0  # a step's machinery is not free, least of all on gloo
    from qn_hf.config.parallel_config import ParallelConfig
    from qn_hf.planner.cost import Hardware, step_time
    from qn_hf.planner.estimate import Planner
    from qn_hf.planner.overheads import DENSE

    est = Planner(LlamaConfig(**DENSE), seq_len=16, micro_batch_size=8).estimate(ParallelConfig(tp=2))
    hw = Hardware(gpu_memory=cal.memory_bytes, gpus_per_node=2)
    priced = dataclasses.replace(cal, overheads=first)
    plain, with_host = step_time(est, hw, cal), step_time(est, hw, priced)
    assert plain.host == 0.0
    assert with_host.host == pytest.approx(first["step"] + first["tp"] * est.stages[0].comm["tp"].calls, rel=1e-6)
    assert with_host.seconds == pytest.approx(plain.seconds + with_host.host, rel=1e-6)
    assert Calibration.from_json(priced.to_json()) == priced


@pytest.mark.processes  # its local world of one rank is a process of its own
def test_cli_calibrate_quick_writes_a_calibration(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # not under torchrun: a local world of one rank
    out = tmp_path / "machine.json"
    main(["--calibrate", str(out), "--quick", "--dtype", "fp32", "--calibrate-ranks", "1"])
    cal = Calibration.load(str(out))
    assert cal.world_size == 1 and cal.collectives == () and cal.overlap == 0.0
    assert list(cal.matmul) == ["float32"] and cal.assumed == ()
    printed = capsys.readouterr().out
    assert "matmul float32: peak" in printed and f"wrote {out}" in printed
    assert cal.notes["mode"] == "quick"


def test_cli_model_still_required_without_calibrate(capsys):
    with pytest.raises(SystemExit):
        main(["--gpus", "8"])
    assert "the following arguments are required: model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["some/model", "--calibrate", "out.json"])
    assert "give it without some/model" in capsys.readouterr().err
