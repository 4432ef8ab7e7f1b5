"""qn_hf/compat.py: each fallback for an API newer than the oldest supported release computes what the
newer API does. The torch 2.13 collectives are removed for the duration of a job (tests/compat_cases.py),
and ZeRO-1 and expert parallelism with tp > 1, which call them, still equal the plain model; FSDP's
parameter groups read as torch 2.11 holds them are the installed torch's; transformers 5.17's forms
(experts without their marker, configs without kv_sharing_modes, a finished peer's longer mask) read as
later releases state them. The whole suite under transformers 5.17 is ``make test-compat``."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from qn_hf import compat
from qn_hf.check.shrink import shrink_config
from qn_hf.data_parallel import fsdp_internals
from tests import compat_cases, ep_cases, optim_cases

LOSS_RTOL = 1e-5
WEIGHT_ATOL = 2e-5
GRAD_ATOL = 2e-6  # as tests/test_expert_parallel.py


def _expected_collectives(rank: int, size: int) -> dict:
    return {"gathered": [float(v) for r in range(size) for v in (r, 10 * r)],
            "piece": float(sum(rank + r for r in range(size))), "rank": rank, "size": size}


def test_collectives_prefer_the_new_names_and_fall_back_to_the_old(worlds):
    for results in (worlds.run(2, compat_cases.collective_results),
                    worlds.run(2, compat_cases.on_torch_2_11, inner=compat_cases.collective_results)):
        for r in results:
            calls = r.pop("fallback_calls", None)
            assert r == _expected_collectives(r["rank"], r["size"]), r
            assert calls is None or calls == {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}, calls


def test_zero_on_torch_2_11_collectives_equals_the_plain_model(worlds, model_dirs):
    """ZeRO-1's reduce-scatter and all-gather through the fallbacks (the buckets told the backend is
    not gloo, so that they issue them): the same losses and weights as the plain model with SGD."""
    results = worlds.run(2, compat_cases.on_torch_2_11, inner=optim_cases.zero_parity, native_zero=True, kind="llama",
                         model_dir=model_dirs["llama"], dp=2, tp=1, pp=1, microbatches=2, opt_name="SGD")
    for r in results:
        assert r["fallback_calls"]["reduce_scatter_tensor"] > 0 and r["fallback_calls"]["all_gather_into_tensor"] > 0, r
        assert r["losses"] == r["losses_unsharded"] and r["weight_diff_unsharded"] <= 1e-7, r
        for loss, ref in zip(r["losses"], r["ref_losses"]):
            assert abs(loss - ref) <= LOSS_RTOL * abs(ref), r
        assert r["weight_diff_ref"] < WEIGHT_ATOL, r


def test_expert_parallel_with_tp_on_torch_2_11_collectives_equals_the_plain_model(worlds, tmp_path):
    """ep inside tp=2: the tp ranks share their tokens out and gather the experts' outputs back with
    the all-gather's fallback."""
    results = worlds.run(2, compat_cases.on_torch_2_11, inner=ep_cases.ep_parity, model_type="qwen3_moe",
                         out_dir=str(tmp_path / "hf"), dp=1, tp=2, pp=1, ep=2, microbatches=1)
    for r in results:
        assert r["fallback_calls"].get("all_gather_into_tensor", 0) > 0, r
        assert abs(r["loss"] - r["ref_loss"]) <= LOSS_RTOL * abs(r["ref_loss"]), r
        assert r["grad_err"] < GRAD_ATOL and abs(r["norm"] - r["ref_norm"]) <= LOSS_RTOL * r["ref_norm"], r
    assert results[0]["weight_err"] <= WEIGHT_ATOL and results[0]["moved"] > 1e-3, results[0]


def test_fsdp_param_groups_read_as_torch_2_11_holds_them(worlds, model_dirs):
    """torch 2.11 keeps one optional parameter group per FSDP state: read that way, every state of a
    dp_shard model has the groups the installed torch lists."""
    for r in worlds.run(2, compat_cases.fsdp_groups_both_ways, model_dir=model_dirs["llama"]):
        assert r["same"] and r["groups"] > 0, r

    class Older:  # a state as torch 2.11 builds it, with and without a group
        def __init__(self, group):
            self._fsdp_param_group = group

    assert fsdp_internals.fsdp_param_groups(Older("g")) == ["g"] and fsdp_internals.fsdp_param_groups(Older(None)) == []


def _meta(config) -> torch.nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def test_fused_experts_are_told_by_the_flags_older_releases_set():
    """transformers 5.17's use_experts_implementation sets no _is_expert_parallel: the layout flags it
    sets tell its experts modules, the same ones the marker tells on later releases."""
    model = _meta(shrink_config(AutoConfig.for_model("qwen3_moe")))
    marked = {n for n, m in model.named_modules() if compat.decorated_experts(m)}
    assert marked == {f"model.layers.{i}.mlp.experts" for i in range(model.config.num_hidden_layers)}, marked
    for name in marked:
        module = model.get_submodule(name)
        if hasattr(module, "_is_expert_parallel"):
            del module._is_expert_parallel  # as 5.17 builds it
        assert compat.decorated_experts(module), name
    assert not any(compat.decorated_experts(m) for n, m in model.named_modules() if n not in marked)


def test_kv_sharing_modes_are_computed_as_older_releases_compute_them():
    """Gemma 3n's per-block modes from num_kv_shared_layers and layer_types where the config has no
    kv_sharing_modes (transformers before 5.23), equal to the property where it has one."""
    config = shrink_config(AutoConfig.for_model("gemma3n_text"), layers=6)
    kinds, shared = config.layer_types, config.num_kv_shared_layers
    by_hand = [None] * (6 - shared) + ["reuse"] * shared
    for kind in set(kinds[: 6 - shared]):
        by_hand[max(i for i in range(6 - shared) if kinds[i] == kind)] = "store"
    assert "reuse" in by_hand and "store" in by_hand

    class Older:  # the fields 5.17's config has, no property
        layer_types, num_kv_shared_layers = kinds, shared

    assert compat.per_layer(Older(), compat.KV_SHARING_MODES) == by_hand
    if hasattr(type(config), compat.KV_SHARING_MODES):
        assert config.kv_sharing_modes == by_hand
    assert compat.per_layer(config, compat.KV_SHARING_MODES) == by_hand

    class Unshared:
        layer_types, num_kv_shared_layers = kinds, 0

    assert compat.per_layer(Unshared(), compat.KV_SHARING_MODES) == [None] * 6
    assert compat.per_layer(Older(), "layer_types") == kinds and compat.per_layer(Older(), "absent") is None


def test_a_finished_peers_longer_mask_is_cut_to_its_ids():
    """transformers 5.17 extends a finished peer's mask past its ids under synced_gpus without a cache:
    the hook cuts it back to the mask those ids had, and leaves every other call alone."""
    ids = torch.ones(2, 5, dtype=torch.long)
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    args, kwargs = compat.trim_attention_mask(None, (), {"input_ids": ids, "attention_mask": mask})
    assert args == () and torch.equal(kwargs["attention_mask"], mask[:, :5]) and kwargs["input_ids"] is ids
    assert compat.trim_attention_mask(None, (), {"input_ids": ids, "attention_mask": mask[:, :5]}) is None
    assert compat.trim_attention_mask(None, (), {"input_ids": ids}) is None
