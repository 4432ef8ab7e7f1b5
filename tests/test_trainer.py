"""``qn_hf.Trainer`` equals ``transformers.Trainer`` in one process: the logged loss, gradient norm and LR at every
step of 12 AdamW steps with linear warm-up, the evaluation loss, and the model ``save_model`` writes; a checkpoint
resumes at another mesh; and arguments that conflict with the mesh are refused on every rank."""

from __future__ import annotations

import pytest

from qn_hf.config.features import Feature
from tests import trainer_cases
from tests.models import load
from tests.trainer_cases import reference

LOSS_RTOL = 1e-4
WEIGHT_ATOL = 1e-4
SHORT = 4  # steps of the composition rows' runs

pytest.importorskip("accelerate")


@pytest.fixture(scope="module")
def references(model_dirs, tmp_path_factory):
    """One-process runs at the global batch sizes (this test process has no process group)."""
    root = tmp_path_factory.mktemp("reference")
    common = dict(model_dir=model_dirs["llama"], batch=4)
    return {
        "plain": reference(**common, out_dir=str(root / "plain"), accumulation=1, max_grad_norm=1.0, eval_steps=6),
        # clipping at 0.2 engages on every step (the norms start above 1)
        "accumulated": reference(**common, out_dir=str(root / "accumulated"), accumulation=2, max_grad_norm=0.2),
        "lora": reference(**common, out_dir=str(root / "lora"), accumulation=1, max_grad_norm=1.0, lora=True),
        # the composition rows' runs: 4 steps (past the 3 of warm-up), the suite's time (issue 65)
        "short": reference(**common, out_dir=str(root / "short"), accumulation=1, max_grad_norm=1.0, eval_steps=2,
                           steps=SHORT),
    }


def close(ours: list[float], theirs: list[float], rtol: float = LOSS_RTOL) -> float:
    assert len(ours) == len(theirs), (ours, theirs)
    worst = max(abs(a - b) / abs(b) for a, b in zip(ours, theirs))
    assert worst <= rtol, (worst, ours, theirs)
    return worst


def same_weights(ours_dir: str, theirs_dir: str) -> None:
    ours, theirs = load("llama", ours_dir).state_dict(), load("llama", theirs_dir).state_dict()
    assert ours.keys() == theirs.keys()
    worst = max((ours[k] - theirs[k]).abs().max().item() for k in ours)
    assert worst <= WEIGHT_ATOL, worst


def check_run(results: list[dict], ref: dict) -> dict:
    """Every step's logged loss, gradient norm and LR, and the final evaluation, against the reference."""
    run = results[0]
    assert all(r["loss"] == run["loss"] for r in results)  # the global loss, identical on every rank
    assert run["step"] == list(range(1, len(ref["loss"]) + 1))
    worst = {"loss": close(run["loss"], ref["loss"]), "grad_norm": close(run["grad_norm"], ref["grad_norm"]),
             "eval": close([run["final_eval"]], [ref["final_eval"]])}
    assert run["lr"] == pytest.approx(ref["lr"], rel=1e-9)
    print("worst relative differences:", worst)
    return worst


@pytest.mark.composes((Feature.TP, Feature.TRAINER), (Feature.PP_1F1B, Feature.TRAINER))
def test_trainer_tp_pp_equals_one_process(worlds, model_dirs, references, tmp_path):
    """(dp, tp, pp) = (1, 2, 2), evaluation every 6 steps and at the end."""
    ref = references["plain"]
    results = worlds.run(4, trainer_cases.parallel_train, model_dir=model_dirs["llama"], out_dir=str(tmp_path),
                         dp=1, tp=2, pp=2, microbatches=2, batch=4, accumulation=1, max_grad_norm=1.0, eval_steps=6)
    check_run(results, ref)
    close(results[0]["eval_loss"], ref["eval_loss"])
    assert len(ref["eval_loss"]) == 2
    same_weights(str(tmp_path / "model"), references["plain"]["model_dir"])


