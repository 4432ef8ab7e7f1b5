"""Rank-side jobs: record the communication calls of ``parallelize`` and of real steps, for the NCCL
replay, while NCCL's first-use rule is emulated (``tests/nccl_first_use.py``): a job that returns
has run on gloo as a job under that rule would."""

from __future__ import annotations

import contextlib
from unittest import mock

import torch

import qn_hf
from qn_hf.pipeline import p2p
from qn_hf.pipeline.runtime import StageExecutor
from tests.models import dp_slice, load, make_batch
from tests.nccl_first_use import FirstUseHang, FirstUseRule
from tests.p2p_recorder import CallRecorder

# Each feature's part of a mesh, beside pp (and its schedule): one rank count more or less each.
FEATURES = {
    "plain": dict(),
    "dp": dict(dp=2),
    "tp": dict(tp=2),
    "sp": dict(tp=2, sequence_parallel=True),
    "cp": dict(cp=2),
    "ep": dict(dp=2, ep=2),
    "dp_shard": dict(dp=2, dp_shard=2),
}


def world_size(mesh: dict) -> int:
    return mesh.get("dp", 1) * mesh.get("tp", 1) * mesh.get("pp", 1) * mesh.get("cp", 1)


def _model(kind: str, model_dir: str | None):
    if kind.startswith("qwen3_moe"):
        from transformers import CONFIG_MAPPING

        from qn_hf.check.run import build
        from qn_hf.check.shrink import shrink_config

        # (_deep: 8 blocks, for interleaved chunks at pp=4 x V=2, as llama_deep)
        return build(shrink_config(CONFIG_MAPPING["qwen3_moe"](), layers=8 if kind.endswith("_deep") else 4), seed=0)
    return load(kind, model_dir)


def _batch(kind: str, pm, *, rows: int) -> dict[str, torch.Tensor]:
    dp = pm.parallel_config.dims.dp
    if kind.startswith("qwen3_moe"):
        ids = torch.randint(3, 100, (rows * dp, 16), generator=torch.Generator().manual_seed(3))
        whole = {"input_ids": ids, "labels": ids.clone()}
    else:
        whole = make_batch(kind, size=rows * dp, seed=3, seq=16)
    return dp_slice(whole, dp=dp, dp_rank=pm.coords["dp"])


def _posted_ahead_of_sends(self, step, rest, keys) -> None:
    """The runtime's receive posting before issue 67: the next receive, even ahead of a send (today's, shown the
    receives of the rest of the list only)."""
    from qn_hf.pipeline.schedule import Op

    receives = [(a, k) for a, k in zip(rest, keys) if a.op in (Op.RECV_FWD, Op.RECV_BWD)]
    _TODAYS(self, step, [a for a, _ in receives], [k for _, k in receives])


_TODAYS = StageExecutor._post_next_receive


def record_steps(*, kind: str, model_dir: str | None, mesh: dict, generate: bool = False,
                 warm_up: bool = True, ahead_of_sends: bool = False) -> dict:
    """Every call this rank makes from ``parallelize`` on: the build, two training steps (the first
    announces the activations' shape with a header, the second is the steady state), an evaluation
    and, with ``generate``, a three-token ``generate``, all under the first-use rule. Returns the
    calls and where each part begins and ends (``marks``), or, when a first use would hang
    (``warm_up=False`` removes the links' warm-up), ``{"hang": message}``. ``ahead_of_sends``: the runtime's
    receive posting before issue 67 (``_posted_ahead_of_sends``)."""
    torch.manual_seed(0)
    model = _model(kind, model_dir)
    marks, recorder = {}, CallRecorder()
    skip = contextlib.nullcontext() if warm_up else mock.patch.object(p2p, "warm_up", lambda *a, **k: None)
    ahead = (mock.patch.object(StageExecutor, "_post_next_receive", _posted_ahead_of_sends) if ahead_of_sends
             else contextlib.nullcontext())
    try:
        with skip, ahead, FirstUseRule(timeout_s=10 if not warm_up else 60), recorder:
            start = len(recorder.calls)
            pm = qn_hf.parallelize(model, **mesh)
            marks["build"] = (start, len(recorder.calls))
            batch = _batch(kind, pm, rows=2 * mesh.get("microbatches", 1))
            parts = [("train_first", lambda: pm.train_step(batch)), ("train_steady", lambda: pm.train_step(batch)),
                     ("eval", lambda: pm.eval_step(batch))]
            if generate:
                parts.append(("generate", lambda: pm.generate(batch["input_ids"][:1, :4], max_new_tokens=3,
                                                              do_sample=False)))
            for name, run in parts:
                start = len(recorder.calls)
                run()
                marks[name] = (start, len(recorder.calls))
    except FirstUseHang as e:
        return {"hang": str(e)}
    return {"calls": [call.to_json() for call in recorder.calls], "marks": marks, "stage": pm.coords["pp"],
            "virtual_stages": pm.parallel_config.virtual_stages}
