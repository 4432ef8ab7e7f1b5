"""After parallelize, a pipeline rank holds only its stage's modules; the rest are freed."""

from __future__ import annotations

import copy
import gc
import os
import weakref

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config

import qn_hf
from qn_hf.pipeline.split import build_stage_plan
from qn_hf.pipeline.stage import apply_stage
from qn_hf.pipeline.standins import Injector, StandIn
from qn_hf.policies import resolve_policy
from tests.cases import mesh_for
from tests.models import CONFIGS, auto_class, load
from tests.releases import needs_tp_plan


def case_stage_contents(*, gpt2_dir: str) -> dict:
    model = load("gpt2", gpt2_dir)
    blocks = [weakref.ref(b) for b in model.transformer.h]
    pm = qn_hf.parallelize(model, pp=2, mesh=mesh_for(1, 1, 2))
    gc.collect()
    return {
        "stage": pm.coords["pp"],
        "names": sorted({".".join(n.split(".")[:3]) if ".h." in n else n.rsplit(".", 1)[0] for n, _ in pm.named_parameters()}),
        "blocks alive": [ref() is not None for ref in blocks],
    }


def test_each_stage_keeps_only_its_modules(worlds, model_dirs):
    first, last = worlds.run(2, case_stage_contents, gpt2_dir=model_dirs["gpt2"])
    assert first["names"] == ["transformer.h.0", "transformer.h.1", "transformer.h.2", "transformer.wpe", "transformer.wte"]
    assert last["names"] == ["lm_head", "transformer.h.3", "transformer.h.4", "transformer.ln_f"]
    assert first["blocks alive"] == [True, True, True, False, False]
    assert last["blocks alive"] == [False, False, False, True, True]


def case_save_replaces_other_layout(*, gpt2_dir: str, out_dir: str) -> list[str]:
    import os

    import torch.distributed as dist
    from safetensors.torch import save_file

    if dist.get_rank() == 0:
        os.makedirs(out_dir, exist_ok=True)
        save_file({"stale": torch.zeros(1)}, os.path.join(out_dir, "model.safetensors"))  # an earlier pp=1 save
    dist.barrier()
    pm = qn_hf.parallelize(load("gpt2", gpt2_dir), pp=2, mesh=mesh_for(1, 1, 2))
    pm.save_pretrained(out_dir)
    return sorted(os.listdir(out_dir))


def test_save_replaces_a_stale_layout(worlds, model_dirs, tmp_path):
    files = worlds.run(2, case_save_replaces_other_layout, gpt2_dir=model_dirs["gpt2"],
                       out_dir=str(tmp_path / "out"))[0]
    assert "model.safetensors" not in files
    assert {"model-pp000-00001.safetensors", "model-pp001-00001.safetensors", "model.safetensors.index.json"} <= set(files)
    reloaded = load("gpt2", str(tmp_path / "out"))
    reference = load("gpt2", model_dirs["gpt2"])
    assert all(torch.equal(a, b) for a, b in zip(reloaded.state_dict().values(), reference.state_dict().values()))


def case_small_files(*, gpt2_dir: str, out_dir: str) -> list[str]:
    import os

    pm = qn_hf.parallelize(load("gpt2", gpt2_dir), tp=2, mesh=mesh_for(1, 2))
    pm.save_pretrained(out_dir, max_shard_size=40_000)
    return sorted(os.listdir(out_dir))


def test_save_pretrained_splits_files_by_size(worlds, model_dirs, tmp_path):
    out = str(tmp_path / "out")
    files = worlds.run(2, case_small_files, gpt2_dir=model_dirs["gpt2"], out_dir=out)[0]
    weights = [f for f in files if f.endswith(".safetensors")]
    assert len(weights) > 2 and "model.safetensors.index.json" in files
    assert all(os.path.getsize(os.path.join(out, f)) < 40_000 + 20_000 for f in weights)  # one tensor may overflow
    reloaded, reference = load("gpt2", out).state_dict(), load("gpt2", model_dirs["gpt2"]).state_dict()
    assert all(torch.equal(reloaded[k], reference[k]) for k in reference)