@pytest.mark.composes((Feature.DP_SHARD, Feature.TRAINER))
def test_trainer_with_sharded_data_parallelism_equals_one_process(worlds, model_dirs, references, tmp_path):
    """dp=2 x dp_shard=2 in ``parallel=`` (FSDP2 groups; clipping over the rows each rank holds): the
    composition table's Trainer x dp_shard row."""
    ref = references["plain"]
    results = worlds.run(2, trainer_cases.parallel_train, model_dir=model_dirs["llama"], out_dir=str(tmp_path),
                         dp=2, tp=1, pp=1, microbatches=1, batch=2, accumulation=1, max_grad_norm=1.0, eval_steps=6,
                         extra=dict(dp_shard=2))
    check_run(results, ref)
    close(results[0]["eval_loss"], ref["eval_loss"])
    same_weights(str(tmp_path / "model"), references["plain"]["model_dir"])


@pytest.mark.composes((Feature.CP, Feature.TRAINER), case="cp=2")
@pytest.mark.composes((Feature.LOSS_CHUNKS, Feature.TRAINER), case="loss_chunk_tokens=5")
@pytest.mark.composes((Feature.RECOMPUTE, Feature.TRAINER), case="recompute=full")
@pytest.mark.composes((Feature.OFFLOAD, Feature.TRAINER), case="recompute=selective-offload=activations")
@pytest.mark.composes((Feature.PP_GPIPE, Feature.TRAINER), case="schedule=gpipe")
@pytest.mark.composes((Feature.PP_INTERLEAVED, Feature.TRAINER), case="schedule=interleaved_1f1b-virtual_stages=2")
@pytest.mark.composes((Feature.PP_ZB_H1, Feature.TRAINER), case="schedule=zb_h1")
@pytest.mark.composes((Feature.SP, Feature.TRAINER), case="sequence_parallel=True")
@pytest.mark.parametrize("extra", [dict(schedule="gpipe"), dict(schedule="zb_h1"), dict(recompute="full"),
                                   dict(sequence_parallel=True),
                                   dict(schedule="interleaved_1f1b", virtual_stages=2), dict(cp=2, tp=1),
                                   dict(loss_chunk_tokens=5), dict(recompute="selective", offload="activations")],
                         ids=lambda e: "-".join(f"{k}={v}" for k, v in e.items() if k != "tp"))
def test_trainer_composes_with_schedules_recompute_and_sp(worlds, model_dirs, references, tmp_path, extra):
    """(1, 2, 2) as above with another schedule, recomputation or sequence parallelism, and (1, 1, 2) with cp=2,
    in ``parallel=``, 4 steps with an evaluation every 2: the composition table's Trainer rows."""
    ref = references["short"]
    extra = dict(extra)
    cp, tp = extra.pop("cp", 1), extra.pop("tp", 2)
    results = worlds.run(tp * 2 * cp, trainer_cases.parallel_train, model_dir=model_dirs["llama"],
                         out_dir=str(tmp_path), dp=1, tp=tp, pp=2, microbatches=2, batch=4, accumulation=1,
                         max_grad_norm=1.0, eval_steps=2, extra=extra, cp=cp, steps=SHORT)
    check_run(results, ref)
    close(results[0]["eval_loss"], ref["eval_loss"])
    same_weights(str(tmp_path / "model"), ref["model_dir"])


@pytest.mark.composes((Feature.BF16, Feature.TRAINER), case="bf16")
@pytest.mark.composes((Feature.FP16, Feature.TRAINER), case="fp16")
@pytest.mark.long
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_trainer_in_mixed_precision_follows_the_plain_run(worlds, model_dirs, references, tmp_path, precision):
    """(1, 2, 2) with parallel=dict(mixed_precision=...): low-precision compute, float32 masters in
    qn_hf.optimizer (fp16 loss-scaled): 4 steps' losses and the final evaluation within 2% of the
    float32 plain Trainer run (bf16 keeps 8 bits of mantissa), no step skipped."""
    ref = references["short"]
    results = worlds.run(4, trainer_cases.parallel_train, model_dir=model_dirs["llama"], out_dir=str(tmp_path),
                         dp=1, tp=2, pp=2, microbatches=2, batch=4, accumulation=1, max_grad_norm=1.0,
                         extra=dict(mixed_precision=precision), steps=SHORT)
    run = results[0]
    assert run["step"] == list(range(1, SHORT + 1)), run
    close(run["loss"], ref["loss"], rtol=2e-2)
    close([run["final_eval"]], [ref["final_eval"]], rtol=2e-2)


