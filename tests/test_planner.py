"""The planner against the real thing: per-rank parameters and per-step traffic of ``parallelize``.

Each case parallelizes a tiny model, runs one ``train_step`` under ``CommMeter`` on every rank, and
compares with ``estimate_mesh`` for the same config and mesh: parameters exactly, bytes per group
exactly, calls exactly (dp: at most the bucket bound), and tp's calls and bytes per operation.
Expert parallelism (a shrunk Qwen3-MoE with its own routing): the same, per operation on tp and ep,
except that the all-to-alls' bytes are compared summed over each ep group (ep times the estimate).
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, BertConfig, GPT2Config, LlamaConfig, T5Config, ViTConfig

import qn_hf
from qn_hf.check.run import build
from qn_hf.checkpoint.layout import meta_model
from qn_hf.config.parallel_config import ParallelConfig
from qn_hf.planner.cli import main
from qn_hf.planner.estimate import Planner, estimate_mesh
from qn_hf.policies import resolve_policy
from qn_hf.tensor_parallel.plan import build_tp_plan
from tests.cases import mesh_for, parallelize_as_launched
from tests.ep_cases import moe_config
from tests.models import dp_slice, load, make_batch
from tests.releases import needs_expert_tp_rules, splits_experts_over_tp

SEQ = 12  # make_batch's sequence length
SEQ_LEN = {"bert-large": 512, "gpt2-xl": 1024}  # a public config planned at other than 2048 positions (learned positions: its most)
BUCKET_MB = 0.02


def case_measure(*, kind: str, model_dir: str, dp: int, tp: int, pp: int, microbatches: int, schedule: str,
                 sequence_parallel: bool = False) -> dict:
    pm = qn_hf.parallelize(load(kind, model_dir), dp=dp, tp=tp, pp=pp, microbatches=microbatches, schedule=schedule,
                           bucket_mb=BUCKET_MB, mesh=mesh_for(dp, tp, pp), sequence_parallel=sequence_parallel)
    batch = dp_slice(make_batch(kind, size=dp * 2 * microbatches, seed=5, seq=SEQ), dp=dp, dp_rank=pm.coords["dp"])
    pm.train_step(batch)
    for p in pm.parameters():
        p.grad = None
    with qn_hf.CommMeter(pm) as meter:
        pm.train_step(batch)
    groups: dict[str, list[int]] = {}
    for (group, _), total in meter.totals().items():
        acc = groups.setdefault(group, [0, 0])
        acc[0] += total.calls
        acc[1] += total.nbytes
    ops = {op: [t.calls, t.nbytes] for (group, op), t in meter.totals().items() if group == "tp"}
    return {"coords": pm.coords, "params": sum(p.numel() for p in pm.parameters()), "comm": groups, "tp_ops": ops}


MESHES = [  # kind, dp, tp, pp, microbatches, schedule, sequence_parallel
    ("gpt2", 2, 2, 2, 2, "1f1b", False),  # tied embedding across stages, vocab padding (99 over tp=2)
    ("gpt2", 1, 4, 1, 1, "1f1b", False),
    ("llama", 1, 4, 2, 3, "gpipe", False),  # 2 KV heads over tp=4: replicated KV gradients
    ("llama", 2, 2, 1, 2, "1f1b", False),
    ("vit", 2, 1, 2, 2, "1f1b", False),
    ("vit", 1, 2, 2, 4, "1f1b", False),
    ("gpt2", 1, 2, 2, 2, "gpipe", True),  # row biases and norms summed over tp, dropout on the slices
]


@pytest.mark.parametrize(("kind", "dp", "tp", "pp", "microbatches", "schedule", "sequence_parallel"), MESHES)
def test_planner_matches_parallelize(worlds, model_dirs, kind, dp, tp, pp, microbatches, schedule, sequence_parallel):
    config = AutoConfig.from_pretrained(model_dirs[kind])
    plan = estimate_mesh(config, ParallelConfig.from_keywords(dp=dp, tp=tp, pp=pp, microbatches=microbatches,
                                                              schedule=schedule, bucket_mb=BUCKET_MB,
                                                              sequence_parallel=sequence_parallel),
                         seq_len=SEQ, micro_batch_size=2, dtype=torch.float32)
    measured = worlds.run(dp * tp * pp, case_measure, kind=kind, model_dir=model_dirs[kind],
                          dp=dp, tp=tp, pp=pp, microbatches=microbatches, schedule=schedule,
                          sequence_parallel=sequence_parallel)
    for rank, r in enumerate(measured):
        stage = plan.stages[r["coords"]["pp"]]
        assert stage.params == r["params"], (rank, stage.params, r["params"])
        predicted = {g: [t.calls, t.nbytes] for g, t in stage.comm.items()}
        assert set(predicted) == set(r["comm"]), (rank, predicted, r["comm"])
        for group, (calls, nbytes) in r["comm"].items():
            assert predicted[group][1] == nbytes, (rank, group, predicted[group], (calls, nbytes))
            if group == "dp":
                assert calls <= predicted[group][0], (rank, calls, predicted[group])
            else:
                assert predicted[group][0] == calls, (rank, group, predicted[group], (calls, nbytes))
        tp_ops = {op: list(v) for op, v in stage.comm["tp"].ops.items()} if "tp" in stage.comm else {}
        assert tp_ops == r["tp_ops"], (rank, tp_ops, r["tp_ops"])


# Public shapes, written by hand (no hub access): the planner must handle them in seconds.
PUBLIC = {
    "llama-3-8b": LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                              num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                              tie_word_embeddings=False, architectures=["LlamaForCausalLM"]),
    "llama-3-70b": LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                               num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                               tie_word_embeddings=False, architectures=["LlamaForCausalLM"]),
    "gpt2-xl": GPT2Config(n_layer=48, n_embd=1600, n_head=25, n_positions=1024, vocab_size=50257,
                          architectures=["GPT2LMHeadModel"]),
    "bert-large": BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                             num_labels=3, architectures=["BertForSequenceClassification"]),
    "t5-base": T5Config(d_model=768, d_ff=3072, num_layers=12, num_heads=12, d_kv=64, vocab_size=32128,
                        architectures=["T5ForConditionalGeneration"]),
    "vit-huge": ViTConfig(hidden_size=1280, num_hidden_layers=32, num_attention_heads=16, intermediate_size=5120,
                          image_size=224, patch_size=14, num_labels=1000, architectures=["ViTForImageClassification"]),
}


@pytest.mark.parametrize(("name", "tp", "pp"), [("llama-3-70b", 8, 8), ("llama-3-8b", 8, 1), ("gpt2-xl", 5, 4),
                                                ("vit-huge", 8, 2), ("bert-large", 4, 2), ("t5-base", 4, 2)])
def test_public_configs_plan_and_conserve_parameters(name, tp, pp):
    # how long planning takes is benchmarks/on_paper.py's to measure: a wall-clock limit here fails on a loaded machine
    config = PUBLIC[name]
    planner = Planner(config, seq_len=SEQ_LEN.get(name, 2048), micro_batch_size=1, dtype=torch.bfloat16)
    est = planner.estimate(ParallelConfig.from_keywords(dp=1, tp=tp, pp=pp, microbatches=4 * pp))
    # Every parameter is on exactly one stage, split over tp or held whole by each tp rank (plus the
    # copy of a weight tied across stages, and vocabulary padding).
    whole = {n: p.numel() for n, p in meta_model(config).named_parameters()}
    sharded, _, _ = planner._local_sizes(build_tp_plan(meta_model(config), resolve_policy(meta_model(config), None), tp=tp))
    split = sum(whole[n] for n in whole if sharded[n] != whole[n])
    replicated = sum(whole[n] for n in whole if sharded[n] == whole[n])
    held = sum(s.params for s in est.stages)
    tied = _copies(config, pp, sharded)
    padding = sum(sharded[n] * tp - whole[n] for n in whole if sharded[n] != whole[n])
    assert held == (split + padding) // tp + replicated + tied
    assert all(s.activation_bytes_per_microbatch > 0 and s.in_flight >= 1 for s in est.stages)


def _copies(config, pp, sharded):
    """Elements held again: a weight tied across stages, and what runs on every stage (an
    encoder-decoder's shared embedding, which both stacks look up) once more per stage."""
    from qn_hf.pipeline.split import build_stage_plan

    model = meta_model(config)
    plan = build_stage_plan(model, resolve_policy(model, None), stages=pp)
    everywhere = {n for n, _ in model.named_parameters() if any(n.startswith(root + ".") for root in plan.every_stage)}
    return sum(sharded[t.owner] for t in plan.ties) + (pp - 1) * sum(sharded[n] for n in everywhere)


def test_llama_70b_at_tp8_pp8_holds_its_share_on_each_rank():
    config = PUBLIC["llama-3-70b"]
    est = estimate_mesh(config, ParallelConfig.from_keywords(dp=1, tp=8, pp=8, microbatches=32), seq_len=4096,
                        micro_batch_size=1, dtype=torch.bfloat16)
    h, inter, kv = 8192, 28672, 8 * 128
    block = h * h * 2 + h * kv * 2 + 3 * h * inter  # q, o, k, v, gate, up, down
    norms = 2 * h  # two RMSNorm weights per block, replicated on every tp rank
    embedding = 128256 * h
    assert est.total_params == 80 * (block + norms) + 2 * embedding + h
    for s in est.stages:
        blocks = s.blocks[1] - s.blocks[0]
        expect = blocks * (block // 8 + norms) + (embedding // 8 if s.stage in (0, 7) else 0) + (h if s.stage == 7 else 0)
        assert s.params == expect
    # A middle stage: within 1% of (parameters outside the embedding and head) / (tp * pp) plus its norms.
    body = est.total_params - 2 * embedding - h
    middle = est.stages[3]
    assert abs(middle.params - (body / 64 + 10 * norms)) / middle.params < 0.01


def test_planner_rejects_with_parallelize_message():
    config = PUBLIC["llama-3-8b"]
    with pytest.raises(ValueError) as planned:
        estimate_mesh(config, ParallelConfig.from_keywords(dp=1, tp=3, pp=1, microbatches=1), seq_len=128,
                      micro_batch_size=1)
    with pytest.raises(ValueError) as real:
        parallelize_as_launched(meta_model(config), tp=3)  # checks run before any process group is needed
    assert str(planned.value) == str(real.value) and "tp=3" in str(planned.value)
    with pytest.raises(ValueError) as planned:
        estimate_mesh(config, ParallelConfig.from_keywords(dp=1, tp=1, pp=33, microbatches=33), seq_len=128,
                      micro_batch_size=1)
    with pytest.raises(ValueError) as real:
        parallelize_as_launched(meta_model(config), pp=33, microbatches=33)
    assert str(planned.value) == str(real.value) and "pp=33" in str(planned.value)
    with pytest.raises(ValueError) as planned:
        estimate_mesh(config, ParallelConfig.from_keywords(dp=1, tp=1, pp=1, microbatches=1, sequence_parallel=True),
                      seq_len=128, micro_batch_size=1)
    with pytest.raises(ValueError) as real:
        parallelize_as_launched(meta_model(config), sequence_parallel=True)
    assert str(planned.value) == str(real.value) and "tp > 1" in str(planned.value)
    # as train_step says
    with pytest.raises(ValueError, match=r"sequence length 127 is not a multiple of 2 \(sequence_parallel=True splits it"):
        estimate_mesh(config, ParallelConfig.from_keywords(dp=1, tp=2, pp=1, microbatches=1, sequence_parallel=True),
                      seq_len=127, micro_batch_size=1)
    # Context parallelism: what ring attention cannot compute, and a length 2*cp does not divide.
    for name, settings in (("gpt2-xl", {}),):
        with pytest.raises(ValueError) as planned:
            estimate_mesh(PUBLIC[name], ParallelConfig.from_keywords(**{"dp": 1, "tp": 1, "pp": 1, **settings}, cp=2,
                                                                     microbatches=1),
                          seq_len=128, micro_batch_size=1)
        with pytest.raises(ValueError) as real:
            parallelize_as_launched(meta_model(PUBLIC[name]), cp=2, **settings)
        assert str(planned.value) == str(real.value) and "cp=2" in str(planned.value)
    with pytest.raises(ValueError, match=r"sequence length 100 is not a multiple of 8 \(cp=4 cuts it into 2\*cp pieces\)"):
        estimate_mesh(config, ParallelConfig.from_keywords(dp=1, tp=1, pp=1, cp=4, microbatches=1), seq_len=100,
                      micro_batch_size=1)
    # cp x sp: each cp rank's part split again over tp
    with pytest.raises(ValueError, match=r"sequence length 132 is not a multiple of 8 \(cp=2 cuts it into 2\*cp pieces "
                                         r"and sequence_parallel=True splits each cp rank's part over tp=4\)"):
        estimate_mesh(PUBLIC["llama-3-8b"],
                      ParallelConfig.from_keywords(dp=1, tp=4, pp=1, cp=2, microbatches=1, sequence_parallel=True),
                      seq_len=132, micro_batch_size=1)


def test_cli_enumerates_ranks_and_explains_rejections(tmp_path, capsys):
    PUBLIC["llama-3-8b"].save_pretrained(tmp_path)
    main([str(tmp_path), "--gpus", "16", "--seq-len", "1024", "--json", "--cp", "1"])  # cp: see the test below
    out = json.loads(capsys.readouterr().out)
    meshes = [(m["dp"], m["tp"], m["pp"]) for m in out["meshes"]]
    assert (2, 8, 1) in meshes and (1, 8, 2) in meshes and all(dp * tp * pp == 16 for dp, tp, pp in meshes)
    assert all(tp <= 8 for _, tp, _ in meshes)
    fits = [m["fits"] for m in out["meshes"]]
    assert fits == sorted(fits, reverse=True)  # meshes that fit come first
    speeds = [m["step_time"]["tokens_per_s"] for m in out["meshes"] if m["fits"]]
    assert speeds == sorted(speeds, reverse=True)
    assert not out["rejected"]  # 32 heads, 8 KV heads, 32 layers: every tp <= 8 and pp <= 16 works
    main([str(tmp_path / "config.json"), "--dp", "1", "--tp", "8", "--pp", "2", "--gpu-memory", "40GiB", "--dtype", "fp32"])
    table = capsys.readouterr().out
    assert "| 0 | 0-15 | model.embed_tokens |" in table and "| 1 | 16-31 | lm_head |" in table
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--dp", "1", "--tp", "3", "--pp", "1"])
    assert "tp=3" in capsys.readouterr().err


def test_cli_fixes_a_global_batch_and_searches_what_is_not_given(tmp_path, capsys):
    """--global-batch ranks only meshes that train exactly that many sequences (each row and JSON entry
    says so); degrees given with --gpus are kept and the others searched; a mesh whose dp does not
    divide the batch is rejected, saying why."""
    PUBLIC["llama-3-8b"].save_pretrained(tmp_path)
    main([str(tmp_path), "--gpus", "16", "--seq-len", "1024", "--global-batch", "24", "--cp", "1", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["meshes"] and {m["global_batch"] for m in out["meshes"]} == {24}
    assert all(m["dp"] * m["microbatches"] == 24 for m in out["meshes"])
    assert any("global batch of 24 sequences is not a whole number of microbatches of dp=16" in r["reason"]
               for r in out["rejected"])
    main([str(tmp_path), "--gpus", "16", "--tp", "4", "--pp", "2", "--seq-len", "1024", "--cp", "1", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert [(m["dp"], m["tp"], m["pp"], m["dp_shard"]) for m in out["meshes"]] in ([(2, 4, 2, 1), (2, 4, 2, 2)],
                                                                                 [(2, 4, 2, 2), (2, 4, 2, 1)])
    main([str(tmp_path), "--gpus", "16", "--seq-len", "1024", "--cp", "1"])
    table = capsys.readouterr().out
    assert "| global batch |" in table and "train different global batches" in table and "payload" in table
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--tp", "8", "--pp", "8"])
    assert "give --gpus N" in capsys.readouterr().err


def test_cli_training_flags(tmp_path, capsys):
    """--dtype/--zero/--recompute reach the estimate: ZeRO shards the AdamW state over dp, recomputation
    keeps fewer activations and repeats tp all-reduces, fp32 holds 16 B per parameter, mixed precision 18."""
    PUBLIC["llama-3-8b"].save_pretrained(tmp_path)
    runs = {}
    for flags in ([], ["--zero"], ["--recompute", "full"], ["--recompute", "selective"], ["--dtype", "fp32"]):
        main([str(tmp_path), "--dp", "4", "--tp", "2", "--pp", "1", "--seq-len", "1024", "--json", *flags])
        runs[" ".join(flags)] = json.loads(capsys.readouterr().out)
    plain, zero, full, selective, fp32 = (runs[k]["stages"][0] for k in runs)
    params = plain["params"]
    assert plain["weight_bytes"] == 2 * params and plain["grad_bytes"] == 4 * params
    assert plain["optimizer_bytes"] >= 12 * params and fp32["optimizer_bytes"] >= 8 * params
    assert fp32["state_bytes"] < 16.01 * params < plain["state_bytes"] < 18.01 * params
    assert abs(zero["optimizer_bytes"] - plain["optimizer_bytes"] / 4) < 0.001 * plain["optimizer_bytes"]
    assert zero["grad_bytes"] >= plain["grad_bytes"] and runs["--zero"]["zero"] is True
    assert full["activation_bytes"] < selective["activation_bytes"] < plain["activation_bytes"]
    assert full["comm"]["tp"]["nbytes"] > plain["comm"]["tp"]["nbytes"]  # recomputed all-reduces
    assert fp32["comm"]["tp"]["nbytes"] > 1.9 * plain["comm"]["tp"]["nbytes"]  # float32 activations
    # Sequence parallelism: fewer activations kept for the same tp, the all-reduces inside the blocks
    # become reduce-scatters and all-gathers.
    main([str(tmp_path), "--dp", "4", "--tp", "2", "--pp", "1", "--seq-len", "1024", "--json", "--sequence-parallel"])
    sp = json.loads(capsys.readouterr().out)
    assert sp["sequence_parallel"] is True and plain["params"] == sp["stages"][0]["params"]
    assert sp["stages"][0]["activation_bytes"] < 0.8 * plain["activation_bytes"]
    assert {"all_gather_into_tensor", "reduce_scatter_tensor"} <= set(sp["stages"][0]["comm"]["tp"]["ops"])
    main([str(tmp_path), "--gpus", "4", "--seq-len", "1024", "--sequence-parallel"])  # tp=1 rejected as parallelize does
    assert "tp=1 pp=4: sequence_parallel=True needs tp > 1" in capsys.readouterr().out
    # Enumerating meshes (tp=1 first) traces each tp on its own: tp>1 meshes carry tp traffic.
    main([str(tmp_path), "--gpus", "4", "--seq-len", "1024", "--json", "--cp", "1"])
    meshes = json.loads(capsys.readouterr().out)["meshes"]
    assert all((m["stages"][0]["comm"].get("tp", {}).get("nbytes", 0) > 0) == (m["tp"] > 1) for m in meshes)


@pytest.mark.script("qn-hf-plan")
def test_cli_plans_context_parallelism(tmp_path, capsys):
    """--cp: each rank keeps about 1/cp of the activations, ZeRO's state is split over dp x cp, ring
    attention's sends are counted on cp (per layer and microbatch: cp-1 key/value blocks forward,
    cp-1 blocks and cp float32 gradient blocks backward) and the gradients go over dp x cp."""
    config = LlamaConfig(**{**PUBLIC["llama-3-8b"].to_dict(), "num_hidden_layers": 4})
    config.save_pretrained(tmp_path)
    runs = {}
    for cp in (1, 2):
        main([str(tmp_path), "--dp", "2", "--tp", "2", "--pp", "1", "--cp", str(cp), "--seq-len", "1024", "--zero",
              "--json"])
        runs[cp] = json.loads(capsys.readouterr().out)
    plain, ring = runs[1]["stages"][0], runs[2]["stages"][0]
    assert runs[2]["cp"] == 2 and plain["params"] == ring["params"]
    assert 0.45 < ring["activation_bytes"] / plain["activation_bytes"] < 0.55
    assert abs(ring["optimizer_bytes"] - plain["optimizer_bytes"] / 2) < 0.001 * plain["optimizer_bytes"]
    block = 2 * 1 * (8 // 2) * (1024 // 2) * 128  # stack([k, v]): this tp rank's 4 KV heads, 512 tokens
    per_layer = (2 * 1 * block * 2 + 2 * block * 4)  # bf16 blocks forward and backward, float32 gradients
    microbatches = runs[2]["microbatches"]
    assert ring["comm"]["cp"]["ops"]["send"] == [4 * microbatches * 4, 4 * microbatches * per_layer]
    assert ring["comm"]["cp"]["ops"]["recv"] == ring["comm"]["cp"]["ops"]["send"]
    assert ring["comm"]["dp"]["nbytes"] == 8 and "replicas" not in plain["comm"]  # the target count only
    # ZeRO over dp x cp = 4: the gradient buckets reduce-scattered, a quarter of the weights gathered, the loss
    reduced = ring["grad_bytes"] + ring["weight_bytes"] / 4 + 4
    assert abs(ring["comm"]["replicas"]["nbytes"] - reduced) < 0.001 * reduced
    assert runs[2]["step_time"]["cp"] > 0 and runs[1]["step_time"]["cp"] == 0
    main([str(tmp_path), "--dp", "1", "--tp", "2", "--pp", "1", "--cp", "2"])
    assert "mesh dp=1 tp=2 pp=1 cp=2 (4 GPUs)" in capsys.readouterr().out
    # Enumerating: cp among the divisors up to 8 with cp x tp inside a node; a length 2*cp does not
    # divide is rejected as train_step rejects it.
    main([str(tmp_path), "--gpus", "16", "--seq-len", "1000", "--json"])
    out = json.loads(capsys.readouterr().out)
    meshes = [(m["dp"], m["tp"], m["pp"], m["cp"]) for m in out["meshes"]]
    assert all(dp * tp * pp * cp == 16 and cp * tp <= 8 for dp, tp, pp, cp in meshes)
    assert {cp for *_, cp in meshes} == {1, 2, 4} and (1, 1, 2, 8) not in meshes
    too_short = [r for r in out["rejected"] if "sequence length" in r["reason"]]  # (the others: pp > 4 blocks)
    assert {(r["tp"], r["cp"]) for r in too_short} == {(1, 8)}
    assert all("sequence length 1000 is not a multiple of 16 (cp=8" in r["reason"] for r in too_short)
    main([str(tmp_path), "--gpus", "8", "--seq-len", "1000", "--cp", "8"])
    assert "dp=1 tp=1 pp=1 cp=8: sequence length 1000 is not a multiple of 16" in capsys.readouterr().out
    main([str(tmp_path), "--gpus", "8", "--seq-len", "1024", "--cp", "4", "--json"])
    assert {m["cp"] for m in json.loads(capsys.readouterr().out)["meshes"]} == {4}


# Expert parallelism with the model's own routing: every rank's calls and bytes as planned, except the
# all-to-alls' bytes, which follow the router; summed over an ep group they do not (what one member
# sends, another receives), so that sum is ep times the planner's uniform-routing figure.
MOE_MESHES = [  # dp, tp, pp, ep, microbatches, expert_dispatch, recompute
    (2, 1, 1, 2, 1, "all_to_all", None),
    (2, 2, 1, 4, 1, "all_to_all", None),  # tokens split over tp: the tp all-gathers of the split
    (2, 1, 2, 2, 2, "all_to_all", None),
    (2, 2, 1, 2, 1, "all_to_all", None),  # the ep group inside tp; the experts' gradient buckets over the 2 ranks holding them
    # the all-gather dispatch: its bytes follow the shapes, not the router, so every rank's equal the estimate
    (2, 1, 1, 2, 1, "all_gather", None),
    (2, 2, 1, 4, 1, "all_gather", None),
    (2, 1, 2, 2, 2, "all_gather", None),
    # recomputation reruns the gathers (the experts' call saves after them), not the sum back
    (2, 1, 1, 2, 1, "all_gather", "full"),
]


def moe_measure(*, dp: int, tp: int, pp: int, ep: int, microbatches: int, expert_dispatch: str = "all_to_all",
                recompute: str | None = None) -> dict:
    config = moe_config("qwen3_moe")
    pm = qn_hf.parallelize(build(config, seed=0), dp=dp, tp=tp, pp=pp, ep=ep, microbatches=microbatches,
                           bucket_mb=BUCKET_MB, mesh=mesh_for(dp, tp, pp), expert_dispatch=expert_dispatch,
                           recompute=recompute)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(3, config.vocab_size, (dp * 2 * microbatches, SEQ), generator=gen)
    batch = dp_slice({"input_ids": ids, "labels": ids.clone()}, dp=dp, dp_rank=pm.coords["dp"])
    pm.train_step(batch)
    for p in pm.parameters():
        p.grad = None
    with qn_hf.CommMeter(pm) as meter:
        pm.train_step(batch)
    return {"coords": pm.coords, "params": sum(p.numel() for p in pm.parameters()),
            "ops": {f"{g}:{op}": [t.calls, t.nbytes] for (g, op), t in meter.totals().items()}}


@pytest.mark.parametrize(("dp", "tp", "pp", "ep", "microbatches", "dispatch", "recompute"), MOE_MESHES)
def test_planner_matches_expert_parallel_traffic(worlds, dp, tp, pp, ep, microbatches, dispatch, recompute):
    config = moe_config("qwen3_moe", architectures=["Qwen3MoeForCausalLM"])
    plan = estimate_mesh(config, ParallelConfig.from_keywords(dp=dp, tp=tp, pp=pp, ep=ep, microbatches=microbatches,
                                                              bucket_mb=BUCKET_MB, expert_dispatch=dispatch,
                                                              recompute=recompute),
                         seq_len=SEQ, micro_batch_size=2, backend="gloo")
    measured = worlds.run(dp * tp * pp, moe_measure, dp=dp, tp=tp, pp=pp, ep=ep,
                          microbatches=microbatches, expert_dispatch=dispatch, recompute=recompute)
    a2a = "ep:all_to_all_single"
    group_sums: dict[tuple[int, int], list[int]] = {}  # (stage, ep group) -> [bytes measured, planned]
    for r in measured:
        stage = plan.stages[r["coords"]["pp"]]
        assert stage.params == r["params"], (r["coords"], stage.params, r["params"])
        predicted = {g: [t.calls, t.nbytes] for g, t in stage.comm.items()}
        predicted.update({f"{g}:{op}": list(v) for g in ("tp", "ep") if g in stage.comm
                          for op, v in stage.comm[g].ops.items()})
        real = {f"{g}:{op}": v for g, op, v in ((*k.split(":"), v) for k, v in r["ops"].items()) if g in ("tp", "ep")}
        for key, (calls, nbytes) in r["ops"].items():
            total = real.setdefault(key.partition(":")[0], [0, 0])
            total[0] += calls
            total[1] += nbytes
        acc = group_sums.setdefault((r["coords"]["pp"], r["coords"]["expert_replica"]), [0, 0])
        acc[0] += real[a2a][1]
        acc[1] += predicted[a2a][1]
        if dispatch == "all_to_all":  # per rank the all-to-alls' bytes follow the router
            shift = real[a2a][1] - predicted[a2a][1]
            predicted[a2a][1] += shift
            predicted["ep"][1] += shift
        assert predicted == real, (r["coords"], predicted, real)
    assert len(group_sums) == pp * dp * tp // ep
    assert all(real_sum == planned for real_sum, planned in group_sums.values()), group_sums


def test_planner_refuses_expert_parallelism_as_parallelize_does():
    """Refusals with parallelize's message: ep not dividing dp*tp, ep and tp neither dividing the
    other, ep not dividing the experts, a dense model; ZeRO
    with ep is planned."""
    moe = moe_config("qwen3_moe", architectures=["Qwen3MoeForCausalLM"])
    cases = [(moe, dict(dp=2, tp=2, ep=3)), (moe, dict(dp=2, tp=3, ep=2)), (moe, dict(dp=8, ep=8)),
             (PUBLIC["llama-3-8b"], dict(dp=2, ep=2))]
    for config, mesh in cases:
        mesh = {"dp": 1, "tp": 1, "pp": 1, **mesh}
        with pytest.raises(ValueError) as planned:
            estimate_mesh(config, ParallelConfig.from_keywords(**mesh, microbatches=1), seq_len=128, micro_batch_size=1)
        with pytest.raises(ValueError) as real:
            parallelize_as_launched(meta_model(config), **mesh)  # checks run before any process group is needed
        assert str(planned.value) == str(real.value) and f"ep={mesh['ep']}" in str(planned.value), mesh
    # ZeRO with ep: the experts' state split over the 2 ranks holding each block, the rest over dp=2
    ep2 = ParallelConfig.from_keywords(dp=2, tp=2, pp=1, ep=2, microbatches=1)
    sharded, whole = (estimate_mesh(moe, ep2, zero=zero, seq_len=128, micro_batch_size=1).stages[0].optimizer_bytes
                      for zero in (True, False))
    assert abs(sharded - whole / 2) <= 0.02 * whole, (sharded, whole)
    # Llama 4's experts (every token once per expert): parallelize shards them, the planner says it
    # does not trace their dispatch rather than guess
    # sequence parallelism at ep=1 (the experts gather rows at their call; whole, where transformers' plan keeps
    # the experts whole: a whole region) is not traced either
    with pytest.raises(ValueError, match=r"sequence_parallel=True on qwen3_moe: the planner does not trace the experts' "
                                         r"row gathers at ep=1" if splits_experts_over_tp("qwen3_moe") else
                                         r"sequence_parallel=True on qwen3_moe: the planner does not trace the whole "
                                         r"regions \(block children that run on the gathered sequence: model.layers.0.mlp"):
        estimate_mesh(moe, ParallelConfig.from_keywords(dp=1, tp=2, pp=1, sequence_parallel=True, microbatches=1),
                      seq_len=16, micro_batch_size=1)
    llama4 = moe_config("llama4_text")
    with pytest.raises(ValueError, match=r"ep=2: the planner models the dispatch of transformers' fused experts only"):
        estimate_mesh(llama4, ParallelConfig.from_keywords(dp=2, tp=1, pp=1, ep=2, microbatches=1), seq_len=16,
                      micro_batch_size=1)


def test_cli_plans_expert_parallelism(tmp_path, capsys):
    """--ep: the experts' weights, gradients and AdamW state 1/ep per rank, their gradients over the
    ranks holding the same experts, all-to-alls on ep per MoE layer and microbatch (5 calls: counts
    and token rows forward, rows back; the rows' gradients back); with --gpus every mesh takes ep."""
    needs_expert_tp_rules("qwen3_moe")  # ep=1's experts split over tp
    config = moe_config("qwen3_moe", architectures=["Qwen3MoeForCausalLM"])
    config.save_pretrained(tmp_path)
    runs = {}
    for ep in (1, 2):
        main([str(tmp_path), "--dp", "2", "--tp", "2", "--pp", "1", "--ep", str(ep), "--seq-len", "128", "--json"])
        runs[ep] = json.loads(capsys.readouterr().out)
    plain, ep2 = runs[1]["stages"][0], runs[2]["stages"][0]
    experts = 4 * (4 * 64 * 64 + 4 * 64 * 32) // 2  # 4 layers' gate_up [4, 64, 64], down [4, 64, 32]: halved
    assert runs[2]["ep"] == 2 and ep2["expert_params"] == plain["expert_params"] == experts
    assert ep2["comm"]["ep"]["calls"] == 5 * 4 * runs[2]["microbatches"]
    assert ep2["comm"]["experts"]["nbytes"] == ep2["expert_grad_bytes"] == experts * 4  # float32 gradients
    assert runs[2]["step_time"]["ep"] > 0 and runs[1]["step_time"]["ep"] == 0
    main([str(tmp_path), "--dp", "2", "--tp", "1", "--pp", "1", "--ep", "2"])
    assert "mesh dp=2 tp=1 pp=1 cp=1 ep=2 (2 GPUs)" in capsys.readouterr().out
    main([str(tmp_path), "--gpus", "4", "--ep", "4", "--seq-len", "128", "--json"])  # cp=1 with ep
    out = json.loads(capsys.readouterr().out)
    assert {(m["dp"], m["tp"]) for m in out["meshes"]} == {(4, 1), (2, 2), (1, 4)}
    assert all(r["ep"] == 4 and "ep=4 must divide dp*tp" in r["reason"] for r in out["rejected"])



def test_cli_plans_sharded_data_parallelism(tmp_path, capsys):
    """--dp-shard N: weights, gradients and AdamW's moments are the float32 shards, 16/N bytes per
    parameter (the issue's theory, with no master copies), plus the whole weights a step gathers: the
    root and three blocks in bf16 without a pipeline, every block of the stage (and the whole
    gradients) under one; FSDP's traffic on dp_shard (and dp_replicate when N < dp). --dp-shard all
    ranks every mesh at each dp_shard: Llama 3 8B on 8 GPUs fits only sharded at tp=1."""
    PUBLIC["llama-3-8b"].save_pretrained(tmp_path)
    runs = {}
    for flags in (["--dp-shard", "8"], ["--dp-shard", "4"], ["--zero"]):
        main([str(tmp_path), "--dp", "8", "--tp", "1", "--pp", "1", "--seq-len", "1024", "--json", *flags])
        runs[flags[-1]] = json.loads(capsys.readouterr().out)
    eight, hybrid, zero = (runs[k]["stages"][0] for k in ("8", "4", "--zero"))
    params = eight["params"]
    assert runs["8"]["dp_shard"] == 8 and abs(eight["state_bytes"] - 16 * params / 8) < 0.001 * params
    assert abs(hybrid["state_bytes"] - 16 * params / 4) < 0.001 * params
    assert zero["state_bytes"] > 7.4 * params  # bf16 weights and float32 gradients whole: 2 + 4 + 12/8
    layers = PUBLIC["llama-3-8b"].num_hidden_layers
    block = (params - 2 * 128256 * 4096 - 4096) // layers
    assert eight["unsharded_bytes"] == 2 * (2 * 128256 * 4096 + 4096 + 3 * block)  # root, 3 blocks in forward
    assert set(eight["comm"]) >= {"dp_shard"} and "dp_replicate" not in eight["comm"]
    # the reduced shards, float32, after each microbatch (pp=1: FSDP reduces as each backward ends)
    assert hybrid["comm"]["dp_replicate"]["nbytes"] == runs["4"]["microbatches"] * hybrid["grad_bytes"]
    main([str(tmp_path), "--dp", "4", "--tp", "1", "--pp", "2", "--seq-len", "1024", "--json", "--dp-shard", "4"])
    stage = json.loads(capsys.readouterr().out)["stages"][0]
    assert stage["accumulated_grad_bytes"] == 4 * stage["params"]  # whole float32 gradients until the reduction
    main([str(tmp_path), "--gpus", "8", "--seq-len", "1024", "--cp", "1", "--dp-shard", "all", "--json"])
    meshes = json.loads(capsys.readouterr().out)["meshes"]
    fits = {(m["dp"], m["tp"], m["pp"], m["dp_shard"]): m["fits"] for m in meshes}
    assert fits[(8, 1, 1, 8)] and not fits[(8, 1, 1, 1)]
    assert {m["dp_shard"] for m in meshes if m["dp"] == 8 and m["tp"] == 1} == {1, 2, 4, 8}
    main([str(tmp_path), "--gpus", "8", "--seq-len", "1024", "--cp", "1", "--dp-shard", "all"])
    assert "| rank | dp | dp_shard | tp |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--dp", "8", "--tp", "1", "--pp", "1", "--dp-shard", "3"])
    assert "dp_shard=3 must divide dp=8" in capsys.readouterr().err


def test_planner_counts_collectives_under_the_meters_names():
    """Every operation the planner estimates is a ``Collective``, the enum ``CommMeter`` reports
    under, so an estimate and a metered step compare key for key (no names copied as strings)."""
    from qn_hf.comm_meter import Collective

    config = LlamaConfig(**{**PUBLIC["llama-3-8b"].to_dict(), "num_hidden_layers": 4})
    est = estimate_mesh(config, ParallelConfig.from_keywords(dp=1, tp=2, pp=2, microbatches=2, sequence_parallel=True),
                        seq_len=128, micro_batch_size=1)
    ops = [op for stage in est.stages for traffic in stage.comm.values() for op in traffic.ops]
    assert ops and all(isinstance(op, Collective) for op in ops), ops
    assert {Collective.ALL_GATHER_INTO_TENSOR, Collective.REDUCE_SCATTER_TENSOR} <= set(ops)
    assert Collective("all_reduce") is Collective.ALL_REDUCE and {Collective.SEND: 1}["send"] == 1
