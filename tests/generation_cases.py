"""Jobs for test_generation.py (every rank runs them): ``pm.generate`` and ``pm.state_dict()`` against
the plain Hugging Face model built from the same weights."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import qn_hf
from tests.cases import error_message, mesh_for
from tests.models import CONFIGS, load, make_batch

NEW_TOKENS = 6
SEED = 1234


def _prompts(kind: str, *, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Three prompts of 7, 4 and 6 tokens, left-padded to 7 with the pad token (mask 0 there)."""
    config = CONFIGS[kind]
    pad = _pad_id(kind)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, config.vocab_size, (3, 7), generator=gen)
    mask = torch.ones_like(ids)
    for row, length in enumerate((7, 4, 6)):
        ids[row, : 7 - length] = pad
        mask[row, : 7 - length] = 0
    return ids, mask


def _pad_id(kind: str) -> int:
    config = CONFIGS[kind]
    return config.pad_token_id if config.pad_token_id is not None else config.eos_token_id


def generation(*, model_dirs: dict[str, str], kinds: list[str], dp: int, tp: int, pp: int,
               sequence_parallel: bool = False, virtual_stages: int = 1, cp: int = 1) -> dict:
    """Greedy (left-padded batch with attention_mask, and one prompt without a mask) and sampling
    (top_k, temperature; ranks other than the replica's first seeded differently, so equality shows the
    generator is shared), each replica on its own prompts; the sequences and the reference's."""
    out: dict = {"rank": dist.get_rank()}
    for kind in kinds:
        ref = load(kind, model_dirs[kind]).eval()
        pm = qn_hf.parallelize(load(kind, model_dirs[kind]), dp=dp, tp=tp, pp=pp, cp=cp, mesh=mesh_for(dp, tp, pp, cp),
                               microbatches=2 * pp, sequence_parallel=sequence_parallel,
                               schedule="interleaved_1f1b" if virtual_stages > 1 else "1f1b",
                               virtual_stages=virtual_stages)
        pm.train()  # generate runs in eval mode and must give this back
        ids, mask = _prompts(kind, seed=100 + pm.coords["dp"])
        common = dict(max_new_tokens=NEW_TOKENS, pad_token_id=_pad_id(kind))
        results = {}
        with torch.no_grad():
            results["greedy"] = (pm.generate(ids, attention_mask=mask, do_sample=False, **common),
                                 ref.generate(ids, attention_mask=mask, do_sample=False, **common))
            one = ids[:1]  # the unpadded prompt, no attention_mask
            results["single"] = (pm.generate(one, do_sample=False, **common), ref.generate(one, do_sample=False, **common))
            sampling = dict(do_sample=True, top_k=20, temperature=0.7, **common)
            first_of_replica = pm.coords["tp"] == 0 and pm.coords["pp"] == 0
            torch.manual_seed(SEED if first_of_replica else SEED + 1 + dist.get_rank())
            before = torch.get_rng_state()
            ours = pm.generate(ids, attention_mask=mask, **sampling)
            after = torch.get_rng_state()
            torch.manual_seed(SEED)
            results["sampled"] = (ours, ref.generate(ids, attention_mask=mask, **sampling))
            # the first stage's generator advanced as the plain model's; later stages' left as they were
            generator_ok = torch.equal(after, torch.get_rng_state() if pm.coords["pp"] == 0 else before)
            # the same seed, greedy scores: the whole-vocabulary logits HF's processors saw
            scores = pm.generate(ids, attention_mask=mask, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, **common).logits
            ref_scores = ref.generate(ids, attention_mask=mask, do_sample=False, output_logits=True,
                                      return_dict_in_generate=True, **common).logits
        # after generating, the model trains as before: sequence parallelism back on, the loss the plain model's
        batch = make_batch(kind, size=2 * pp * dp, seed=5)
        loss_after = pm.eval_step(pm.local_batch(batch)).item()
        ref_after = ref(**batch).loss.item()
        out[kind] = {
            "sp_on_after": pm.sp_switch.on if sequence_parallel else True,
            "loss_after": (loss_after, ref_after),
            "dp": pm.coords["dp"],
            **{name: (a.tolist(), b.tolist()) for name, (a, b) in results.items()},
            "logit_err": max((a - b).abs().max().item() for a, b in zip(scores, ref_scores)),
            "vocab": [s.shape[-1] for s in scores][0],
            "training": pm.module.training,
            "generator": generator_ok,
            "generation_config": pm.generation_config.to_dict() == ref.generation_config.to_dict(),
        }
    return out


