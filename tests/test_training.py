"""The training recipe's pure pieces: config merging, LR schedule, sampling and eval padding."""

from __future__ import annotations

import math
import re

import pytest

from qn_hf.training.config import build_parser, load_config, make_config
from qn_hf.training.errors import UsageError
from qn_hf.training.lr import warmup_cosine
from qn_hf.training.sampler import GlobalBatches, eval_batches


def test_yaml_then_command_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("mesh: [2, 2, 2]\nschedule: gpipe\nmicrobatches: 4\nlr: 3.0e-4\nsteps: 10\nmodel: tiny-llama\n")
    args = build_parser(task="lm", description="").parse_args(["--config", str(path), "--steps", "20", "--no-export"])
    cfg = load_config(args)
    assert cfg.mesh == (2, 2, 2) and cfg.schedule == "gpipe" and cfg.microbatches == 4 and cfg.lr == 3e-4
    assert cfg.steps == 20  # command line beats YAML beats the script's defaults
    assert cfg.model == "tiny-llama" and cfg.export is False and cfg.task == "lm"
    assert cfg.output_dir == "runs/lm" and cfg.val_fraction == 0.05  # the LM script's own defaults


@pytest.mark.parametrize("task", ["lm", "vit"])
def test_help_shows_the_defaults_the_script_uses(task):
    """Every default --help prints is the value a run without that option gets, and the model
    option lists exactly the task's presets."""
    parser = build_parser(task=task, description="")
    cfg = load_config(parser.parse_args([]))
    shown = 0
    for action in parser._actions:  # argparse keeps no public list of options
        if not action.option_strings or action.dest in ("help", "config") or action.option_strings == ["--no-resume"]:
            continue  # --no-resume: the other spelling of --resume, whose help shows the default
        match = re.search(r"\(default (.*)\)$", action.help or "")
        if match:
            shown += 1
            assert match.group(1) == str(getattr(cfg, action.dest)), (action.dest, action.help)
        else:
            assert getattr(cfg, action.dest) in (None, ()), f"--{action.dest} shows no default"
    assert shown > 20
    model_help = next(a.help for a in parser._actions if a.dest == "model")
    presets = {"lm": "tiny-gpt2, tiny-llama, tiny-qwen3-moe (default tiny-gpt2)", "vit": "tiny-vit (default tiny-vit)"}[task]
    assert model_help.endswith("a preset: " + presets), model_help


def test_resume_is_the_default_and_no_resume_starts_over(tmp_path):
    """The command that started a job restarts it (torchrun --max-restarts reruns it unchanged): it resumes
    from the newest complete checkpoint when there is one; --no-resume (YAML resume: null) starts over."""
    parser = build_parser(task="lm", description="")
    assert load_config(parser.parse_args([])).resume == "latest"
    assert load_config(parser.parse_args(["--resume"])).resume == "latest"
    assert load_config(parser.parse_args(["--resume", "ck/ckpt-000002"])).resume == "ck/ckpt-000002"
    assert load_config(parser.parse_args(["--no-resume"])).resume is None
    path = tmp_path / "run.yaml"
    path.write_text("resume: null\n")
    assert load_config(parser.parse_args(["--config", str(path)])).resume is None
    assert load_config(parser.parse_args(["--config", str(path), "--resume"])).resume == "latest"  # command line wins
    assert load_config(parser.parse_args(["--async-save"])).async_save is True
    gathered = load_config(parser.parse_args(["--ep", "2", "--expert-dispatch", "all_gather", "--microbatches", "1"]))
    assert gathered.expert_dispatch == "all_gather" and gathered.parallel_config(world=4).expert_dispatch == "all_gather"


