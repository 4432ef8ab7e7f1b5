"""Vision-language models given packed images (step/packed.py): Qwen2-VL's batch as its processor lays it out,
every image's patches back to back in ``pixel_values`` beside ``image_grid_thw``, a video's in
``pixel_values_videos`` beside ``video_grid_thw``, rows holding different numbers of them."""

from __future__ import annotations

import torch

from qn_hf.check.run import one_step_parity, parity_config
from tests.any_model_cases import tiny_config
from tests.cases import mesh_for

# each row's images (t, h, w in patches) and videos: rows with none, one and two, of different sizes
IMAGES = [[(1, 4, 4)], [(1, 2, 4), (1, 4, 2)], [], [(1, 4, 4)]]
VIDEOS = [[], [], [(2, 2, 2)], []]
# the first half's rows hold images, the second's none: under dp=2 one rank never runs the vision tower
FIRST_HALF = ([[(1, 4, 4)], [(1, 2, 4)], [], []], [[], [], [], []])
_MARKS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def packed_config(model_type: str, cls: str) -> dict:
    """The shrunk config with its vision tokens inside the shrunk vocabulary (its last ids)."""
    config = tiny_config(model_type, cls=cls)
    vocab = config.get("text_config", config).get("vocab_size") or config["vocab_size"]
    for offset, name in enumerate(_MARKS, start=1):
        for part in (config, config.get("text_config") or {}):
            if name in part:
                part[name] = vocab - offset
    return config


def packed_batch(config: dict, *, seed: int, rows: int = 4, sequence: int = 24, types: bool = True,
                 items: tuple[list, list] = (IMAGES, VIDEOS)) -> dict:
    """``rows`` rows (``items``' images and videos in turn, IMAGES' and VIDEOS' by default), text tokens random,
    each item's tokens between its start and end marks; ``types``: with the processor's mm_token_type_ids (else
    the model reads input_ids)."""
    vocab = config.get("text_config", config).get("vocab_size") or config["vocab_size"]
    image, video, start, end = (config[name] for name in _MARKS)
    vision = config["vision_config"]
    merge, patch, frames = vision["spatial_merge_size"], vision["patch_size"], vision["temporal_patch_size"]
    width = vision.get("in_channels", vision.get("in_chans", 3)) * frames * patch * patch
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab - len(_MARKS), (rows, sequence), generator=generator)
    kinds = torch.zeros_like(ids)
    grids = {1: [], 2: []}
    for row in range(rows):
        at = 1
        for kind, token, held in ((1, image, items[0][row % len(items[0])]), (2, video, items[1][row % len(items[1])])):
            for grid in held:
                n = grid[0] * grid[1] * grid[2] // merge**2
                ids[row, at], ids[row, at + 1:at + 1 + n], ids[row, at + 1 + n] = start, token, end
                kinds[row, at + 1:at + 1 + n] = kind
                grids[kind].append(grid)
                at += n + 3
    labels = ids.masked_fill(kinds != 0, -100)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    if types:
        batch["mm_token_type_ids"] = kinds
    for kind, (grid_key, values_key) in {1: ("image_grid_thw", "pixel_values"),
                                         2: ("video_grid_thw", "pixel_values_videos")}.items():
        if grids[kind]:
            grid = torch.tensor(grids[kind])
            batch[grid_key] = grid
            batch[values_key] = torch.randn(int(grid.prod(-1).sum()), width, generator=generator)
    return batch


def packed_step(*, model_type: str = "qwen2_vl", cls: str = "Qwen2VLForConditionalGeneration", dp: int = 1,
                tp: int = 1, pp: int = 1, dp_shard: int = 1, microbatches: int | None = None, rows: int = 4,
                types: bool = True, first_half: bool = False) -> dict:
    """Two SGD steps on packed image batches at the mesh against the plain model; ``first_half``: only the first
    half of the rows hold images (FIRST_HALF)."""
    config = packed_config(model_type, cls)
    items = FIRST_HALF if first_half else (IMAGES, VIDEOS)
    batches = [packed_batch(config, seed=step, rows=rows, types=types, items=items) for step in range(2)]
    parallel = parity_config(dp=dp, tp=tp, pp=pp, dp_shard=dp_shard, microbatches=microbatches)
    verdict = one_step_parity(config=config, parallel=parallel, mesh=mesh_for(dp, tp, pp), model_class_name=cls,
                              steps=2, batches=batches)
    return {k: verdict[k] for k in ("verdict", "reason", "moved")} | {"worst": verdict["worst"][:3]}