@pytest.mark.composes((Feature.EP, Feature.TRAINER))
@pytest.mark.composes((Feature.EP_ALL_GATHER, Feature.TRAINER), case="all_gather")
@pytest.mark.long
@pytest.mark.parametrize("dispatch", ["all_to_all", "all_gather"])
def test_trainer_with_expert_parallelism_equals_one_process(worlds, tmp_path, dispatch):
    """A shrunk Qwen3-MoE at dp=2 with its experts over ep=2: 12 steps' losses, gradient norms and the
    final evaluation equal transformers' Trainer in one process."""
    from qn_hf.check.run import build
    from tests.ep_cases import moe_config

    model_dir = str(tmp_path / "moe")
    build(moe_config("qwen3_moe"), seed=0).save_pretrained(model_dir)
    ref = trainer_cases.reference(model_dir=model_dir, out_dir=str(tmp_path / "reference"), batch=4, accumulation=1,
                                  max_grad_norm=1.0)
    results = worlds.run(2, trainer_cases.parallel_train, model_dir=model_dir, out_dir=str(tmp_path / "ep"), dp=2,
                         tp=1, pp=1, microbatches=1, batch=2, accumulation=1, max_grad_norm=1.0,
                         extra=dict(ep=2, expert_dispatch=dispatch))
    check_run(results, ref)


@pytest.mark.parametrize("how", ["auto", "calibrated"])
def test_trainer_with_mesh_auto_equals_one_process(worlds, model_dirs, references, tmp_path, how):
    """parallel="auto" at 2 processes (the stated figures; the sequence length read from train_dataset), and
    parallel=dict(mesh="auto", seq_len=, calibration=) with 2 accumulation steps at a machine where the
    planner chooses a 2-stage pipeline (dp=1): per_device_train_batch_size is per process, so the global batch
    is that of one-process transformers.Trainer at per_device x 2 whatever dp is chosen, and the run equals it."""
    from tests.test_scripts import calibration_file

    if how == "auto":
        parallel, accumulation, clip, ref = "auto", 1, 1.0, references["plain"]
    else:
        parallel = dict(mesh="auto", seq_len=trainer_cases.SEQ,
                        calibration=calibration_file(tmp_path / "machine.json", "ops-free"))
        accumulation, clip, ref = 2, 0.2, references["accumulated"]
    results = worlds.run(2, trainer_cases.auto_train, model_dir=model_dirs["llama"], out_dir=str(tmp_path / "run"),
                         parallel=parallel, batch=2, accumulation=accumulation, max_grad_norm=clip)
    chosen = results[0]["chosen"]
    assert all(r["chosen"] == r["choice"] == chosen for r in results)
    if how == "calibrated":
        assert (chosen.dims.dp, chosen.dims.pp) == (1, 2), chosen  # each replica takes the whole global batch
    assert results[0]["total_batch"] == 4 * accumulation
    check_run(results, ref)
    same_weights(str(tmp_path / "run" / "model"), ref["model_dir"])


@pytest.mark.composes((Feature.DP, Feature.TRAINER), (Feature.ZERO, Feature.TRAINER))
def test_trainer_accumulation_clipping_checkpoint_and_resume_at_another_mesh(worlds, model_dirs, references, tmp_path):
    """(2, 1, 2) with 2 accumulation steps (4 microbatches per train_step), clipping and ZeRO-1, checkpoints at steps
    6 and 12; then the step-6 checkpoint resumed at (1, 2, 2) continues as the uninterrupted run."""
    ref = references["accumulated"]
    first = tmp_path / "first"
    results = worlds.run(4, trainer_cases.parallel_train, model_dir=model_dirs["llama"], out_dir=str(first),
                         dp=2, tp=1, pp=2, microbatches=2, batch=2, accumulation=2, max_grad_norm=0.2, save_steps=6,
                         zero=True)
    check_run(results, ref)
    assert results[0]["total_batch"] == 8
    assert all(n > 0.2 for n in ref["grad_norm"])  # clipping engaged at every step
    same_weights(str(first / "model"), references["accumulated"]["model_dir"])
    assert sorted(p.name for p in first.glob("checkpoint-*")) == ["checkpoint-12", "checkpoint-6"]

    again = tmp_path / "again"
    resumed = worlds.run(4, trainer_cases.parallel_train, model_dir=model_dirs["llama"], out_dir=str(again),
                         dp=1, tp=2, pp=2, microbatches=2, batch=4, accumulation=2, max_grad_norm=0.2,
                         resume=str(first / "checkpoint-6"))
    check_run(resumed, ref)  # steps 1-6 from the checkpoint's trainer_state.json, 7-12 trained after the resume
    same_weights(str(again / "model"), references["accumulated"]["model_dir"])


