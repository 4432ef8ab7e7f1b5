"""The heads zoo's job, on every rank of a test world: one class of one model type, shrunk from its
default config, at one column (``qn_hf.check.zoo.HEAD_COLUMNS``) against the plain model."""

from __future__ import annotations


def head_zoo_step(*, model_type: str, cls: str, column: str) -> str:
    """The outcome ``qn_hf.check.zoo.outcome_of`` records: equal, refused, different, or apart (the class
    cannot be built from its shrunk default config, or its plain forward fails alone, or no batch)."""
    import torch
    import transformers
    from transformers import CONFIG_MAPPING

    from qn_hf.check.config_part import config_taken_by
    from qn_hf.check.run import one_step_parity
    from qn_hf.check.shrink import shrink_config
    from qn_hf.check.zoo import HEAD_COLUMNS, outcome_of
    from tests.cases import mesh_for, pad_for_pooling

    mesh = HEAD_COLUMNS[column]
    try:
        config = shrink_config(CONFIG_MAPPING[model_type](), builds=getattr(transformers, cls))
        taken = config_taken_by(config, getattr(transformers, cls))  # a text class's part of a composite config
        pad_for_pooling(taken, cls)
        torch.manual_seed(0)
        getattr(transformers, cls)(taken)
    except Exception as e:  # noqa: BLE001 -- a class its shrunk default config does not build is apart
        return f"cannot build: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    verdict = one_step_parity(config=config.to_dict(), parallel=mesh.parallel, model_class_name=cls, steps=2,
                              mesh=mesh_for(mesh.dims.dp, mesh.dims.tp, mesh.dims.pp))
    return outcome_of(verdict)
