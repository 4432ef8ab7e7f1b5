"""Inputs that the plain model refuses, or that would train silently wrong, are refused on every rank:
token ids and labels outside the vocabulary at tp > 1 (a vocab-parallel layer would mask them), and
ranks of one replica given different batches (different contents train wrong; different sequence
lengths would abort inside a collective)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

import qn_hf
from tests.cases import mesh_for
from tests.models import CONFIGS, load, make_batch


def _outcome(fn) -> str:
    try:
        fn()
    except (ValueError, IndexError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def case_index_range(*, model_dir: str, tp: int) -> dict[str, str]:
    pm = qn_hf.parallelize(load("llama", model_dir), tp=tp, mesh=mesh_for(1, tp))
    vocab = CONFIGS["llama"].vocab_size
    batch = make_batch("llama", size=2, seed=0)
    outcomes = {}
    too_big = {**batch, "input_ids": batch["input_ids"].clone()}
    too_big["input_ids"][1, 3] = vocab
    outcomes["id"] = _outcome(lambda: pm.train_step(too_big))
    negative = {**batch, "labels": batch["labels"].clone()}
    negative["labels"][0, 5] = -7
    outcomes["label"] = _outcome(lambda: pm.train_step(negative))
    ignored = {**batch, "labels": batch["labels"].clone()}
    ignored["labels"][0, :4] = -100  # the ignore index is not out of range
    outcomes["ignored"] = _outcome(lambda: pm.train_step(ignored))
    alive = torch.ones(1)
    dist.all_reduce(alive)
    outcomes["world alive"] = str(int(alive.item()))
    return outcomes


def test_out_of_range_ids_and_labels_raise_like_the_plain_model(worlds, model_dirs):
    plain = load("llama", model_dirs["llama"])
    batch = make_batch("llama", size=2, seed=0)
    batch["input_ids"][1, 3] = CONFIGS["llama"].vocab_size
    try:
        plain(**batch)
        raised = False
    except IndexError:
        raised = True
    assert raised  # what the plain model does, and so must every rank
    for tp in (1, 2):
        results = worlds.run(tp, case_index_range, model_dir=model_dirs["llama"], tp=tp)
        assert all(r == results[0] for r in results)
        m = results[0]
        # every rank of the world raises it (agreement.py), naming the lowest rank whose batch failed
        prefix = "IndexError: rank 0's batch: " if tp > 1 else "IndexError: "
        assert m["id"].startswith(prefix + "batch['input_ids'] holds 101, outside the vocabulary [0, 101)"), m
        assert m["label"].startswith(prefix + "batch['labels'] holds -7, outside the vocabulary [0, 101)"), m
        assert m["ignored"] == "no error" and m["world alive"] == str(tp), m


def case_different_batches(*, model_dir: str, tp: int, pp: int, how: str) -> dict[str, str]:
    pm = qn_hf.parallelize(load("llama", model_dir), tp=tp, pp=pp, microbatches=2, mesh=mesh_for(1, tp, pp))
    batch = make_batch("llama", size=4, seed=0, seq=12)
    if dist.get_rank() == 1:
        if how == "contents":
            batch["input_ids"][0, 0] += 1
        elif how == "length":
            batch = make_batch("llama", size=4, seed=0, seq=10)
    outcomes = {"first": _outcome(lambda: pm.train_step(batch))}
    same = make_batch("llama", size=4, seed=1)
    outcomes["same"] = _outcome(lambda: pm.train_step(same))
    later = make_batch("llama", size=4, seed=2)
    if dist.get_rank() == 1:
        later["labels"][1, 1] = 5 if later["labels"][1, 1] != 5 else 6
    outcomes["later"] = _outcome(lambda: pm.train_step(later))  # host contents are agreed every step
    # shapes are agreed on every step, on the host: another length on one rank at a later step
    shorter = make_batch("llama", size=4, seed=3, seq=12 if dist.get_rank() == 0 else 8)
    started = time.monotonic()
    outcomes["later length"] = _outcome(lambda: pm.train_step(shorter))
    outcomes["later length within seconds"] = time.monotonic() - started < 10
    # a check that fails on one rank only raises on every rank, with that rank's message
    lacking = make_batch("llama", size=4, seed=4)
    if dist.get_rank() == 1:
        del lacking["labels"]
    outcomes["one rank's check"] = _outcome(lambda: pm.train_step(lacking))
    pm.agree_batch_contents = False  # the opt-out: contents compared on the first step only
    outcomes["later, opted out"] = _outcome(lambda: pm.train_step(later))
    pm.check_every_batch = True  # the device's check, every step
    outcomes["later, checked"] = _outcome(lambda: pm.train_step(later))
    outcomes["still training"] = _outcome(lambda: pm.train_step(same))
    return outcomes


def test_ranks_of_a_replica_given_different_batches_are_refused(worlds, model_dirs):
    """Issue 66 item 6: contents are agreed every step by default (a CRC of the host batch in the step's host
    all-reduce), naming the ranks; later steps with one rank's label changed trained silently before."""
    for tp, pp, how in ((2, 1, "contents"), (2, 1, "length"), (1, 2, "contents"), (1, 2, "length")):
        results = worlds.run(tp * pp, case_different_batches, model_dir=model_dirs["llama"],
                             tp=tp, pp=pp, how=how)
        assert results[0] == results[1], results
        m = results[0]
        contents = "ValueError: rank(s) 1 were given batches of other contents than rank(s) 0 of the same data-parallel"
        shapes = "ValueError: rank(s) 1 were given batches of other shapes (keys, sizes or dtypes) than rank(s) 0"
        assert m["first"].startswith(contents if how == "contents" else shapes), m
        assert m["same"] == "no error", m
        assert m["later"].startswith(contents), m
        assert m["later length"].startswith(shapes), m
        assert m["later length within seconds"] is True, m
        assert m["one rank's check"].startswith("ValueError: rank 1's batch: batch lacks ['labels']"), m
        assert m["later, opted out"] == "no error", m  # what the opt-out costs: this step trained on two batches
        assert m["later, checked"].startswith("ValueError: the ranks of data-parallel replica(s) [0]"), m
        assert m["still training"] == "no error", m


def case_replica_contents(*, model_dir: str) -> str:
    """dp=2 x tp=2: rank 3 (replica 1's second tp rank) is given another batch than rank 2."""
    pm = qn_hf.parallelize(load("llama", model_dir), dp=2, tp=2, mesh=mesh_for(2, 2))
    batch = make_batch("llama", size=2, seed=10 + pm.coords["dp"])
    if dist.get_rank() == 3:
        batch["attention_mask"] = torch.ones_like(batch["input_ids"])
        batch["attention_mask"][0, -1] = 0
    elif "attention_mask" not in batch:
        batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    return _outcome(lambda: pm.train_step(batch))


def test_the_ranks_whose_batch_differs_are_named(worlds, model_dirs):
    for m in worlds.run(4, case_replica_contents, model_dir=model_dirs["llama"]):
        assert m.startswith("ValueError: rank(s) 3 were given batches of other contents than rank(s) 2 "), m
