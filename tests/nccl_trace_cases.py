"""Rank-side jobs: record the communication calls of real pipeline steps, for the NCCL replay."""

from __future__ import annotations

import torch

import qn_hf
from tests.cases import mesh_for
from tests.models import load, make_batch
from tests.p2p_recorder import CallRecorder


def record_pipeline(*, kind: str, model_dir: str, pp: int, schedule: str, microbatches: int,
                    virtual_stages: int = 1, generate: bool = False) -> dict[str, list[dict]]:
    """Each step's recorded calls on this rank: two training steps (the first announces the
    activations' shape with a header, the second is the steady state), an evaluation step and, with
    ``generate``, a three-token ``generate``."""
    torch.manual_seed(0)
    pm = qn_hf.parallelize(load(kind, model_dir), pp=pp, schedule=schedule, microbatches=microbatches,
                           virtual_stages=virtual_stages, mesh=mesh_for(1, 1, pp))
    batch = make_batch(kind, size=2 * microbatches, seed=3)
    traces = {}
    for name, run in (("train_first", lambda: pm.train_step(batch)), ("train_steady", lambda: pm.train_step(batch)),
                      ("eval", lambda: pm.eval_step(batch))):
        with CallRecorder() as recorder:
            run()
        traces[name] = [call.to_json() for call in recorder.calls]
    if generate:
        with CallRecorder() as recorder:
            pm.generate(batch["input_ids"][:1, :4], max_new_tokens=3, do_sample=False)
        traces["generate"] = [call.to_json() for call in recorder.calls]
    return traces


def record_expert_pipeline(*, pp: int, dp: int, ep: int, schedule: str, microbatches: int,
                           virtual_stages: int = 1) -> dict[str, list[dict]]:
    """Two training steps of a shrunk Qwen3-MoE at dp x pp with experts over ep: each MoE call's
    all-to-alls on the ep group interleave with the schedule's transfers on pp."""
    from qn_hf.check.run import build
    from tests.ep_cases import moe_config

    pm = qn_hf.parallelize(build(moe_config("qwen3_moe"), seed=0), dp=dp, pp=pp, ep=ep, schedule=schedule,
                           microbatches=microbatches, virtual_stages=virtual_stages, mesh=mesh_for(dp, 1, pp))
    ids = torch.randint(3, 100, (2 * microbatches, 12), generator=torch.Generator().manual_seed(pm.coords["dp"]))
    batch = {"input_ids": ids, "labels": ids.clone()}
    traces = {}
    for name in ("train_first", "train_steady"):
        with CallRecorder() as recorder:
            pm.train_step(batch)
        traces[name] = [call.to_json() for call in recorder.calls]
    return traces
