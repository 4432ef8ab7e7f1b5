"""Writing a safetensors file a piece at a time, so peak memory is one piece, not the file.

``safetensors.torch.save_file`` needs every tensor in memory at once. The format itself does not:
an 8-byte little-endian header length, a JSON header giving each tensor's dtype, shape and byte
range, then the bytes in that order. Knowing shapes and dtypes up front (from an index), the header
is written first and each tensor's bytes are produced, written and dropped in turn, in as many
consecutive chunks as its producer likes.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable, Sequence

import torch

from .atomic import TMP, create_new
from .format import safetensors_code


def write_streaming(path: str, tensors: Sequence[tuple[str, list[int], torch.dtype]],
                    produce: Callable[[str], Iterable[torch.Tensor]], *,
                    metadata: dict[str, str] | None = None) -> None:
    """Write ``path`` atomically; ``produce(name)`` is called once per tensor, in order, and gives
    its values as chunks whose bytes, one after the other, are the tensor's (row-major)."""
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, shape, dtype in tensors:
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        header[name] = {"dtype": safetensors_code(dtype), "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    tmp = path + TMP
    f = create_new(tmp)
    try:
        with f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for name, shape, dtype in tensors:
                announced, written = torch.Size(shape).numel(), 0
                for t in produce(name):
                    if t.dtype != dtype:
                        raise ValueError(f"{name}: produced {t.dtype}, announced {dtype}")
                    written += t.numel()
                    f.write(memoryview(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()))  # no copy
                    del t
                if written != announced:
                    raise ValueError(f"{name}: produced {written} elements, announced {tuple(shape)}")
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        os.unlink(tmp)  # a failed write leaves no partial file behind (it may be as large as the model)
        raise
    os.replace(tmp, path)
