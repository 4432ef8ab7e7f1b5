"""``pm.logits`` gives the plain model's logits (or a reduction of them) at any mesh, on the ranks
asked for; ``pm.local_batch`` cuts a global batch for this dp replica so that the step equals the
plain model's on the whole batch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import qn_hf
from tests.cases import mesh_for
from tests.models import dp_slice, load, make_batch


def logits_case(*, kind: str, model_dir: str, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1,
                microbatches: int = 1, schedule: str = "1f1b", virtual_stages: int = 1,
                sequence_parallel: bool = False) -> dict:
    torch.manual_seed(0)
    ref = load(kind, model_dir).eval()
    pm = qn_hf.parallelize(load(kind, model_dir), dp=dp, tp=tp, pp=pp, cp=cp, microbatches=microbatches,
                           schedule=schedule, virtual_stages=virtual_stages, sequence_parallel=sequence_parallel,
                           mesh=mesh_for(dp, tp, pp, cp))
    pm.module.train()  # from_pretrained returns evaluation mode; logits must put training mode back
    batch = make_batch(kind, size=dp * 2 * microbatches, seed=4, seq=16, padded=cp == 1)
    local = dp_slice(batch, dp=dp, dp_rank=pm.coords["dp"])
    inputs = {k: v for k, v in local.items() if k != "labels"}
    with torch.no_grad():
        expected = ref(**inputs).logits
    whole = pm.logits(inputs)
    picked = pm.logits(local, reduce=lambda logits, mb: logits.argmax(-1) + 0 * mb["labels"])
    last_only = pm.logits(inputs, broadcast=False)
    return {"err": (whole - expected).abs().max().item(), "shape": list(whole.shape),
            "expected_shape": list(expected.shape), "argmax": torch.equal(picked, expected.argmax(-1)),
            "last_only": last_only is not None, "last_stage": pm.coords["pp"] == pp - 1,
            "training_restored": pm.module.training}


LOGITS_CASES = [  # kind, dp, tp, pp, cp, microbatches, schedule, virtual_stages, sequence_parallel
    ("gpt2", 1, 2, 1, 1, 1, "1f1b", 1, False),  # vocabulary padded over tp, tied head
    ("llama", 1, 1, 2, 1, 2, "1f1b", 1, False),
    ("llama", 1, 2, 2, 1, 2, "gpipe", 1, True),
    ("llama_deep", 1, 1, 2, 1, 2, "interleaved_1f1b", 2, False),
    ("llama", 1, 1, 1, 2, 1, "1f1b", 1, False),  # the sequence back from the cp ranks
    ("llama", 2, 1, 2, 1, 1, "1f1b", 1, False),
]


@pytest.mark.parametrize(("kind", "dp", "tp", "pp", "cp", "microbatches", "schedule", "virtual_stages", "sp"),
                         LOGITS_CASES)
def test_logits_equal_the_plain_model(worlds, model_dirs, kind, dp, tp, pp, cp, microbatches, schedule,
                                      virtual_stages, sp):
    results = worlds.run(dp * tp * pp * cp, logits_case, kind=kind, model_dir=model_dirs[kind],
                         dp=dp, tp=tp, pp=pp, cp=cp, microbatches=microbatches, schedule=schedule,
                         virtual_stages=virtual_stages, sequence_parallel=sp)
    for r in results:
        assert r["shape"] == r["expected_shape"] and r["err"] < 1e-5 and r["argmax"], r
        assert r["last_only"] == (r["last_stage"] or pp == 1), r
        assert r["training_restored"], r


def local_batch_case(*, model_dir: str, dp: int, microbatches: int, rows: int) -> dict:
    torch.manual_seed(0)
    ref = load("llama", model_dir)
    pm = qn_hf.parallelize(load("llama", model_dir), dp=dp, microbatches=microbatches, mesh=mesh_for(dp, 1))
    batch = make_batch("llama", size=rows, seed=9, padded=True)
    mine = pm.local_batch(batch)
    loss = pm.train_step(mine).item()
    ref_loss = ref(**batch).loss.item()
    return {"rows": mine["input_ids"].shape[0], "loss": loss, "ref_loss": ref_loss, "rank": dist.get_rank()}


def test_local_batch_cuts_a_global_batch_for_this_replica(worlds, model_dirs):
    """5 rows over dp=2 x 2 microbatches: padded to 8 with rows that carry no loss, 4 per replica; the
    step's loss is the plain model's on the 5 real rows."""
    for r in worlds.run(2, local_batch_case, model_dir=model_dirs["llama"], dp=2,
                        microbatches=2, rows=5):
        assert r["rows"] == 4 and abs(r["loss"] - r["ref_loss"]) <= 1e-5 * abs(r["ref_loss"]), r
