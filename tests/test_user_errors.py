"""What a user sees when parallelize refuses: a misspelt keyword names the close match; a refusal
under torchrun prints one traceback (rank 0's) and one line from every other rank, and the launcher
names rank 0 as the first failure."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

import qn_hf

ROOT = Path(__file__).resolve().parent.parent
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=97)


def test_a_misspelt_keyword_names_the_close_match():
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'micro_batches' \(did you mean 'microbatches'\?\)"):
        qn_hf.parallelize(LlamaForCausalLM(LlamaConfig(**TINY)), micro_batches=4)


def test_parallelize_takes_a_configuration_or_its_keywords(monkeypatch):
    """The options are ParallelConfig's keywords, written once there: beside a configuration a keyword that changes
    something is refused, one at its default is no change (the launch's check then speaks). No process group."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    model, config = LlamaForCausalLM(LlamaConfig(**TINY)), qn_hf.ParallelConfig(dp=2)
    already = r"parallelize\(model, config, microbatches=\.\.\.\): the config already holds"
    with pytest.raises(ValueError, match=already):
        qn_hf.parallelize(model, config, microbatches=4)
    with pytest.raises(ValueError, match=r"world size 1 != dp\*tp\*pp = 2\*1\*1"):
        qn_hf.parallelize(model, config, dp=1, schedule="1f1b")
    with pytest.raises(TypeError, match=r"'mirco_batches' \(did you mean 'microbatches'\?\); it takes policy, mesh, "
                                        r"device, .*, dp, tp, pp, cp, ep, dp_shard, microbatches"):
        qn_hf.parallelize(model, config, mirco_batches=4)


def test_dp_shard_alone_names_the_dp_it_needs(monkeypatch):
    """dp_shard shards within dp: ``dp_shard=4`` alone on 4 ranks is told to set dp=4, the fix that
    works, not to choose dp_shard among [1]. No process group: the check runs before any."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"dp_shard=4 must divide dp=1: .* e\.g\. dp=4, dp_shard=4 \(4 processes "):
        qn_hf.parallelize(LlamaForCausalLM(LlamaConfig(**TINY)), dp_shard=4)


def test_a_refusal_under_torchrun_prints_one_traceback(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(f"""
        import qn_hf
        from transformers import LlamaConfig, LlamaForCausalLM
        qn_hf.parallelize(LlamaForCausalLM(LlamaConfig(**{TINY!r})), dp=1, tp=1)
    """))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                           str(script)], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode != 0
    message = "ValueError: world size 3 != dp*tp*pp = 1*1*1 = 1"
    ours = [line for line in output.splitlines() if line.startswith(message)]
    assert len(ours) == 1, output  # rank 0's, at the end of its traceback
    assert output.count(", in parallelize\n") == 1, output  # one traceback through qn_hf
    for rank in (1, 2):
        assert f"[rank {rank}] {message}" in output and "rank 0 shows the traceback" in output, output
    root = output[output.index("Root Cause"):]
    assert "rank      : 0 " in root, root
