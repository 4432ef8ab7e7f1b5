"""How ``tests/data/checkpoint_v2/`` was made (qn_hf's checkpoint format version 2, by the commit
named in ``made_by.json`` beside the data): a tiny Llama (2 blocks, GQA, untied head, vocabulary padded over tp) after one AdamW
step at dp=2, tp=2 with ZeRO-1 (``qn_hf.optimizer(..., zero=True)``: each dp rank writes its part of the
optimizer state), saved in both formats, qn_hf's own (``qn``) and torch.distributed.checkpoint (``dcp``);
the same weights written by ``save_pretrained`` (``hf``); the weights after one more step (``hf-step2``) and
that step's loss (``step2.json``, a hex float), which a resumed run must reproduce (bit for bit in
the environment ``made_by.json`` records).

Kept so that every later version proves it still loads and resumes what this one wrote
(``tests/test_checkpoint_compat.py``); rerunning it with newer code would only test that code against
itself. ``PYTHONPATH=. torchrun --nproc-per-node 4 tests/data/make_checkpoint_v2.py OUT``
"""

import json
import os
import subprocess
import sys

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import qn_hf
from tests.golden_cases import environment
from tests.models import CONFIGS, dp_slice, make_batch

out = sys.argv[1]
torch.manual_seed(1234)
model = LlamaForCausalLM(LlamaConfig(**{**CONFIGS["llama"].to_dict(), "num_hidden_layers": 2}))
pm = qn_hf.parallelize(model, dp=2, tp=2, seed=0)
opt = qn_hf.optimizer(pm, torch.optim.AdamW, zero=True, lr=1e-3, weight_decay=0.01)
pm.train_step(dp_slice(make_batch("llama", size=8, seed=7), dp=2, dp_rank=pm.coords["dp"]))
opt.step()
pm.save_checkpoint(os.path.join(out, "qn"), optimizer=opt, step=1)
pm.save_checkpoint(os.path.join(out, "dcp"), optimizer=opt, step=1, format="dcp")
pm.save_pretrained(os.path.join(out, "hf"))
# What resuming must reproduce: one more step (its optimizer state included) from the checkpoint.
opt.zero_grad()
loss = pm.train_step(dp_slice(make_batch("llama", size=8, seed=8), dp=2, dp_rank=pm.coords["dp"]))
opt.step()
pm.save_pretrained(os.path.join(out, "hf-step2"))
if dist.get_rank() == 0:
    with open(os.path.join(out, "step2.json"), "w") as f:
        json.dump({"loss": loss.item().hex()}, f)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(out, "made_by.json"), "w") as f:  # the environment decides the bits of step 2
        json.dump({"qn_hf": qn_hf.__version__, "commit": commit, "environment": environment()}, f, indent=1)