def test_stages_run_in_one_process_give_the_whole_model_logits():
    torch.manual_seed(0)
    model = auto_class("gpt2").from_config(CONFIGS["gpt2"]).eval()
    plan = build_stage_plan(model, resolve_policy(model, None), stages=2)
    first, last = (apply_stage(copy.deepcopy(model), plan, stage=s) for s in (0, 1))
    assert (first.is_first, first.is_last, last.is_first, last.is_last) == (True, False, False, True)
    assert first.injector is None and isinstance(last.injector, Injector) and last.plan is plan
    assert last.base is last.model.transformer and isinstance(first.model.lm_head, StandIn)
    inputs = {"input_ids": torch.randint(0, 99, (2, 7))}
    with torch.no_grad():
        sent = first.forward(inputs, None, use_cache=False)
        outputs = last.forward(inputs, sent, use_cache=False)
        expected = model(**inputs, use_cache=False).logits
    assert sent.shape == (2, 7, 32)
    torch.testing.assert_close(outputs.logits, expected)


def test_one_stage_runs_the_whole_model():
    model = auto_class("gpt2").from_config(CONFIGS["gpt2"]).eval()
    plan = build_stage_plan(model, resolve_policy(model, None), stages=1)
    stage = apply_stage(model, plan, stage=0)
    assert (stage.model, stage.base, stage.injector, stage.is_first, stage.is_last) == (
        model, model.transformer, None, True, True)
    inputs = {"input_ids": torch.randint(0, 99, (1, 5))}
    with torch.no_grad():
        torch.testing.assert_close(stage.forward(inputs, None).logits, model(**inputs).logits)


def _chunks_in_one_process(model, *, stages: int, virtual: int, inputs: dict) -> torch.Tensor:
    """Run every chunk in model order on its rank's model, passing activations by hand."""
    plan = build_stage_plan(model, resolve_policy(model, None), stages=stages, virtual=virtual)
    ranks = [apply_stage(copy.deepcopy(model), plan, stage=s) for s in range(stages)]
    sent = None
    for chunk in range(plan.chunks):
        sent = ranks[plan.rank_of_chunk(chunk)].forward(inputs, sent, chunk=chunk, use_cache=False)
    return ranks, sent.logits


def test_interleaved_chunks_give_the_whole_model_logits():
    """pp=2 x 2 chunks of an 8-block GPT-2 (learned positions added once, on chunk 0; ln_f real on
    the last chunk only although rank 1 also runs chunk 1) and Gemma 3 (per-layer ``layer_types``
    cut per chunk: sliding and full attention layers keep their own masks)."""
    torch.manual_seed(0)
    gpt2 = auto_class("gpt2").from_config(GPT2Config(**{**CONFIGS["gpt2"].to_dict(), "n_layer": 8})).eval()
    inputs = {"input_ids": torch.randint(0, 99, (2, 7))}
    with torch.no_grad():
        ranks, logits = _chunks_in_one_process(gpt2, stages=2, virtual=2, inputs=inputs)
        torch.testing.assert_close(logits, gpt2(**inputs, use_cache=False).logits)
    assert [r.chunks for r in ranks] == [(0, 2), (1, 3)]
    assert sorted(int(k) for k in ranks[0].model.transformer.h._modules) == [0, 1, 4, 5]
    assert not isinstance(ranks[0].model.transformer.wte, StandIn) and isinstance(ranks[0].model.lm_head, StandIn)
    assert not isinstance(ranks[1].model.transformer.ln_f, StandIn)  # the rank's view: its real modules
    gemma = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "gemma3_text", hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=99, sliding_window=3, sliding_window_pattern=2)).eval()
    ids = {"input_ids": torch.randint(0, 99, (2, 9))}
    with torch.no_grad():
        _, logits = _chunks_in_one_process(gemma, stages=2, virtual=2, inputs=ids)
        torch.testing.assert_close(logits, gemma(**ids, use_cache=False).logits)


