"""A ``torch.distributed.checkpoint`` directory's ``.metadata`` read without running anything in it.

Torch's own reader (``FileSystemReader.read_metadata``) calls plain ``pickle.load`` on that file and
``DefaultLoadPlanner.load_bytes`` calls ``torch.load(weights_only=False)`` on every non-tensor value:
both run whatever code a planted file names. Here the metadata is unpickled with an allow-list of the
classes torch itself writes (anything else is refused, naming it), then turned into plain data whose
every field is checked: dtypes, shapes, chunk boxes inside their tensor, file names inside the
directory, byte spans inside their files. Values (tensor chunks and the optimizer's hyperparameters) are
read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import math
import os
import pickle
from dataclasses import dataclass

import torch

from ..format import CheckpointError, dtype_name
from ..json_records import MAX_INDEX_BYTES

METADATA = ".metadata"
DATA_SUFFIX = ".distcp"
_DCP = "torch.distributed.checkpoint"
# Every global torch's DCP writer puts in ``.metadata`` (torch 2.11-2.13): its dataclasses, torch.Size,
# dtypes, layouts, and the path it recorded as the checkpoint id.
_ALLOWED = {
    f"{_DCP}.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                         "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    f"{_DCP}.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "pathlib._local": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


@dataclass(frozen=True)
class Span:
    """``length`` bytes at ``offset`` of ``file`` (relative to the DCP directory): one ``torch.save``d value."""

    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class Chunk:
    box: list[list[int]]  # [start, stop] per dimension of the whole tensor
    span: Span


@dataclass(frozen=True)
class TensorItem:
    dtype: str  # its name (format.DTYPES' when the index reads it)
    shape: list[int]
    chunks: list[Chunk]


@dataclass(frozen=True)
class Contents:
    """What one DCP directory holds: tensors by flattened key, and the byte values (hyperparameters)."""

    directory: str
    tensors: dict[str, TensorItem]
    values: dict[str, Span]


class _AllowListed(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which torch's checkpoint writer never writes "
                                     f"(refused unrun: a .metadata file can run any code it names)")


def is_dcp_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, METADATA))


def read_contents(directory: str) -> Contents:
    """The checked contents of the DCP directory ``directory`` (``CheckpointError`` naming what is wrong)."""
    where = os.path.join(directory, METADATA)
    try:
        size = os.path.getsize(where)
        if size > MAX_INDEX_BYTES:
            raise CheckpointError(f"{where} is {size:,} bytes, more than checkpoint metadata can be")
        with open(where, "rb") as f:
            md = _AllowListed(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"{where} is missing") from None
    except CheckpointError:
        raise
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError, IndexError, KeyError,
            ImportError, MemoryError, RecursionError, OSError) as e:
        raise CheckpointError(f"{where} cannot be read as torch.distributed.checkpoint metadata: "
                              f"{type(e).__name__}: {str(e)[:300]}") from None
    return _contents(directory, where, md)


def _contents(directory: str, where: str, md: object) -> Contents:
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict) \
            or not isinstance(md.storage_data, dict):
        raise CheckpointError(f"{where} is not torch.distributed.checkpoint metadata (it unpickles to "
                              f"{type(md).__name__})")
    sizes: dict[str, int] = {}
    spans = {}
    for index, info in md.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str):
            raise CheckpointError(f"{where}: a storage entry is keyed by {str(index)[:100]!r}, not an item index")
        spans[(index.fqn, None if index.offset is None else tuple(index.offset))] = _span(directory, where, index.fqn,
                                                                                          info, sizes)
    tensors, values = {}, {}
    for key, item in md.state_dict_metadata.items():
        if not isinstance(key, str):
            raise CheckpointError(f"{where}: a key is {key!r}, not a string")
        if isinstance(item, BytesStorageMetadata):
            values[key] = _find(spans, where, key, None)
        elif isinstance(item, TensorStorageMetadata):
            tensors[key] = _tensor(where, key, item, spans)
        else:
            raise CheckpointError(f"{where}: {key} is described by a {type(item).__name__}, which this reader "
                                  f"does not know")
    return Contents(directory=directory, tensors=tensors, values=values)


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _span(directory: str, where: str, key: str, info: object, sizes: dict[str, int]) -> Span:
    file, offset, length = (getattr(info, f, None) for f in ("relative_path", "offset", "length"))
    if not isinstance(file, str) or os.path.basename(file) != file or file in ("", ".", "..") \
            or not file.endswith(DATA_SUFFIX):
        raise CheckpointError(f"{where}: {key} is stored in {str(file)[:100]!r}, not a {DATA_SUFFIX} file of the "
                              f"checkpoint directory")
    if getattr(info, "transform_descriptors", None):
        raise CheckpointError(f"{where}: {key} is stored through the extensions {info.transform_descriptors!r} "
                              f"(compression, ...), which this reader does not apply; save without them")
    if not _count(offset) or not _count(length):
        raise CheckpointError(f"{where}: {key} has the byte span {offset!r}+{length!r}")
    if file not in sizes:
        try:
            sizes[file] = os.path.getsize(os.path.join(directory, file))
        except FileNotFoundError:
            raise CheckpointError(f"{os.path.join(directory, file)} (holding {key}) is missing") from None
    if offset + length > sizes[file]:
        raise CheckpointError(f"{os.path.join(directory, file)} is truncated: {key} is recorded at bytes "
                              f"{offset:,}+{length:,}, the file has {sizes[file]:,}")
    return Span(file, offset, length)


def _find(spans: dict, where: str, key: str, offsets: tuple | None) -> Span:
    span = spans.get((key, offsets))
    if span is None:
        raise CheckpointError(f"{where}: {key}" + (f" chunk at {list(offsets)}" if offsets is not None else "")
                              + " is listed but no file holds it")
    return span


def _tensor(where: str, key: str, item: object, spans: dict) -> TensorItem:
    dtype = getattr(getattr(item, "properties", None), "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"{where}: {key} has dtype {dtype!r}, not a torch dtype")
    # A dtype outside DTYPES (an old torchtitan's complex64 freqs_cis) is refused only if the tensor is read:
    # check_entry of the index names it
    shape = list(item.size) if isinstance(item.size, (torch.Size, tuple, list)) else None
    if shape is None or not all(_count(n) for n in shape):
        raise CheckpointError(f"{where}: {key} has the shape {item.size!r}")
    chunks = []
    for chunk in item.chunks if isinstance(item.chunks, list) else [None]:
        offsets, extents = (getattr(chunk, f, None) for f in ("offsets", "sizes"))
        if not isinstance(offsets, (torch.Size, tuple)) or not isinstance(extents, (torch.Size, tuple)) \
                or len(offsets) != len(shape) or len(extents) != len(shape) \
                or not all(_count(v) for v in (*offsets, *extents)) \
                or any(o + s > n for o, s, n in zip(offsets, extents, shape)):
            raise CheckpointError(f"{where}: {key} has a chunk {str(chunk)[:200]} outside its shape {shape}")
        if math.prod(extents) == 0 and shape:
            continue  # a rank that held no rows (FSDP2 over more ranks than rows)
        span = _find(spans, where, key, tuple(offsets))
        if span.length < math.prod(extents) * dtype.itemsize:  # a reader allocates what the metadata declares
            raise CheckpointError(f"{where}: {key} has a chunk of {list(extents)} {dtype_name(dtype)} stored in "
                                  f"{span.length:,} bytes, fewer than its values need")
        chunks.append(Chunk([[o, o + s] for o, s in zip(offsets, extents)], span))
    return TensorItem(dtype_name(dtype), shape, chunks)


def read_span(directory: str, span: Span) -> bytes:
    path = os.path.join(directory, span.file)
    try:
        with open(path, "rb") as f:
            f.seek(span.offset)
            data = f.read(span.length)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read: {e}") from None
    if len(data) != span.length:
        raise CheckpointError(f"{path} is truncated: {span.length:,} bytes at {span.offset:,} were recorded")
    return data


def load_value(directory: str, span: Span, what: str) -> object:
    """A ``torch.save``d value (a tensor chunk or a hyperparameter) read with ``weights_only=True``:
    plain data and tensors only, never code."""
    try:
        return torch.load(io.BytesIO(read_span(directory, span)), weights_only=True, map_location="cpu")
    except CheckpointError:
        raise
    except pickle.UnpicklingError as e:  # weights_only refused a global: torch's long advice is not for this case
        raise CheckpointError(f"{os.path.join(directory, span.file)}: {what} holds more than plain data and tensors "
                              f"(bytes {span.offset:,}+{span.length:,}; refused unrun): {_why(e)}"
                              ) from None
    except Exception as e:  # noqa: BLE001 - torch.load's errors for damaged or disallowed data vary by release
        raise CheckpointError(f"{os.path.join(directory, span.file)}: {what} cannot be read "
                              f"(bytes {span.offset:,}+{span.length:,}): {type(e).__name__}: {str(e)[:300]}") from None


def _why(error: Exception) -> str:
    """The line of torch's weights-only refusal that names what was refused."""
    lines = str(error).splitlines()
    return next((line.strip() for line in lines if "GLOBAL" in line), lines[0] if lines else "")[:300]
