"""Model-zoo jobs run inside test worlds (every rank)."""

from __future__ import annotations

from qn_hf.check.run import one_step_parity
from tests.cases import mesh_for


def zoo_step(*, config: dict, mesh) -> dict:
    """One step at a ``ZooMesh`` column against the plain model."""
    return one_step_parity(config=config, mesh=mesh_for(mesh.dp, mesh.tp, mesh.pp, mesh.cp), **mesh.parity_kwargs())


def custom_policy_step(*, config: dict, policy, tp: int, out_dir: str) -> dict:
    """One step with a user's own policy; also returns the exported config (rank 0)."""
    import json
    import os

    verdict = one_step_parity(config=config, tp=tp, mesh=mesh_for(1, tp), out_dir=out_dir, policy=policy)
    exported = os.path.join(out_dir, "config.json")
    verdict["exported_config"] = json.load(open(exported)) if os.path.exists(exported) else None
    return verdict


def router_logits_refusal(*, config: dict) -> str:
    """A MoE model whose config asks for the routers' auxiliary loss, with microbatches (whose pools
    are not the batch's): the built-in loss refuses."""
    import torch
    import transformers

    import qn_hf
    from qn_hf.check.run import build

    model = build(transformers.AutoConfig.for_model(**{**config, "output_router_logits": True}), seed=0)
    pm = qn_hf.parallelize(model, tp=2, microbatches=2, mesh=mesh_for(1, 2))
    ids = torch.randint(3, 100, (2, 8))
    try:
        pm.train_step({"input_ids": ids, "labels": ids})
    except ValueError as e:
        return str(e)
    return "no error"


def custom_policy_mesh_step(*, config: dict, policy, tp: int, pp: int) -> dict:
    """One step with a user's own policy at (1, tp, pp)."""
    return one_step_parity(config=config, tp=tp, pp=pp, mesh=mesh_for(1, tp, pp), policy=policy)


def gpt_oss_cp_step(*, config: dict, cp: int) -> dict:
    """gpt-oss (attention sinks, sliding windows, MoE) has no tp plan in transformers; a user's
    policy with no tp rules parallelizes it over cp."""
    from qn_hf.policies.model_policy import ModelPolicy

    policy = ModelPolicy(model_type="gpt_oss", layers="layers", tp_plan={}, transformers_plan=True, loss="causal_lm")
    return one_step_parity(config=config, cp=cp, mesh=mesh_for(1, 1, 1, cp), policy=policy)
