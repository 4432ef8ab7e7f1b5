"""ZB-H1 really splits backward: deferred weight gradients arrive in the W passes, everything else
in B, and a W pass communicates nothing."""

from __future__ import annotations

import time

import qn_hf
from tests.cases import mesh_for
from tests.models import load, make_batch


def case_where_gradients_arrive(*, model_dir: str, tp: int) -> dict:
    pm = qn_hf.parallelize(load("llama_deep", model_dir), tp=tp, pp=2, microbatches=4, schedule="zb_h1",
                           mesh=mesh_for(1, tp, 2))
    deferred = pm.deferred
    arrivals: list[tuple[str, float]] = []
    for name, p in pm.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, name=name: arrivals.append((name, time.perf_counter())))
    pm.executor.events = []
    with qn_hf.CommMeter(pm) as meter:
        pm.train_step(make_batch("llama_deep", size=4, seed=3))
    events = pm.executor.events

    def op_at(t: float) -> str:
        return next(str(e.op) for e in events if e.start <= t <= e.stop)

    where = {(name in deferred, op_at(t)) for name, t in arrivals}
    passes = [e for e in events if str(e.op) == "wgt"]
    during_w = [c for c in meter.events if any(w.start <= c.time <= w.stop for w in passes)]
    return {"deferred": len(deferred), "where": sorted(where), "w_passes": len(passes),
            "collectives_in_w": len(during_w), "names": sorted(deferred)[:3]}


def test_weight_gradients_arrive_in_the_weight_passes(worlds, model_dirs):
    for tp in (1, 2):
        for r in worlds.run(2 * tp, case_where_gradients_arrive,
                            model_dir=model_dirs["llama_deep"], tp=tp):
            assert r["deferred"] > 0 and r["w_passes"] == 4, r
            # deferred weights only in W, the rest (norms, embedding, head, row biases) only in B
            assert r["where"] == [(False, "bwd"), (True, "wgt")], r
            assert r["collectives_in_w"] == 0, r