# model type, config overrides, mesh: base forwards that turn the embedding into the blocks' input
# before the blocks. Granite multiplies it (embedding_multiplier; 1.0 in the default config, where a
# second multiplication on a later stage went unseen: 12.0 here, as in Granite 3), DeepSeek-V4
# expands it into hyper-connection streams (and its hc_head runs after the blocks, on the last
# stage), NanoChat normalizes it with the parameter-free norm it also applies after the blocks.
RECEIVE_AT_BLOCKS_CASES = [
    ("granite", {"embedding_multiplier": 12.0}, dict(pp=2)),
    ("granite", {"embedding_multiplier": 12.0}, dict(tp=2, pp=2, sequence_parallel=True)),
    ("deepseek_v4", {}, dict(pp=2)),
    ("nanochat", {}, dict(pp=2, virtual_stages=2)),
]


@pytest.mark.parametrize(("model_type", "overrides", "mesh"), RECEIVE_AT_BLOCKS_CASES,
                         ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}{x}" for k, x in v.items()))
def test_stages_receive_at_their_blocks_where_the_forward_transforms_the_embedding(worlds, model_type, overrides, mesh):
    from qn_hf.check.zoo import ZooMesh
    from tests import zoo_cases
    from tests.test_zoo import _config

    needs_tp_plan(model_type)  # DeepSeek-V4's, which transformers 5.17 does not ship
    column = ZooMesh(**mesh)
    verdict = worlds.run(column.size, zoo_cases.zoo_step, config={**_config(model_type), **overrides}, mesh=column)[0]
    assert verdict["verdict"] == "equal", (verdict["reason"], verdict["worst"][:5])
    assert verdict["moved"] > 1e-3


def _shrunk_meta(model_type: str) -> torch.nn.Module:
    from transformers import CONFIG_MAPPING

    from qn_hf.check.shrink import shrink_config

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(shrink_config(CONFIG_MAPPING[model_type]()))


def test_which_stages_receive_at_their_blocks_is_read_from_the_forward():
    """Llama's blocks take the embedding as it is (the entry's stand-in hands over the received
    activation); Granite's take it multiplied (its stages receive at the blocks); HY-V4 hands each
    block the previous block's top-k indices, which no stage boundary carries: refused before
    anything runs."""
    from qn_hf.policies.derive import derive_policy

    assert not derive_policy(_shrunk_meta("llama")).pp_receive_at_blocks
    assert derive_policy(_shrunk_meta("granite")).pp_receive_at_blocks
    hy = _shrunk_meta("hy_v4")  # indexer_types full, full, shared, shared: only block 1 may start a chunk
    with pytest.raises(ValueError, match=r"pp=2 \(hy_v4\): its base forward hands each block topk_indices.*"
                                         r"layers_per_stage=\[1, 3\] cuts only before blocks that make it anew"):
        build_stage_plan(hy, derive_policy(hy), stages=2)
    with pytest.raises(ValueError, match=r"no cut into 3 chunks starts only at blocks that make it anew \(\[1\]\)"):
        build_stage_plan(hy, derive_policy(hy), stages=3)


def _hy_v4_step() -> dict:
    from transformers import CONFIG_MAPPING

    from qn_hf.check.run import one_step_parity
    from qn_hf.check.shrink import shrink_config
    from qn_hf.config.parallel_config import ParallelConfig

    config = shrink_config(CONFIG_MAPPING["hy_v4"]()).to_dict()
    return one_step_parity(config=config, parallel=ParallelConfig.from_keywords(pp=2, microbatches=2,
                                                                                layers_per_stage=[1, 3]))


def test_a_cut_the_refusal_names_trains_equal(worlds):
    """HY-V4 at pp=2 with the layers_per_stage its refusal names: equal to the plain model."""
    verdict = worlds.run(2, _hy_v4_step)[0]
    assert verdict["verdict"] == "equal", verdict


def test_stages_receive_expanded_streams_at_the_blocks():
    """DeepSeek-V4's blocks take the embedding expanded into its hyper-connection streams: its stages
    receive at the blocks, and the head that folds the streams (hc_head) runs after them."""
    from qn_hf.policies.derive import derive_policy

    needs_tp_plan("deepseek_v4")
    deepseek = derive_policy(_shrunk_meta("deepseek_v4"))
    assert deepseek.pp_receive_at_blocks and "hc_head" in deepseek.pp_last
