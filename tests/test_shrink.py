"""The check's shrunk configs (qn_hf/check/shrink.py): a shrunk model's training forward draws nothing at
random (dropout under any of its names, stochastic depth, drop connect, per-stage rate lists), since no split
of the batch over ranks draws what one process draws; staged towers keep two blocks a stage at most."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import CONFIG_MAPPING

from qn_hf.check.inputs import _per_row, dummy_batch
from qn_hf.check.shrink import STAGE_DEPTH, shrink_config

# model type, class: per-stage rate lists (CvT), drop connect (ALIGN's and EfficientNet's towers), drop path
# (Swin, ConvNeXt, BEiT), SpecAugment and LayerDrop (wav2vec2)
RANDOM_IN_TRAINING = [("cvt", "CvtModel"), ("align", "AlignVisionModel"), ("efficientnet", "EfficientNetModel"),
                      ("swin", "SwinModel"), ("convnext", "ConvNextModel"), ("beit", "BeitModel"),
                      ("wav2vec2", "Wav2Vec2Model"), ("dinov3_vit", "DINOv3ViTModel"),  # RoPE rescaled at random
                      ("gpt2", "GPT2ForTokenClassification")]  # a head's dropout of 0.1 the config names no key for


@pytest.mark.parametrize(("model_type", "cls"), RANDOM_IN_TRAINING)
def test_a_shrunk_model_trains_without_random_draws(model_type, cls):
    config = shrink_config(CONFIG_MAPPING[model_type]())
    if model_type == "align":
        config = config.vision_config
    torch.manual_seed(0)
    model = getattr(transformers, cls)(config).train()
    for module in model.modules():  # batch statistics differ between rows, not between draws: fixed here
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            module.eval()
    batch = dummy_batch(model, rows=2, seed=1)
    batch = {k: v for k, v in batch.items() if k != "labels"}
    outputs = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        with torch.no_grad():
            outputs.append(_per_row(model(**batch)))
    assert outputs[0] and all(torch.equal(a, b) for a, b in zip(*outputs))


@pytest.mark.parametrize("model_type", ["resnet", "bit", "convnext", "regnet", "swin", "levit"])
def test_staged_towers_keep_every_stage_with_at_most_two_blocks(model_type):
    full, shrunk = CONFIG_MAPPING[model_type](), shrink_config(CONFIG_MAPPING[model_type]())
    assert len(shrunk.depths) == len(full.depths)
    assert shrunk.depths == [min(d, STAGE_DEPTH) for d in full.depths]