def test_trainer_refuses_conflicting_arguments_on_every_rank(worlds, model_dirs, tmp_path):
    results = worlds.run(4, trainer_cases.bad_inputs, model_dir=model_dirs["llama"], out_dir=str(tmp_path))
    assert all(r == results[0] for r in results), results
    messages = results[0]
    assert "parallel=dict(dp=1, tp=1, pp=2) needs 2 processes but 4 were launched" in messages["world"]
    assert "gradient_checkpointing=True" in messages["checkpointing"]
    assert "parallel=dict(recompute='full')" in messages["checkpointing"]
    assert "bf16=True" in messages["bf16"] and "mixed_precision='bf16'" in messages["bf16"]
    assert "not this rank's shards" in messages["optimizer"] and "optimizer_cls_and_kwargs" in messages["optimizer"]
    assert "label_smoothing_factor=0.1" in messages["parallel_model"]  # checked for a ParallelModel too
    assert "use evaluate()" in messages["predict"]


def test_trainer_keeps_the_dropout_streams_of_each_replica(worlds, model_dirs, tmp_path):
    """Trainer seeds the device generator with args.seed on every rank, and restores each process's saved state
    on resume; qn_hf's shared stream must stay one per dp replica, equal over tp."""
    results = worlds.run(4, trainer_cases.dropout_streams, model_dir=model_dirs["llama"], out_dir=str(tmp_path))
    for key in ("built", "resumed"):
        by_replica = {dp: {r[key] for r in results if r["dp"] == dp} for dp in (0, 1)}
        assert all(len(states) == 1 for states in by_replica.values()), (key, by_replica)  # equal over tp
        assert by_replica[0] != by_replica[1], (key, by_replica)  # different across dp


@pytest.mark.parametrize(("parallel", "overrides", "expected"), [
    (dict(dp=2, zero=True, shards=2), {}, "parallel= has unknown keys ['shards']"),
    (dict(microbatches=4), {}, "per_device_train_batch_size=2 is less than parallel microbatches=4"),
    (dict(), {"fsdp": "full_shard"}, "fsdp='full_shard'"),
    (dict(), {"label_smoothing_factor": 0.1}, "label_smoothing_factor=0.1"),
    (dict(), {"train_sampling_strategy": "group_by_length"}, "train_sampling_strategy='group_by_length'"),
    (dict(), {"fp16": True}, "parallel=dict(mixed_precision='fp16')"),
])
def test_trainer_argument_checks(tmp_path, parallel, overrides, expected):
    """The checks are pure functions of the arguments, run before any collective."""
    from qn_hf.integrations.hf_trainer.args import check_training_args, trainer_mesh
    from tests.trainer_cases import training_args

    args = training_args(str(tmp_path), batch=2, eval_batch=2, accumulation=1, max_grad_norm=1.0)
    for key, value in overrides.items():
        setattr(args, key, value)
    with pytest.raises(ValueError) as error:
        check_training_args(args, mesh=trainer_mesh(parallel, args=args), world_size=1)
    assert expected in str(error.value)


