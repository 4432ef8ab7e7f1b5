"""Saving a qn_hf model as a ``torch.distributed.checkpoint`` that torch's FSDP2 loads with ``dcp.load`` +
``set_state_dict``, at any of its meshes.

Each rank writes exactly the pieces it writes into qn_hf's own format (``save.shard_snapshot``: tp boxes,
packed q|k|v parts, ZeRO-1 flat runs, dp_shard rows, expert blocks), each as one DCP chunk of the whole
tensor, under the keys of torch's recipe (``{"model": msd, "optim": osd}`` from ``get_state_dict``):
``model.<name>``, ``optim.state.<name>.<key>``, ``optim.param_groups.<i>.<hyperparameter>``. Nothing is
gathered: DCP's format is boxes of global tensors, and its loader reshards any tiling into any DTensor
layout. ``dcp.save`` does the writing, with a planner that hands it these pieces (``DefaultSavePlanner``'s
documented extension points), so the files and the metadata are torch's own.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed import ProcessGroup
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ..files import file_digest
from ..format import DTYPES, OPTIMIZER, CheckpointError
from ..optimizer_state import NOT_HYPERPARAMETERS, merge_groups
from ..pieces import CHUNK_BYTES
from ..seal import write_index
from .directory import HEADER
from .index import DCP_FORMAT
from .metadata import DATA_SUFFIX, METADATA
from .names import GROUPS, MODEL_PREFIX, STATE

OPTIM = "optim."  # torch's recipe's key for the optimizer's state dict


def dcp_key(name: str) -> tuple[str, tuple]:
    """The DCP key of a qn_hf index name, and its path in the recipe's nested dict."""
    if name.startswith(OPTIMIZER):
        param, _, key = name[len(OPTIMIZER):].rpartition("/")
        return f"{OPTIM}{STATE}{param}.{key}", ("optim", "state", param, key)
    return MODEL_PREFIX + name, ("model", name)


@dataclasses.dataclass(frozen=True)
class Piece:
    """One chunk to write: its extents and dtype, the whole tensor's shape, and how to get its values
    (when DCP's writer asks: a converter reads each from its source then, one at a time)."""

    sizes: list[int]
    dtype: torch.dtype
    shape: list[int]
    values: Callable[[], torch.Tensor]


class _PiecesPlanner(DefaultSavePlanner):
    """A save plan of given chunks instead of a state dict's: ``pieces`` maps (key, offsets) to a
    ``Piece``; ``values`` the byte items (the coordinator's parameter groups)."""

    def __init__(self, pieces: dict[tuple[str, tuple], Piece], values: dict[str, object],
                 paths: dict[str, tuple]) -> None:
        super().__init__(flatten_state_dict=True)  # True: the recipe's nested paths are recorded in .metadata
        self.pieces, self.values, self.paths = pieces, values, paths

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        super().set_up_planner({}, storage_meta, is_coordinator)
        self.mappings = self.paths  # DefaultSavePlanner records them as the metadata's planner_data

    def create_local_plan(self) -> SavePlan:
        items = [WriteItem(index=MetadataIndex(key, torch.Size(offsets)), type=WriteItemType.SHARD,
                           tensor_data=TensorWriteData(
                               chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(p.sizes)),
                               properties=TensorProperties(dtype=p.dtype), size=torch.Size(p.shape)))
                 for (key, offsets), p in self.pieces.items()]
        items += [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO) for key in self.values]
        self.plan = SavePlan(items, planner_data=dict(self.paths))
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> object:
        if index.offset is None:
            return self.values[index.fqn]
        return self.pieces[(index.fqn, tuple(index.offset))].values()


def write_dcp(directory: str, *, tensors: dict[str, torch.Tensor], entries: dict[str, dict], groups: list | None,
              aliases: dict[str, list[str]], header: dict | None, group: ProcessGroup | None) -> None:
    """Every rank: its pieces (``entries``' pieces, values in ``tensors``, as ``shard_snapshot`` gives them)
    into the DCP directory ``directory`` with ``dcp.save`` over ``group`` (None: the world); a weight is
    also written under each of its tied ``aliases`` (FSDP2's model state dict holds both names). Then rank 0
    (``header`` given) writes ``qn_hf.json``: the header with the merged parameter groups and the files'
    digests. Every rank raises the same ``CheckpointError`` if any rank's write failed."""
    pieces, paths = {}, {}
    for name, entry in entries.items():
        _under_each_name(pieces, paths, [name, *aliases.get(name, [])],
                         [(p["box"], _held(tensors[p["key"]], entry["shape"])) for p in entry["pieces"]])
    everyone = None
    if groups is not None:  # the coordinator names every parameter of every group: each rank knows its own
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, groups, group=group)
    merged = None
    for ranks_groups in everyone or []:
        if ranks_groups is not None:
            merged = merge_groups(merged, [dict(g) for g in ranks_groups])
    values = _group_values(merged, paths) if header is not None else {}
    _save(directory, _PiecesPlanner(pieces, values, paths), group=group, no_dist=False, one_file_per_rank=True)
    if header is not None:
        _record(directory, header, merged)