@pytest.mark.parametrize("text, message", [
    ("mesh: [2, 2]\n", "mesh must be three integers"),
    ("mesh_shape: [1, 1, 1]\n", "unknown option(s) ['mesh_shape']"),
    ("schedule: zigzag\n", "schedule 'zigzag' is not one of"),
    ("expert_dispatch: all_scatter\n", "expert_dispatch 'all_scatter' is not one of ['all_gather', 'all_to_all']"),
    ("steps: ten\n", "steps must be a int"),
    ("export: 1\n", "export must be true or false"),
    ("- just\n- a list\n", "must hold a mapping"),
    ("stop_after: 9\nsteps: 5\n", "stop_after=9 must lie in 1..steps=5"),
    ("steps: null\n", "steps needs a value (got null)"),
])
def test_bad_yaml_is_one_clear_error(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(UsageError) as info:
        load_config(build_parser(task="lm", description="").parse_args(["--config", str(path)]))
    assert message in str(info.value)


def test_warmup_then_cosine_to_the_floor():
    rates = [warmup_cosine(s, lr=1.0, warmup_steps=10, total_steps=110, min_lr_ratio=0.1) for s in range(1, 111)]
    assert rates[:10] == pytest.approx([s / 10 for s in range(1, 11)])
    assert all(a >= b for a, b in zip(rates[9:], rates[10:]))  # decays monotonically after warm-up
    assert rates[-1] == pytest.approx(0.1)
    assert rates[59] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))  # half way


def test_global_batches_do_not_depend_on_the_mesh():
    sampler = GlobalBatches(examples=103, batch_size=8, seed=3)
    for step in (1, 12, 13, 40):  # 12 steps per epoch: 13 starts a new permutation
        whole = sampler.global_indices(step)
        assert len(set(whole)) == 8
        for dp in (1, 2, 4, 8):
            parts = [sampler.local_indices(step, dp_rank=r, dp=dp) for r in range(dp)]
            assert sum(parts, []) == whole
    first_epoch = sum((sampler.global_indices(s) for s in range(1, 13)), [])
    assert len(set(first_epoch)) == 96  # no example twice within an epoch
    assert sampler.global_indices(1) != sampler.global_indices(13)
    assert GlobalBatches(examples=103, batch_size=8, seed=4).global_indices(1) != sampler.global_indices(1)


def test_batch_larger_than_the_data_is_refused():
    with pytest.raises(UsageError, match="batch_size=64 is larger than the training split"):
        GlobalBatches(examples=10, batch_size=64, seed=0)


def test_eval_batches_cover_every_example_once_and_pad_the_last():
    batches = eval_batches(10, batch_size=4)
    assert [real for _, real in batches] == [4, 4, 2]
    assert all(len(rows) == 4 for rows, _ in batches)
    assert sum((rows[:real] for rows, real in batches), []) == list(range(10))
    assert len(eval_batches(10, batch_size=4, limit=2)) == 2


def test_config_checks_values_from_any_source():
    with pytest.raises(UsageError, match="val_fraction must be between 0 and 1"):
        make_config({"val_fraction": 1.5})
    with pytest.raises(UsageError, match="microbatches must be at least 1"):
        make_config({"microbatches": 0})


def test_resume_latest_starts_fresh_only_when_nothing_is_there(tmp_path):
    from qn_hf.checkpoint import CheckpointError
    from qn_hf.training.resume import resume_path

    cfg = make_config({"output_dir": str(tmp_path), "resume": "latest"})
    assert resume_path(cfg) is None  # no checkpoints yet: a fresh start
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "ckpt-000003").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text('"ckpt-0000')  # torn pointer
    with pytest.raises(CheckpointError):
        resume_path(cfg)  # never start over on top of checkpoints that exist


def test_default_microbatches_keep_the_pipeline_busy():
    from qn_hf.training.config import default_microbatches

    assert default_microbatches(batch_size=32, dp=2, pp=2) == 4  # 2*pp
    assert default_microbatches(batch_size=10, dp=1, pp=4) == 5  # the largest divisor up to 2*pp
    assert default_microbatches(batch_size=6, dp=1, pp=4) == 6
    assert default_microbatches(batch_size=32, dp=4, pp=1) == 1  # no pipeline: no need
    assert make_config({"task": "lm"}).microbatches is None  # resolved at launch, when the mesh is known