@pytest.mark.parametrize(("parallel", "expected"), [
    (dict(mesh="auto", microbatches=2), "parallel microbatches=2 with mesh='auto': they follow from the global batch"),
    (dict(mesh="auto", global_batch=8), "per_device_train_batch_size x 2 processes x gradient_accumulation_steps = 4; "
                                        "leave it out"),
    ("automatic", "parallel='automatic': parallel= takes 'auto' or a dict"),
    (dict(mesh="automatic"), "parallel mesh='automatic': the one name mesh takes is 'auto'"),
    (dict(mesh="auto", shards=2), "parallel= has unknown keys ['shards']"),
    (dict(mesh="auto"), "pass parallel=dict(mesh='auto', seq_len=N)"),
    (dict(mesh="auto", seq_len=16, calibration="{tmp}/nothing.json"), "nothing.json': no such file"),
])
def test_trainer_mesh_auto_refusals(tmp_path, parallel, expected):
    """mesh='auto''s checks, before the planner runs and before any collective (the data here is an iterable of
    rows: nothing says its sequence length)."""
    from qn_hf.integrations.hf_trainer.args import auto_mesh
    from tests.trainer_cases import training_args

    if isinstance(parallel, dict) and "calibration" in parallel:
        parallel = {**parallel, "calibration": parallel["calibration"].format(tmp=tmp_path)}
    args = training_args(str(tmp_path), batch=2, eval_batch=2, accumulation=1, max_grad_norm=1.0)
    rows = (row for row in [{"input_ids": [1, 2]}])  # a generator: reading ahead would consume it
    with pytest.raises(ValueError) as error:
        auto_mesh(parallel, args=args, model=None, world_size=2, train_dataset=rows)
    assert expected in str(error.value)


def test_trainer_mesh_auto_reads_the_sequence_length_from_the_data():
    from transformers import DataCollatorWithPadding

    from qn_hf.integrations.hf_trainer.args import sequence_length
    from tests.trainer_cases import token_dataset

    rows = [{"input_ids": [1] * n} for n in (5, 9, 7, 30)]
    assert sequence_length(rows, rows=3) == 9  # the longest of the first global batch
    assert sequence_length(token_dataset(8, seed=1), rows=4) == trainer_cases.SEQ
    assert sequence_length([{"text": "no ids"}], rows=1) is None
    padded = DataCollatorWithPadding(tokenizer=None, padding="max_length", max_length=24)
    assert sequence_length(rows, data_collator=padded, rows=3) == 24  # every batch padded to it
    assert sequence_length(rows, data_collator=DataCollatorWithPadding(tokenizer=None, max_length=24), rows=3) == 9


def test_trainer_import_is_lazy():
    import subprocess
    import sys

    code = "import sys, qn_hf; assert 'transformers.trainer' not in sys.modules; assert qn_hf.Trainer.__mro__[2].__name__ == 'Trainer'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_microbatches_per_step(tmp_path):
    from qn_hf.integrations.hf_trainer.args import trainer_mesh
    from tests.trainer_cases import training_args

    args = training_args(str(tmp_path), batch=4, eval_batch=2, accumulation=3, max_grad_norm=1.0)
    mesh = trainer_mesh(dict(pp=2, microbatches=2), args=args)
    assert mesh.parallelize["microbatches"] == 6 and mesh.parallelize["seed"] == args.seed


# the suite's time (issue 65): torchrun launches train_lm.py in make test; this script's torchrun run is long
@pytest.mark.parametrize("launcher", [pytest.param("torchrun", marks=pytest.mark.long), "accelerate"])
@pytest.mark.script("scripts/train_trainer.py")
def test_trainer_script_under_both_launchers(tmp_path, launcher):
    """scripts/train_trainer.py at (dp, tp, pp) = (2, 1, 2) on 4 processes: the loss falls, checkpoints are in the
    sharded format, and the model directory loads with from_pretrained."""
    import re

    from transformers import AutoModelForCausalLM

    from tests.test_scripts import launch, ok

    done = launch(launcher, "train_trainer.py", ["--steps", "6", "--save-steps", "3", "--output-dir", str(tmp_path)])
    ok(done)
    line = re.search(r"done: mesh dp=2 tp=1 pp=2, 6 steps, loss (\S+) -> (\S+),", done.stdout)
    assert line is not None and float(line[2]) < float(line[1]), done.stdout[-2000:]
    assert (tmp_path / "checkpoint-3" / "sharded" / "latest").is_file()
    assert (tmp_path / "checkpoint-6" / "scheduler.pt").is_file()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert model.config.model_type == "llama"

    # What a restart resumes from: the newest checkpoint whose save finished, not a half-written one
    from qn_hf.integrations.hf_trainer.trainer import last_complete_checkpoint

    assert last_complete_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-6")
    (tmp_path / "checkpoint-6" / "trainer_state.json").unlink()  # killed before Trainer wrote its state
    assert last_complete_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-3")
    if launcher == "torchrun":  # the same command again, as torchrun --max-restarts runs it: steps 4-6 from step 3's
        again = launch(launcher, "train_trainer.py", ["--steps", "6", "--save-steps", "3", "--output-dir", str(tmp_path)])
        ok(again)
        assert re.search(r"done: mesh dp=2 tp=1 pp=2, 6 steps, loss \S+ -> (\S+),", again.stdout)[1] == line[2]
        assert last_complete_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-6")
        (tmp_path / "checkpoint-6" / "trainer_state.json").unlink()
    (tmp_path / "checkpoint-3" / "sharded" / "latest").write_text('"ckpt-000009"')  # names nothing
    assert last_complete_checkpoint(str(tmp_path)) is None