def write_whole_dcp(directory: str, tensors: list[tuple[str, dict, str]],
                    read: Callable[[dict, str, list[list[int]], torch.Tensor], None], *, groups: list | None,
                    aliases: dict[str, list[str]], header: dict) -> None:
    """One process (a converter): each of ``tensors`` (qn_hf name, its source entry, its source name) whole,
    cut into blocks of rows of at most ``CHUNK_BYTES``, each read with ``read(entry, source, box, out)`` when
    DCP's writer comes to it (one file per chunk, so the writer holds one at a time), and ``qn_hf.json``."""
    pieces, paths = {}, {}
    for name, entry, source in tensors:
        shape, dtype = entry["shape"], DTYPES[entry["dtype"]]
        row = math.prod(shape[1:]) * dtype.itemsize
        step = max(1, CHUNK_BYTES // max(row, 1)) if shape else 1
        blocks = [[[lo, min(lo + step, shape[0])], *([0, n] for n in shape[1:])]
                  for lo in range(0, shape[0], step)] if shape and shape[0] else [[[0, n] for n in shape]]
        chunks = []
        for box in blocks:
            def values(entry=entry, source=source, box=box, dtype=dtype) -> torch.Tensor:
                out = torch.empty([b - a for a, b in box], dtype=dtype)
                read(entry, source, box, out)
                return out
            chunks.append((box, Piece([b - a for a, b in box], dtype, shape, values)))
        _under_each_name(pieces, paths, [name, *aliases.get(name, [])], chunks)
    _save(directory, _PiecesPlanner(pieces, _group_values(groups, paths), paths), group=None, no_dist=True,
          one_file_per_rank=False)
    _record(directory, header, groups)


def _held(tensor: torch.Tensor, shape: list[int]) -> Piece:
    """A chunk already in memory (a rank's snapshot)."""
    return Piece(list(tensor.shape), tensor.dtype, shape, lambda: tensor)


def _under_each_name(pieces: dict, paths: dict, names: list[str], chunks: list[tuple[list[list[int]], Piece]]) -> None:
    """Each chunk of a tensor, by its box, under each of its names (a tied weight's aliases too)."""
    for name in names:
        key, path = dcp_key(name)
        paths[key] = path
        for box, piece in chunks:
            pieces[(key, tuple(a for a, _ in box))] = piece


def _group_values(groups: list | None, paths: dict[str, tuple]) -> dict[str, object]:
    """The parameter groups as torch's recipe holds them: each hyperparameter, and ``params``."""
    values = {}
    for i, g in enumerate(groups or []):
        for k, v in g.items():
            if k not in NOT_HYPERPARAMETERS or k == "params":
                key = f"{OPTIM}{GROUPS}{i}.{k}"
                values[key], paths[key] = v, ("optim", "param_groups", i, k)
    return values


def _save(directory: str, planner: _PiecesPlanner, *, group: ProcessGroup | None, no_dist: bool,
          one_file_per_rank: bool) -> None:
    try:
        dcp.save({}, storage_writer=dcp.FileSystemWriter(directory, sync_files=True,
                                                         single_file_per_rank=one_file_per_rank),
                 process_group=group, planner=planner, no_dist=no_dist)
    except BaseException as e:  # DCP raises CheckpointException, a BaseException, on every rank
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointError(f"writing {directory} with torch.distributed.checkpoint failed: {str(e)[:1000]}") from None


def _record(directory: str, header: dict, groups: list | None) -> None:
    """``qn_hf.json``: the header with the groups and every file's size and CRC-32, sealed."""
    files = sorted(f for f in os.listdir(directory) if f.endswith(DATA_SUFFIX) or f == METADATA)
    record = {**{k: v for k, v in header.items() if k != "tensors"}, "format": DCP_FORMAT,
              "optimizer": _plain(groups), "files": {f: file_digest(os.path.join(directory, f)) for f in files}}
    write_index(record, os.path.join(directory, HEADER))


def _plain(groups: list | None) -> list | None:
    """The groups as JSON holds them (tuples as lists)."""
    if groups is None:
        return None
    return [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in groups]


def point_root(final: str) -> None:
    """``ROOT/.metadata`` for the checkpoint ``final`` just published under ROOT, or none where ``final`` is not
    a DCP. FSDP2 users hand torch ``dcp.load(state, checkpoint_id=ROOT)`` (torch reads ``ROOT/.metadata``; the
    numbered directory is qn_hf's), which found nothing and raised torch's raw FileNotFoundError: the root's
    copy of ``final``'s metadata names each file under ``ckpt-<step>/``, so the root loads as its newest
    checkpoint. torch's own writer writes it (``finish``: a temporary file renamed), from torch's own reader of
    the metadata this save wrote a moment ago."""
    root, name = os.path.split(final)
    pointer = os.path.join(root, METADATA)
    if not os.path.isfile(os.path.join(final, METADATA)):
        if os.path.isfile(pointer):  # an older DCP's, under a root now publishing qn_hf's format
            os.unlink(pointer)
        return
    metadata = dcp.FileSystemReader(final).read_metadata()
    results = [[WriteResult(index=index, size_in_bytes=info.length,
                            storage_data=dataclasses.replace(info, relative_path=f"{name}/{info.relative_path}"))
                for index, info in metadata.storage_data.items()]]
    dcp.FileSystemWriter(root, sync_files=True).finish(metadata, results)