def test_loss_plot_steps_are_whole_numbers():
    import matplotlib.pyplot as plt

    from qn_hf.training.plots import loss_figure

    records = [{"step": s, "loss": 3.0 - 0.1 * s} for s in range(1, 9)] + [{"step": 8, "loss": 2.2, "val_loss": 2.3}]
    fig = loss_figure(runs=[("run", records)], title="short run")
    ticks = [t for t in fig.axes[0].get_xticks() if 1 <= t <= 8]
    plt.close(fig)
    assert ticks and all(float(t).is_integer() for t in ticks), ticks


def test_mesh_auto_keeps_the_options_given_and_records_the_choice(tmp_path):
    """--mesh auto (or `mesh: auto`) leaves the degrees to the planner; the parallel options the YAML or the
    command line set are kept in every candidate (given at their defaults too), the others are the
    planner's; chosen() is the run at the chosen configuration, as config.yaml records it."""
    from qn_hf.config.parallel_config import ParallelConfig
    from qn_hf.config.schedule import Schedule
    from qn_hf.training.config import effective_yaml, read_yaml

    parser = build_parser(task="lm", description="")
    (tmp_path / "run.yaml").write_text("mesh: auto\nmixed_precision: bf16\ncp: 1\nmicrobatches: null\n")
    cfg = load_config(parser.parse_args(["--config", str(tmp_path / "run.yaml"), "--recompute", "selective",
                                         "--schedule", "1f1b", "--zero"]))
    assert cfg.auto and cfg.mesh == "auto"
    fixed = cfg.fixed_options()
    assert fixed == {"cp": 1, "mixed_precision": "bf16", "recompute": "selective", "schedule": "1f1b"}
    assert fixed["schedule"] is Schedule.ONE_F_ONE_B
    assert load_config(parser.parse_args(["--mesh", "auto"])).fixed_options() == {}
    assert load_config(parser.parse_args(["--mesh", "auto", "--virtual-stages", "2"])).fixed_options() == {
        "schedule": "1f1b", "virtual_stages": 2}  # the chunks go with a schedule: the one given, or the default

    parallel = ParallelConfig(dp=1, tp=2, pp=2, microbatches=4, schedule="zb_h1", mixed_precision="bf16",
                              recompute="selective", sequence_parallel=True)
    run = cfg.chosen(parallel)
    assert run.mesh == (1, 2, 2) and run.parallel_config(world=4) == parallel and run.zero
    (tmp_path / "config.yaml").write_text(effective_yaml(run, comment="chosen: tp=2, pp=2\nrunner-up: dp=4"))
    assert (tmp_path / "config.yaml").read_text().startswith("# chosen: tp=2, pp=2\n# runner-up: dp=4\n")
    again = load_config(parser.parse_args(["--config", str(tmp_path / "config.yaml")]))
    assert again == run and again.parallel_config(world=4) == parallel
    assert read_yaml(str(tmp_path / "config.yaml"))["schedule"] == "zb_h1"
    with pytest.raises(ValueError, match="no degrees until the planner chooses them"):
        cfg.mesh_for(4)


@pytest.mark.parametrize("args, message", [
    (["--mesh", "auto", "--microbatches", "2"], "microbatches=2 with mesh auto: the planner chooses them"),
    (["--calibration", "machine.json"], "calibration machine.json is read by --mesh auto only"),
    (["--mesh", "auto", "2"], "mesh must be three integers [dp, tp, pp] or auto, got ['auto', 2]"),
    (["--mesh", "2", "2"], "mesh must be three integers [dp, tp, pp] or auto, got [2, 2]"),
])
def test_mesh_auto_refusals(args, message):
    """Checked where the options are read, before any process group exists."""
    with pytest.raises(UsageError) as info:
        load_config(build_parser(task="lm", description="").parse_args(args))
    assert message in str(info.value)


def test_a_calibration_file_that_cannot_be_read_is_a_usage_error(tmp_path):
    from qn_hf.training.loop import _calibration

    with pytest.raises(UsageError, match="calibration file .*nothing.json does not exist .*--calibrate"):
        _calibration(make_config({"mesh": "auto", "calibration": str(tmp_path / "nothing.json")}))
    from qn_hf.planner.calibration import FORMAT

    (tmp_path / "bad.json").write_text(f'{{"format": {FORMAT}}}')
    with pytest.raises(UsageError, match="bad.json cannot be read: not a qn_hf calibration file"):
        _calibration(make_config({"mesh": "auto", "calibration": str(tmp_path / "bad.json")}))


