"""Activation recomputation changes nothing: with dropout on, bit for bit the run without it."""

from __future__ import annotations

import pytest
import torch

from qn_hf.config.features import Feature, Status
from tests import optim_cases

RECOMPUTE_CASES = [  # kind, dp, tp, pp, mode, sequence_parallel, cp
    ("gpt2", 1, 2, 1, "full", False, 1),  # tp-local attention dropout and shared residual dropout
    ("gpt2", 1, 2, 1, "selective", False, 1),
    ("llama", 1, 2, 2, "selective", False, 1),
    ("gpt2", 2, 1, 2, "full", False, 1),
    ("vit", 1, 2, 1, "selective", False, 1),
    ("gpt2", 1, 2, 1, "full", True, 1),  # dropout on the sequence slices: tp-local stream, replayed
    ("gpt2", 1, 2, 2, "selective", True, 1),
    ("llama", 1, 1, 1, "selective", False, 2),  # ring attention recomputed (its ring transfers too)
    ("llama", 1, 1, 1, "full", False, 2),
]


@pytest.mark.composes((Feature.SP, Feature.RECOMPUTE), case="gpt2-1-2-1-full-True-1", status=Status.EQUIVALENT)
@pytest.mark.composes((Feature.CP, Feature.RECOMPUTE), case="llama-1-1-1-full-False-2", status=Status.EQUIVALENT)
@pytest.mark.parametrize(("kind", "dp", "tp", "pp", "mode", "sp", "cp"), RECOMPUTE_CASES)
def test_recompute_is_bit_for_bit(worlds, model_dirs, kind, dp, tp, pp, mode, sp, cp):
    results = worlds.run(dp * tp * pp * cp, optim_cases.recompute_parity, kind=kind, model_dir=model_dirs[kind],
                         dp=dp, tp=tp, pp=pp, microbatches=2, mode=mode, sequence_parallel=sp, cp=cp)
    for r in results:
        assert r["losses"] == r["ref_losses"], r
        assert r["grads_equal"] and r["weights_equal"], r


@pytest.mark.composes(
    (Feature.PP_INTERLEAVED, Feature.RECOMPUTE), case="gpt2_deep-1-interleaved_1f1b-2-full", status=Status.EQUIVALENT)
@pytest.mark.composes((Feature.PP_ZB_H1, Feature.RECOMPUTE), case="gpt2_deep-1-zb_h1-1-full", status=Status.EQUIVALENT)
@pytest.mark.composes((Feature.PP_GPIPE, Feature.RECOMPUTE), case="gpt2_deep-2-gpipe-1-full", status=Status.EQUIVALENT)
@pytest.mark.parametrize(("kind", "tp", "schedule", "virtual_stages", "mode"), [
    ("gpt2_deep", 1, "interleaved_1f1b", 2, "full"),
    ("llama_deep", 2, "interleaved_1f1b", 2, "selective"),
    ("gpt2_deep", 1, "zb_h1", 1, "full"),  # the weight passes read the inputs the recomputation saved
    ("llama_deep", 2, "zb_h1", 1, "selective"),
    pytest.param("gpt2_deep", 2, "gpipe", 1, "full", marks=pytest.mark.long),  # the table's gpipe x recompute
])
def test_recompute_with_new_schedules(worlds, model_dirs, kind, tp, schedule, virtual_stages, mode):
    results = worlds.run(2 * tp, optim_cases.recompute_parity, kind=kind, model_dir=model_dirs[kind],
                         dp=1, tp=tp, pp=2, microbatches=2, mode=mode, schedule=schedule,
                         virtual_stages=virtual_stages)
    for r in results:
        assert r["losses"] == r["ref_losses"], r
        assert r["grads_equal"] and r["weights_equal"], r


def case_tp_traffic(*, kind: str, model_dir: str, tp: int, sequence_parallel: bool) -> dict:
    """tp calls and bytes of one metered train_step, per recomputation mode (the same batch each)."""
    import qn_hf
    from tests.cases import mesh_for
    from tests.models import load, make_batch

    out = {"blocks": load(kind, model_dir).config.num_hidden_layers}
    for mode in (None, "selective", "full"):
        pm = qn_hf.parallelize(load(kind, model_dir), tp=tp, mesh=mesh_for(1, tp), recompute=mode,
                               sequence_parallel=sequence_parallel)
        with qn_hf.CommMeter(pm) as meter:
            loss = pm.train_step(make_batch(kind, size=2, seed=4, seq=16))
        tp_ops = {op: (t.calls, t.nbytes) for (group, op), t in meter.totals().items() if group == "tp"}
        out[str(mode)] = {"ops": tp_ops, "loss": loss.item(),
                          "grads": {n: p.grad.clone() for n, p in pm.named_parameters()}}
    return out


@pytest.mark.parametrize(("kind", "sp"), [("llama", False), ("gpt2", True)])
def test_selective_recompute_does_not_communicate_again(worlds, model_dirs, kind, sp):
    """The policy keeps the tp collectives' outputs: a selective step moves the tp bytes of a step
    without recomputation (full recomputation repeats the forward's collectives), same gradients.
    Under sequence parallelism a step without recomputation gathers each entry's input once more in
    backward (it kept only the slice), which recomputation never does: there selective moves no more
    than it, op by op."""
    for r in worlds.run(2, case_tp_traffic, kind=kind, model_dir=model_dirs[kind], tp=2,
                        sequence_parallel=sp):
        plain, selective, full = r["None"], r["selective"], r["full"]
        # each block: two row layers sum forward, two tp entries sum their input gradients backward
        in_blocks = plain["ops"].get("reduce_scatter_tensor" if sp else "all_reduce", (0, 0))[0]
        assert in_blocks >= 4 * r["blocks"], plain["ops"]
        assert set(selective["ops"]) == set(plain["ops"]), (selective["ops"], plain["ops"])
        if sp:
            assert all(c <= plain["ops"][op][0] and b <= plain["ops"][op][1]
                       for op, (c, b) in selective["ops"].items()), (selective["ops"], plain["ops"])
        else:
            assert selective["ops"] == plain["ops"], (selective["ops"], plain["ops"])
        assert sum(b for _, b in full["ops"].values()) > sum(b for _, b in selective["ops"].values()), full["ops"]
        for run in (selective, full):
            assert run["loss"] == plain["loss"]
            assert all(torch.equal(run["grads"][n], g) for n, g in plain["grads"].items())