def full_state(*, model_dirs: dict[str, str], kinds: list[str], dp: int, tp: int, pp: int) -> dict:
    """``pm.state_dict()`` against the plain model's, and the refusal at a tiny ``max_bytes``."""
    out: dict = {"rank": dist.get_rank()}
    for kind in kinds:
        ref = load(kind, model_dirs[kind])
        pm = qn_hf.parallelize(load(kind, model_dirs[kind]), dp=dp, tp=tp, pp=pp, mesh=mesh_for(dp, tp, pp),
                               microbatches=2 * pp)
        state, ref_state = pm.state_dict(), ref.state_dict()
        shared = set(state) & set(ref_state)
        out[kind] = {
            "keys": list(state) == list(ref_state),
            "missing": sorted(set(ref_state) - set(state)),
            "unexpected": sorted(set(state) - set(ref_state)),
            "different": sorted(n for n in shared if state[n].dtype != ref_state[n].dtype
                                or not torch.equal(state[n], ref_state[n])),
            "devices": sorted({str(t.device) for t in state.values()}),
            # a tied weight as HF gives it: one tensor under both names
            "tied": "lm_head.weight" in state and state["lm_head.weight"] is state.get("transformer.wte.weight"),
            "refused": error_message(lambda: pm.state_dict(max_bytes=1000)),
        }
    return out


def refusals(*, model_dirs: dict[str, str]) -> dict:
    """What generate refuses, with the fix in the message (a 2-rank world)."""
    from transformers import DynamicCache

    ids = torch.arange(3, 8)[None]
    path = model_dirs["llama"]
    sp = qn_hf.parallelize(load("llama", path), tp=2, sequence_parallel=True, mesh=mesh_for(1, 2))
    pipeline = qn_hf.parallelize(load("llama", path), pp=2, microbatches=4, mesh=mesh_for(1, 1, 2))
    vit = qn_hf.parallelize(load("vit", model_dirs["vit"]), tp=2, mesh=mesh_for(1, 2))
    return {
        "use_cache": error_message(lambda: pipeline.generate(ids, max_new_tokens=2, use_cache=True)),
        "hidden_states": error_message(lambda: pipeline.generate(ids, max_new_tokens=2, output_hidden_states=True,
                                                                 return_dict_in_generate=True)),
        "vit": error_message(lambda: vit.generate(ids, max_new_tokens=2)),
        # a cache passed in, under either name (transformers 5.24's cache, past_key_values before)
        **{name: error_message(lambda name=name: pipeline.generate(ids, max_new_tokens=2, **{name: DynamicCache()}))
           for name in ("cache", "past_key_values")},
        # a clock read by each rank on its own could stop one rank of the replica before the others
        "max_time": error_message(lambda: pipeline.generate(ids, max_new_tokens=2, max_time=5.0)),
        "tp_max_time": error_message(lambda: sp.generate(ids, max_new_tokens=2, max_time=5.0)),
    }


def ep_generation(*, dp: int, pp: int, ep: int, tp: int = 1, sequence_parallel: bool = False,
                  expert_dispatch: str = "all_to_all") -> dict:
    """Greedy generation of a shrunk Qwen3-MoE at dp x pp with experts over ep, each dp replica with
    its own prompts and its own ``max_new_tokens`` (so the replicas' loops differ in length): the
    sequences and the plain model's."""
    from qn_hf.check.run import build
    from tests.ep_cases import moe_config

    model = build(moe_config("qwen3_moe"), seed=0)
    ref = copy.deepcopy(model).eval()
    pm = qn_hf.parallelize(model, dp=dp, tp=tp, pp=pp, ep=ep, microbatches=pp, mesh=mesh_for(dp, tp, pp),
                           sequence_parallel=sequence_parallel, expert_dispatch=expert_dispatch)
    replica = pm.coords["dp"]
    gen = torch.Generator().manual_seed(40 + replica)
    ids = torch.randint(3, model.config.vocab_size, (2, 5 + replica), generator=gen)
    common = dict(max_new_tokens=3 + 3 * replica, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ours = pm.generate(ids, **common)
        theirs = ref.generate(ids, **common)
    refused = error_message(lambda: pm.generate(ids, synced_gpus=False, **common))
    return {"dp": replica, "ours": ours.tolist(), "theirs": theirs.tolist(), "refused": refused}


def mixed_generation(*, model_dirs: dict[str, str], precision: str, pp: int) -> dict:
    """Greedy generation under ``mixed_precision`` at pp: the tokens and the greedy scores of the plain
    model with its parameters cast to that dtype (what mixed precision computes with)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    ref = load("llama", model_dirs["llama"]).eval()
    for p in ref.parameters():
        p.data = p.data.to(dtype)
    pm = qn_hf.parallelize(load("llama", model_dirs["llama"]), pp=pp, microbatches=pp, mesh=mesh_for(1, 1, pp),
                           mixed_precision=precision)
    ids, mask = _prompts("llama", seed=100)
    common = dict(max_new_tokens=NEW_TOKENS, pad_token_id=_pad_id("llama"), do_sample=False, output_logits=True,
                  return_dict_in_generate=True)
    with torch.no_grad():
        ours = pm.generate(ids, attention_mask=mask, **common)
        # at pp>1 each token re-runs the whole sequence (no KV cache): so does the reference, so that the
        # low-precision matmuls see the same shapes (a cached step's one-row product may take another kernel)
        theirs = ref.generate(ids, attention_mask=mask, **common, use_cache=pp == 1)
    return {"ours": ours.sequences.tolist(), "theirs": theirs.sequences.tolist(),
            "logit_err": max((a.float() - b.float()).abs().max().item() for a, b in zip(ours.logits, theirs.logits))}
