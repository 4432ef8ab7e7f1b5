"""Image-classification data through ``datasets``: an image folder or parquet files, or (offline
default) scikit-learn's bundled 8x8 handwritten digits.

Images become ``pixel_values`` of the model's (channels, size, size), scaled to [-1, 1]; labels
become ``labels``. Without a validation split on disk, ``val_fraction`` of the examples are held
out, stratified by class with the run's seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from datasets import ClassLabel, Dataset, DatasetDict, load_dataset

from .data_files import builder_for, resolve_files
from .errors import UsageError

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".parquet")
DIGITS_SIZE, DIGITS_CHANNELS = 8, 1


@dataclass(frozen=True)
class ImageData:
    train: Dataset  # rows give pixel_values (C, H, W) float and labels int
    val: Dataset
    labels: list[str]
    source: str


def check_image_data(data: tuple[str, ...]) -> None:
    resolve_files(data, extensions=IMAGE_EXTENSIONS)


def load_image_data(*, data: tuple[str, ...], image_column: str, label_column: str, image_size: int,
                    num_channels: int, val_fraction: float, seed: int) -> ImageData:
    if not data:
        return _digits(image_size=image_size, num_channels=num_channels, val_fraction=val_fraction, seed=seed)
    files = resolve_files(data, extensions=IMAGE_EXTENSIONS)
    if any(f.endswith(".parquet") for f in files):
        builder_for(files)  # all parquet, not parquet mixed with images
        loaded = load_dataset("parquet", data_files=files)
    else:
        loaded = load_dataset("imagefolder", data_files=files)
    for column in (image_column, label_column):
        if column not in loaded["train"].column_names:
            raise UsageError(f"the image data has no column {column!r} (has {loaded['train'].column_names}); "
                             "pass --image-column/--label-column")
    train, val = _splits(loaded, label_column=label_column, val_fraction=val_fraction, seed=seed)
    feature = train.features[label_column]
    labels = list(feature.names) if isinstance(feature, ClassLabel) else [str(v) for v in sorted(set(train[label_column]))]

    def transform(rows: dict[str, list]) -> dict[str, torch.Tensor]:
        mode = "L" if num_channels == 1 else "RGB"
        arrays = [np.asarray(img.convert(mode).resize((image_size, image_size)), dtype=np.float32) for img in rows[image_column]]
        pixels = torch.from_numpy(np.stack(arrays)).reshape(len(arrays), image_size, image_size, num_channels)
        return {"pixel_values": pixels.permute(0, 3, 1, 2) / 127.5 - 1.0,
                "labels": torch.tensor(rows[label_column], dtype=torch.long)}

    return ImageData(train=train.with_transform(transform), val=val.with_transform(transform), labels=labels,
                     source=f"{len(files)} file(s) under {data[0]}")


def _splits(loaded: DatasetDict, *, label_column: str, val_fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    for name in ("validation", "test"):
        if name in loaded:
            return loaded["train"], loaded[name]
    train = loaded["train"]
    stratify = label_column if isinstance(train.features[label_column], ClassLabel) else None
    parts = train.train_test_split(test_size=val_fraction, seed=seed, stratify_by_column=stratify)
    return parts["train"], parts["test"]


def _digits(*, image_size: int, num_channels: int, val_fraction: float, seed: int) -> ImageData:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    pixels = torch.tensor(digits.images, dtype=torch.float32) / 8.0 - 1.0  # values 0..16 -> [-1, 1]
    pixels = pixels[:, None].expand(-1, num_channels, -1, -1)
    if image_size != DIGITS_SIZE:
        pixels = torch.nn.functional.interpolate(pixels, size=(image_size, image_size), mode="bilinear", align_corners=False)
    labels = torch.tensor(digits.target, dtype=torch.long)
    train_idx, val_idx = train_test_split(np.arange(len(labels)), test_size=val_fraction, random_state=seed,
                                          stratify=digits.target)

    def part(idx: np.ndarray) -> Dataset:
        return Dataset.from_dict({"pixel_values": pixels[idx].numpy(), "labels": labels[idx].numpy()}).with_format("torch")

    return ImageData(train=part(train_idx), val=part(val_idx), labels=[str(i) for i in range(10)],
                     source=f"scikit-learn digits ({len(train_idx)} train / {len(val_idx)} validation, 8x8)")
