"""Bad configurations raise the same ValueError on every rank before any collective: the world
stays usable afterwards (a rank stuck in a collective would make the next all-reduce time out)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import qn_hf
from tests.cases import error_message, mesh_for
from tests.models import CONFIGS, load, make_batch


def case_bad_configs(*, gpt2_dir: str) -> dict[str, str]:
    odd_kv = LlamaConfig(**{**CONFIGS["llama"].to_dict(), "num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 24})
    messages = {
        "world size": error_message(lambda: qn_hf.parallelize(load("gpt2", gpt2_dir), dp=1, tp=1)),
        # the wrong launch is named first, not a consequence of it (ep must divide dp*tp=1)
        "world size before ep": error_message(lambda: qn_hf.parallelize(load("gpt2", gpt2_dir), ep=2)),
        "schedule": error_message(lambda: qn_hf.parallelize(load("gpt2", gpt2_dir), dp=2, tp=1, schedule="nope")),
        "heads": error_message(lambda: qn_hf.parallelize(GPT2LMHeadModel(GPT2Config(n_head=3, n_embd=24, n_layer=1)), tp=2)),
        "kv heads": error_message(lambda: qn_hf.parallelize(LlamaForCausalLM(odd_kv), tp=2)),
    }
    pm = qn_hf.parallelize(load("gpt2", gpt2_dir), tp=2, microbatches=4, mesh=mesh_for(1, 2))
    batch = make_batch("gpt2", size=3, seed=0)
    messages["microbatches"] = error_message(lambda: pm.train_step(batch))
    eight = GPT2LMHeadModel(GPT2Config(n_head=4, n_embd=32, n_layer=8))
    messages["chunks too many"] = error_message(lambda: qn_hf.parallelize(
        load("gpt2", gpt2_dir), pp=2, microbatches=2, schedule="interleaved_1f1b", virtual_stages=3))
    messages["interleaved M"] = error_message(lambda: qn_hf.parallelize(
        eight, pp=2, microbatches=5 * 2 + 1, schedule="interleaved_1f1b", virtual_stages=2))
    messages["virtual with 1f1b"] = error_message(lambda: qn_hf.parallelize(eight, pp=2, microbatches=2,
                                                                            virtual_stages=2))
    messages["interleaved pp=1"] = error_message(lambda: qn_hf.parallelize(
        eight, dp=2, microbatches=2, schedule="interleaved_1f1b", virtual_stages=2))
    messages["labels"] = error_message(lambda: pm.train_step({"input_ids": batch["input_ids"][:2]}))
    one_block = GPT2LMHeadModel(GPT2Config(n_head=4, n_embd=32, n_layer=1))
    messages["pp too large"] = error_message(lambda: qn_hf.parallelize(one_block, pp=2))
    piped = qn_hf.parallelize(load("gpt2", gpt2_dir), pp=2, microbatches=4, mesh=mesh_for(1, 1, 2))
    messages["pipeline microbatches"] = error_message(lambda: piped.train_step(batch))
    messages["pipeline forward call"] = error_message(lambda: piped(input_ids=batch["input_ids"]))
    alive = torch.ones(1)
    dist.all_reduce(alive)
    messages["world alive"] = str(int(alive.item()))
    return messages


def test_every_rank_raises_before_any_collective(worlds, model_dirs):
    results = worlds.run(2, case_bad_configs, gpt2_dir=model_dirs["gpt2"])
    assert results[0] == results[1]
    m = results[0]
    assert "world size 2 != dp*tp*pp = 1*1*1 = 1" in m["world size"]
    assert m["world size before ep"].startswith("world size 2 != dp*tp*pp = 1*1*1 = 1"), m["world size before ep"]
    assert "schedule='nope' is unknown" in m["schedule"]
    assert all(name in m["schedule"] for name in ("1f1b", "gpipe", "interleaved_1f1b", "zb_h1")), m["schedule"]
    assert "tp=2 does not divide num_attention_heads=3; use a tp among [1, 3]" in m["heads"]
    assert "tp=2 does not divide num_key_value_heads=3" in m["kv heads"]
    assert "microbatches=4 is more than the local batch size 3" in m["microbatches"]
    assert "batch lacks ['labels']" in m["labels"] and "labels=input_ids" in m["labels"] and "loss_fn" in m["labels"]
    assert "pp=2 is larger than the number of blocks (1); use pp <= 1" in m["pp too large"]
    assert "microbatches=4 is more than the local batch size 3" in m["pipeline microbatches"]
    assert "pp=2 x virtual_stages=3 = 6 chunks is larger than the number of blocks (5)" in m["chunks too many"]
    assert "microbatches=11 is not allowed for interleaved_1f1b at pp=2" in m["interleaved M"], m["interleaved M"]
    assert "use 10 or 12" in m["interleaved M"], m["interleaved M"]
    assert "virtual_stages=2" in m["virtual with 1f1b"] and "interleaved_1f1b" in m["virtual with 1f1b"]
    assert "'1f1b'" in m["interleaved pp=1"], m["interleaved pp=1"]
    assert "a forward call needs the whole pipeline (pp=2)" in m["pipeline forward call"]
    assert m["world alive"] == "2"


# One mesh of two ranks per build pass, where the pass applies (a MoE model, so that expert
# parallelism has experts to shard).
PASS_MESHES = {
    "context parallel": dict(cp=2),
    "host masks": dict(dp=2),  # at cp=1 it stands in for context parallel
    "cast": dict(dp=2, mixed_precision="bf16"),
    "expert parallel": dict(dp=2, ep=2),
    "stage cut": dict(pp=2, microbatches=2),
    "tensor parallel": dict(tp=2),
    "sequence parallel": dict(tp=2, sequence_parallel=True),
    "place on device": dict(dp=2),
    "cast new parameters": dict(dp=2, mixed_precision="bf16"),
    "synchronize replicas": dict(dp=2),
    "dropout seed": dict(dp=2),
    "dropout streams": dict(dp=2),
    "recompute": dict(dp=2, recompute="full"),
    "batch statistics": dict(dp=2),  # on a small ResNet: the pass applies to BatchNorm layers
    "shard data parallel": dict(dp=2, dp_shard=2),
    "split backward": dict(pp=2, microbatches=2, schedule="zb_h1"),
    "compile": dict(dp=2, compile=True),
}


def case_one_rank_fails_a_pass(*, kind: type[Exception]) -> dict[str, str]:
    """For each build pass, parallelize with that pass raising on rank 1 only: what each rank raised."""
    import datetime

    from transformers import ResNetConfig, ResNetForImageClassification

    from qn_hf.transform import passes
    from tests.ep_cases import moe_config

    def failing(step):
        def run(b):
            if dist.get_rank() == 1:
                raise kind(f"injected into {step.name}")
            if step.run is not None:  # an exchange alone: the failure comes before it
                step.run(b)
        return dataclasses.replace(step, run=run)

    original, raised = passes.PASSES, {}
    for name, mesh in PASS_MESHES.items():
        passes.PASSES = tuple(failing(s) if s.name == name else s for s in original)
        if name == "batch statistics":
            model = ResNetForImageClassification(ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                                              layer_type="basic"))
        else:
            model = AutoModelForCausalLM.from_config(CONFIGS["llama"] if name == "compile" else moe_config("qwen3_moe"))
        try:
            qn_hf.parallelize(model, **mesh, timeout=datetime.timedelta(seconds=120))
            raised[name] = "no error"
        except Exception as e:  # noqa: BLE001 -- the type is part of what is compared
            raised[name] = f"{type(e).__name__}: {e}"
        finally:
            passes.PASSES = original
    alive = torch.ones(1)
    dist.all_reduce(alive)
    raised["world alive"] = str(int(alive.item()))
    return raised


@pytest.mark.parametrize("kind", [RuntimeError, pytest.param(ValueError, marks=pytest.mark.long)])
def test_a_pass_failing_on_one_rank_raises_on_every_rank(worlds, kind):
    """A build pass that fails on one rank only (a stage reads its own layers) is raised on every rank
    with the same message, naming the rank and the pass, and nothing waits: no rank enters a collective
    the failing one skips, and the world stays usable."""
    from qn_hf.transform.passes import PASSES

    assert set(PASS_MESHES) == {p.name for p in PASSES}, "a new build pass needs a mesh where it applies"
    results = worlds.run(2, case_one_rank_fails_a_pass, kind=kind)
    assert results[0] == results[1]
    for name in PASS_MESHES:
        message = results[0][name]
        expected = f"{kind.__name__}: "
        assert message.startswith(expected + f"injected into {name}"), (name, message)
        assert f"[rank 1 of 2 failed in '{name}'; every rank raises this]" in message, (name, message)
    assert results[0]["world alive"] == "2"