def test_trl_sft_trainer_through_the_mixin(worlds, tmp_path):
    """class ParallelSFT(qn_hf.ParallelTrainerMixin, trl.SFTTrainer) at (dp, tp, pp) = (2, 1, 2) equals TRL's
    SFTTrainer in one process (its default NLL loss; the collator pads each batch itself)."""
    pytest.importorskip("trl")
    from tests.trainer_cases import sft

    ref = sft(out_dir=str(tmp_path / "reference"))
    results = worlds.run(4, trainer_cases.sft, out_dir=str(tmp_path / "parallel"),
                         parallel=dict(dp=2, tp=1, pp=2, microbatches=2))
    assert all(r == results[0] for r in results)
    print("worst relative difference (TRL):", close(results[0], ref))


@pytest.mark.composes((Feature.LORA, Feature.TRAINER))
def test_trainer_with_lora_writes_the_adapter(worlds, model_dirs, references, tmp_path):
    """A PEFT LoRA model at (1, 2, 2): the logged losses of transformers.Trainer with peft in one
    process, and save_model writes the adapter directory with its tensors (1e-4)."""
    pytest.importorskip("peft")
    from safetensors.torch import load_file

    ref = references["lora"]
    results = worlds.run(4, trainer_cases.parallel_train, model_dir=model_dirs["llama"], out_dir=str(tmp_path),
                         dp=1, tp=2, pp=2, microbatches=2, batch=4, accumulation=1, max_grad_norm=1.0, lora=True)
    check_run(results, ref)
    ours = load_file(str(tmp_path / "model" / "adapter_model.safetensors"))
    theirs = load_file(ref["model_dir"] + "/adapter_model.safetensors")
    assert ours.keys() == theirs.keys() and len(ours) == 4 * 4 * 2  # layers x targets x (A, B)
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) <= WEIGHT_ATOL


@pytest.mark.parametrize(("parallel", "margin"), [(dict(dp=1, tp=2, pp=1, microbatches=2), True),
                                                  (dict(dp=2, tp=1, pp=2, microbatches=2), False)])
def test_trl_reward_trainer_trains_a_sequence_classifier(worlds, tmp_path, parallel, margin):
    """TRL's RewardTrainer through the mixin on LlamaForSequenceClassification: its pairwise loss (with margins and
    centred rewards) over whole pairs in every dp rank and microbatch equals RewardTrainer in one process."""
    pytest.importorskip("trl")
    from tests.trainer_cases import reward

    ref = reward(out_dir=str(tmp_path / "reference"), margin=margin)
    size = parallel["dp"] * parallel["tp"] * parallel["pp"]
    results = worlds.run(size, trainer_cases.reward, out_dir=str(tmp_path / "parallel"), parallel=parallel,
                         margin=margin)
    assert all(r == results[0] for r in results)
    assert len(ref) == len(results[0]) == 6
    for ours, theirs in zip(results[0], ref):
        assert abs(ours - theirs) <= 1e-4 * abs(theirs), (results[0], ref)
