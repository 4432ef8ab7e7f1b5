"""qn-hf-check end to end: a config file in, local gloo processes, a verdict and its exit status."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from transformers import CONFIG_MAPPING


def _check(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "qn_hf.check.cli", *args], capture_output=True, text=True, env=env,
                          timeout=600)


@pytest.mark.script("qn-hf-check")
def test_full_size_config_is_equal_at_tp2_pp2_with_sequence_parallelism(tmp_path):
    CONFIG_MAPPING["qwen3"]().save_pretrained(tmp_path)  # the full-size default: only its shape is used
    done = _check(str(tmp_path / "config.json"), "--tp", "2", "--pp", "2", "--sequence-parallel", "--top", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == ("qwen3: shrunk copy with 4 layers at dp=1 tp=2 pp=2 sp on 4 CPU processes, against the "
                        "plain model"), lines[0]
    assert lines[1] == "EQUAL" and "worst |difference| beyond" in done.stdout and len(lines) == 8, done.stdout


def test_refused_and_bad_input_exit_2(tmp_path):
    CONFIG_MAPPING["doge"]().save_pretrained(tmp_path)
    done = _check(str(tmp_path), "--tp", "2")
    assert done.returncode == 2 and "REFUSED: tp=2: transformers' tp plan for 'doge'" in done.stdout, done.stdout + done.stderr
    missing = _check(str(tmp_path / "nothing-here"))
    assert missing.returncode == 2 and "neither a model directory nor a config.json" in missing.stderr


@pytest.mark.long  # the suite's time (issue 65): the same check's code runs in test_full_size_config_is_equal_at_tp2_pp2_with_sequence_parallelism
def test_moe_config_fully_sharded_with_context_and_expert_parallelism(tmp_path):
    """dp=2 with dp_shard=2 (FSDP), cp=2 and ep=2 on 4 processes; degrees that cannot work are refused
    before any process starts."""
    CONFIG_MAPPING["qwen3_moe"]().save_pretrained(tmp_path)
    done = _check(str(tmp_path), "--dp", "2", "--dp-shard", "2", "--cp", "2", "--ep", "2", "--top", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "at dp=2 tp=1 pp=1 dp_shard=2 cp=2 ep=2 on 4 CPU processes" in done.stdout, done.stdout
    assert done.stdout.splitlines()[1] == "EQUAL", done.stdout
    refused = _check(str(tmp_path), "--dp", "2", "--ep", "4")
    assert refused.returncode == 2 and "REFUSED: ep=4 must divide dp*tp = 2*1 = 2" in refused.stdout, refused.stdout
    refused = _check(str(tmp_path), "--dp", "2", "--dp-shard", "4")
    assert refused.returncode == 2 and "REFUSED: dp_shard=4 must divide dp=2" in refused.stdout, refused.stdout
