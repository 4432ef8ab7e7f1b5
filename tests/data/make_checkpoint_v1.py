"""How ``tests/data/checkpoint_v1/`` was made (qn_hf at commit ae2123a, before the checkpoint code
moved into ``qn_hf/checkpoint/``): a tiny GPT-2 (vocabulary padded over tp, the embedding tied to
the head across stages, fused q|k|v saved as several pieces) after one AdamW step at dp=1, tp=2,
pp=2, saved with its optimizer, plus the same weights written by ``save_pretrained`` (``hf``) and
the weights after one more step (``hf-step2``), which a resumed run must reproduce.

Kept so that every later version proves it still loads what this one wrote
(``tests/test_checkpoint_compat.py``); rerunning it with newer code would only test that code
against itself. ``torchrun --nproc-per-node 4 tests/data/make_checkpoint_v1.py OUT``
"""

import os
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import qn_hf
from tests.models import NO_DROPOUT_GPT2, make_batch

CONFIG = GPT2Config(n_layer=2, n_embd=16, n_head=4, n_positions=32, vocab_size=99, bos_token_id=0, eos_token_id=0,
                    **NO_DROPOUT_GPT2)

out = sys.argv[1]
torch.manual_seed(1234)
model = GPT2LMHeadModel(CONFIG)
pm = qn_hf.parallelize(model, tp=2, pp=2, microbatches=2, seed=0)
opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, weight_decay=0.01)
pm.train_step(make_batch("gpt2", size=4, seed=7))
opt.step()
pm.save_checkpoint(os.path.join(out, "checkpoint"), optimizer=opt, step=1)
pm.save_pretrained(os.path.join(out, "hf"))
# What resuming must reproduce: one more step (its optimizer state included) from the checkpoint.
opt.zero_grad()
pm.train_step(make_batch("gpt2", size=4, seed=8))
opt.step()
pm.save_pretrained(os.path.join(out, "hf-step2"))