def _saved_at(tmp_path, mesh: dict) -> str:
    """A checkpoint directory whose index records ``mesh`` (no tensors: only the mesh is read)."""
    from qn_hf.checkpoint.format import new_index
    from qn_hf.checkpoint.seal import write_index

    path = tmp_path / "ckpt-000006"
    path.mkdir()
    write_index(new_index(library_version="test", step=6, mesh=mesh, config={"model_type": "llama"}, tensors={}, optimizer=None, files={},
                          generation_config=None, loss_scaler=None),
                str(path / "index.json"))
    return str(path)


@pytest.mark.parametrize("values, world, expected, note", [
    ({"dp_shard": 2}, 1, {"dp_shard": 1}, "--dp-shard 2 does not divide dp=1: now 1"),  # the probe's moved FSDP job
    ({"dp_shard": 4}, 6, {"dp_shard": 3}, "--dp-shard 4 does not divide dp=6: now 3"),
    ({"dp_shard": 2}, 2, {"dp_shard": 2}, None),  # fits: kept
    ({"cp": 2}, 1, {"cp": 1}, "--cp 2 does not divide the world size=1: now 1"),
    ({"mesh": [1, 2, 1], "ep": 4}, 2, {"ep": 2}, "--ep 4 does not divide dp x tp=2: now 2"),
    ({"mesh": [2, 1, 2], "dp_shard": 2, "microbatches": 4}, 1, {"mesh": "auto", "dp_shard": 1},
     "--dp-shard 2 does not divide dp=1: now 1"),  # the planner's mesh, the degree it can hold
])
def test_a_moved_job_keeps_what_it_can_of_its_mesh(tmp_path, values, world, expected, note):
    """Issue 66: a job trained with --dp-shard 2 and relaunched on 1 process was refused (exit 2, which torchrun
    retries for nothing); each of cp, dp_shard and ep now comes down to the largest degree the new mesh holds,
    and the line that says the job moved says so."""
    from qn_hf.training.resume import resume_mesh

    saved = _saved_at(tmp_path, {"dp": 2, "tp": 1, "pp": 2})
    moved, line = resume_mesh(make_config({"microbatches": 1, **values, "resume": saved}), resume_from=saved,
                              world=world)
    assert {name: getattr(moved, name) for name in expected} == expected
    if note is None:
        assert "does not divide" not in line
    else:
        assert line.endswith(note) or f"{note};" in line, line
    if not moved.auto:
        moved.parallel_config(world=world)  # the degrees now hold: no ValueError


@pytest.mark.parametrize("mesh, world, expected", [
    (None, 2, None),  # the default mesh fits any world: kept
    ((1, 2, 1), 2, (1, 2, 1)),  # a mesh that fits the new world: kept
    ((2, 1, 2), 4, (2, 1, 2)),  # the same world as the checkpoint's: nothing moved
    ((2, 1, 2), 2, "auto"),  # needs the old world: the planner chooses
])
def test_a_resume_at_another_world_size_keeps_the_mesh_where_it_fits(tmp_path, mesh, world, expected):
    from qn_hf.training.resume import resume_mesh

    saved = _saved_at(tmp_path, {"dp": 2, "tp": 1, "pp": 2})
    values = {"resume": saved, "microbatches": 4} if mesh is None else {"mesh": list(mesh), "resume": saved,
                                                                        "microbatches": 4, "schedule": "gpipe"}
    cfg = make_config(values)
    moved, line = resume_mesh(cfg, resume_from=saved, world=world)
    assert moved.mesh == expected
    if world == 4:
        assert line is None and moved == cfg
        return
    assert line.startswith(f"resumed at {world} processes from a checkpoint of 4 processes (mesh dp=2 tp=1 pp=2)")
    if expected == "auto":  # the options given stay fixed for the planner, the mesh's microbatches do not
        assert "--mesh 2 1 2 needs 4 processes" in line
        assert moved.microbatches is None and "schedule" in moved.given and "mesh" not in moved.given
