"""Packed inputs (step/packed.py): a vision-language batch whose images lie back to back in ``pixel_values``
beside ``image_grid_thw`` is cut by rows with each row's own images, equal to the plain model; what cannot be
told apart is refused naming it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

from qn_hf.policies.body import repeated_blocks
from qn_hf.policies.packed_inputs import item_towers
from qn_hf.step.batch import dp_rows, split_microbatches
from qn_hf.step.packed import row_layout
from tests import packed_cases


def _batch(types: bool = True) -> tuple[dict, object]:
    config = packed_cases.packed_config("qwen2_vl", "Qwen2VLForConditionalGeneration")
    return packed_cases.packed_batch(config, seed=0, types=types), Qwen2VLConfig(**config)


@pytest.mark.parametrize("types", [True, False])
def test_each_row_takes_its_own_images(types):
    # rows hold 1, 2, 0 and 1 images of 16, 8, 8 and 16 patches, and row 2 a video of 8 (packed_cases.IMAGES)
    batch, config = _batch(types)
    layout = row_layout(batch, config)
    assert layout.bounds["image_grid_thw"] == (0, 1, 3, 3, 4)
    assert layout.bounds["pixel_values"] == (0, 16, 32, 32, 48)
    assert layout.bounds["video_grid_thw"] == (0, 0, 0, 1, 1) and layout.bounds["pixel_values_videos"] == (0, 0, 0, 8, 8)
    first, second = (dp_rows(batch, dp=2, dp_rank=r, multiple=1, config=config) for r in (0, 1))
    assert torch.equal(first["pixel_values"], batch["pixel_values"][:32]) and "pixel_values_videos" not in first
    assert torch.equal(second["image_grid_thw"], batch["image_grid_thw"][3:])
    assert torch.equal(second["pixel_values_videos"], batch["pixel_values_videos"])
    parts = split_microbatches(batch, microbatches=4, layout=layout)
    assert [p["pixel_values"].shape[0] if "pixel_values" in p else 0 for p in parts] == [16, 16, 0, 16]


def test_a_padding_row_copies_row_zero_with_its_images():
    batch, config = _batch()
    three = row_layout(batch, config).take(batch, 0, 3)
    last = dp_rows(three, dp=2, dp_rank=1, multiple=1, config=config)  # rows 2 and a copy of row 0
    assert torch.equal(last["pixel_values"], batch["pixel_values"][:16]) and (last["labels"][1] == -100).all()
    assert torch.equal(last["video_grid_thw"], batch["video_grid_thw"])


@pytest.mark.parametrize(("change", "message"), [
    (lambda b, c: b.update(pixel_values=b["pixel_values"][:-1]), "holds 47 rows but the items of 'image_grid_thw' have 48"),
    (lambda b, c: b["mm_token_type_ids"][0, 2].fill_(0), "row 0 holds 3 of their tokens, which no run"),
    (lambda b, c: b.update(image_grid_thw=b["image_grid_thw"][:3], pixel_values=b["pixel_values"][:32]),
     "row 3 holds 4 of their tokens"),
    (lambda b, c: [b.pop(k) for k in ("input_ids", "attention_mask", "labels", "mm_token_type_ids")] and None,
     "batch holds only packed inputs"),
    (lambda b, c: SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=None)), "spatial_merge_size is no integer"),
    (lambda b, c: b.pop("mm_token_type_ids") is None or SimpleNamespace(vision_config=c.vision_config, image_token_id=None),
     "pass the processor's mm_token_type_ids"),
])
def test_items_no_row_holds_exactly_are_refused(change, message):
    batch, config = _batch()
    config = change(batch, config) or config  # a stand-in config where a real one refuses the value
    with pytest.raises(ValueError, match=message):
        row_layout(batch, config)


def test_a_vision_tower_alone_takes_one_image_per_row():
    grid = torch.tensor([[1, 2, 2], [1, 4, 2]])
    batch = {"hidden_states": torch.randn(12, 8), "grid_thw": grid}
    layout = row_layout(batch, None)
    assert layout.rows == 2 and layout.bounds == {"hidden_states": (0, 4, 12)}
    assert torch.equal(layout.take(batch, 1, 2)["hidden_states"], batch["hidden_states"][4:])


@pytest.mark.core  # the one check that a packed batch is cut with its images, padding included (issue 62)
def test_packed_images_under_data_parallelism_equal_the_plain_model(worlds):
    verdict = worlds.run(2, packed_cases.packed_step, dp=2, rows=3)[0]
    assert verdict["verdict"] == "equal", verdict


@pytest.mark.parametrize("mesh", [dict(dp=2), dict(dp=1, microbatches=2)])
def test_packed_images_split_into_ranks_and_microbatches(worlds, mesh):
    verdict = worlds.run(mesh["dp"], packed_cases.packed_step, **mesh)[0]
    assert verdict["verdict"] == "equal", verdict


@pytest.mark.parametrize("mesh", [dict(dp=2, dp_shard=2), dict(dp=2, dp_shard=2, microbatches=2, first_half=True)])
def test_packed_images_under_sharded_data_parallelism_equal_the_plain_model(worlds, mesh):
    # the ranks run the vision tower a different number of times (rank 0 once for images, rank 1 once for images
    # and once for videos; with first_half rank 1 never): the tower sits in FSDP's root group with zero gradients
    verdict = worlds.run(2, packed_cases.packed_step, **mesh)[0]
    assert verdict["verdict"] == "equal", verdict


def test_the_vision_tower_is_left_to_the_root_group():
    model = Qwen2VLForConditionalGeneration(Qwen2VLConfig(**packed_cases.packed_config(
        "qwen2_vl", "Qwen2VLForConditionalGeneration")))
    assert item_towers(model) == [model.model.visual]
    blocks = repeated_blocks(model)
    assert blocks and all(b in set(model.model.language_model.layers) for b in blocks)


def test_values_per_item_go_with_their_items_and_rows_reorder_with_theirs():
    # Qwen2.5-VL's processor gives each video its seconds per grid step: one value per video, not per row
    batch, config = _batch()
    batch["second_per_grid_ts"] = torch.tensor([0.5])
    first, second = (dp_rows(batch, dp=2, dp_rank=r, multiple=1, config=config) for r in (0, 1))
    assert "second_per_grid_ts" not in first and torch.equal(second["second_per_grid_ts"], batch["second_per_grid_ts"])
    batch["second_per_grid_ts"] = torch.tensor([0.5, 1.0])  # more than the videos
    with pytest.raises(ValueError, match="'second_per_grid_ts'.* has 2 rows, 'video_grid_thw' 1: one value per item"):
        row_layout(batch, config)
    del batch["second_per_grid_ts"]
    layout = row_layout(batch, config)
    back = layout.reordered(batch, [3, 2, 1, 0])  # the check's reversed rows (check/run.py)
    assert torch.equal(back["image_grid_thw"], batch["image_grid_thw"][[3, 1, 2, 0]])  # row 1's two in their order
    assert torch.equal(back["pixel_values"][:16], batch["pixel_values"][32:])
    assert torch.equal(back["pixel_values"][16:32], batch["pixel_values"][16:32])  # row 1's two images, in order


def test_accumulation_batches_with_and_without_images_merge_with_their_rows():
    """The Trainer merges a step's accumulation batches (hf_trainer/data.py): a batch of text alone carries no
    images, and the merged batch's images are the other's, its rows' tokens placing them; sequences of other
    lengths pad mm_token_type_ids with 0 (text)."""
    from qn_hf.integrations.hf_trainer.data import merge_batches

    batch, config = _batch()
    layout = row_layout(batch, config)
    images = {k: v for k, v in layout.take(batch, 0, 2).items() if k != "labels"}
    text = {k: v[2:4, :20] for k, v in batch.items() if k in ("input_ids", "attention_mask", "mm_token_type_ids")}
    text["mm_token_type_ids"] = torch.zeros_like(text["mm_token_type_ids"])
    merged = merge_batches([text, images])
    assert merged["input_ids"].shape == (4, 24) and (merged["mm_token_type_ids"][:2, 20:] == 0).all()
    assert torch.equal(merged["pixel_values"], images["pixel_values"])
    assert row_layout(merged, config).bounds["image_grid_thw"] == (0, 0, 0, 1, 3)
    with pytest.raises(ValueError, match="accumulation batches have different keys"):
        merge_batches([{k: v for k, v in text.items() if k != "attention_mask"}, images])
