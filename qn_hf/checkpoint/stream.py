"""Writing a safetensors file one tensor at a time, so peak memory is the largest tensor.

``safetensors.torch.save_file`` needs every tensor in memory at once. The format itself does not:
an 8-byte little-endian header length, a JSON header giving each tensor's dtype, shape and byte
range, then the bytes in that order. Knowing shapes and dtypes up front (from an index), the header
is written first and each tensor's bytes are produced, written and dropped in turn.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Sequence

import torch

from .format import safetensors_code


def write_streaming(path: str, tensors: Sequence[tuple[str, list[int], torch.dtype]],
                    produce: Callable[[str], torch.Tensor], *, metadata: dict[str, str] | None = None) -> None:
    """Write ``path`` atomically; ``produce(name)`` is called once per tensor, in order."""
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, shape, dtype in tensors:
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        header[name] = {"dtype": safetensors_code(dtype), "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape, dtype in tensors:
            t = produce(name)
            if list(t.shape) != list(shape) or t.dtype != dtype:
                raise ValueError(f"{name}: produced {tuple(t.shape)} {t.dtype}, announced {tuple(shape)} {dtype}")
            f.write(memoryview(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()))  # no copy
            del t
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
