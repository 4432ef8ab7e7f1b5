"""Saving a sharded checkpoint from every rank of the mesh.

Each distinct shard is written once, by the rank the placement names (``ShardPlacement.writes``): dp
rank 0, the first of KV-head replicas, tp rank 0 for a tensor replicated over tp, the first of the
ranks holding the same experts for an ep-sharded experts block, each rank its ZeRO-1 pieces, the
first dp_shard group its rows; the first stage for a weight tied across stages. Every writing
rank writes its own safetensors file and a small JSON of its entries; rank 0 merges those into the
index. The directory is written as ``ckpt-N.partial`` and published only when whole.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed import ProcessGroup

from ..arguments import check_non_negative_int, check_positive_int
from ..comm import barrier
from ..data_parallel.optimizer import OptimizerView
from ..data_parallel.precision import LossScaler
from ..placement import ShardPlacement
from ..version import __version__
from .atomic import fresh_dir, give_plain_mode
from .background import BackgroundSaves, agree
from .dcp.directory import persistent_buffers, tied_aliases, whole_model
from .dcp.write import point_root, write_dcp
from .entries import local_entries, pieces_of
from .errors import CheckpointFormat
from .files import PARTIAL, file_digest, fsync_file, prune, publish, write_json
from .format import INDEX, CheckpointError, dtype_name, global_shape, new_index, shard_file
from .hf import generation_config_of, recorded_config
from .lock import DirectoryInUse, HeldDirectories
from .names import next_checkpoint_dir
from .optimizer_state import merge_groups, optimizer_groups, optimizer_view
from .seal import write_index


def save_checkpoint(module: nn.Module, path: str, *, placement: ShardPlacement, config,
                    optimizer: torch.optim.Optimizer | None = None, step: int | None = None,
                    virtual_stages: int = 1, keep_last: int | None = None, scaler: LossScaler | None = None,
                    roots: HeldDirectories | None = None, background: BackgroundSaves | None = None,
                    format: CheckpointFormat = CheckpointFormat.QN) -> str:
    """Write a checkpoint of ``module``'s shard on every rank (and ``optimizer``'s state, and float16's
    loss ``scaler``) under ``path``; return its directory. ``config`` is the whole model's config;
    ``virtual_stages`` is recorded in the index's mesh (informational: files are per pp rank and loading
    goes by name). Other checkpoints under ``path`` stay, unless ``keep_last`` asks to remove all but the
    newest ``keep_last`` once this one is published (``prune``). Rank 0 holds ``path`` (``lock.py``) in
    the job's ``roots`` from its first save on, so that another job saving there is refused; without
    ``roots``, for this save only. With ``background`` (no save of it in flight), this rank's shards
    are copied to host memory and written by its thread (``background.py``): the directory returned
    is published when ``background.wait()`` returns. ``format``: qn_hf's own, or a DCP directory."""
    dcp = format is CheckpointFormat.DCP
    aliases = _dcp_aliases(module, config) if dcp else {}
    if step is not None:
        check_non_negative_int("step", step, what="the training step the checkpoint holds")
    if keep_last is not None:
        check_positive_int("keep_last", keep_last, fix="how many of the newest checkpoints to keep")
    own = roots is None
    roots = HeldDirectories() if own else roots
    released_by_writer = False
    try:
        final = os.path.join(path, _choose(path, step=step, placement=placement, roots=roots))
        view = optimizer_view(optimizer) if optimizer is not None else None
        # DCP: dcp.save is a collective, so every rank takes part, with or without pieces to write
        writes = dcp or placement.may_write(pieces=view is not None and bool(view.split_params))
        # What rank 0 indexes besides the shards, taken now: the writer must not read the live model
        header = _header(module, placement, config, step=step, virtual_stages=virtual_stages,
                         scaler=scaler) if dist.get_rank() == 0 else None
        if background is None:
            files = (_dcp_part(shard_snapshot(module, placement, view), aliases, header, group=None) if dcp
                     else (lambda directory: write_shard(module, placement, view, directory)) if writes else None)
            _write(final, files, None if dcp else header, keep_last=keep_last, device=placement.device, group=None)
            return final
        group = background.group()
        # The live pieces, copied to host (host_copies.py): by the writer thread, with the optimizer's next
        # step held until the copy is made; without an optimizer to hold, launched now and every later write
        # to the weights ordered after it (on CUDA a stream wait: the host goes on)
        snapshot = shard_snapshot(module, placement, view, to_host=False) if writes else None
        sources, copies, device = snapshot.tensors if snapshot is not None else {}, background.copies, placement.device
        copies.begin(device)
        copied = None

        def write() -> None:
            try:
                tensors = copied if copied is not None else copies.copy(sources)
                copies.written_from()
                copied_snapshot = dataclasses.replace(snapshot, tensors=tensors) if snapshot is not None else None
                files = (_dcp_part(copied_snapshot, aliases, header, group=group) if dcp
                         else copied_snapshot.write if copied_snapshot is not None else None)
                _write(final, files, None if dcp else header, keep_last=keep_last, device=device, group=group)
            finally:
                if own:
                    roots.release()

        try:
            if view is None:
                copied = copies.copy(sources)
                copies.wait_copied()
            background.hold_step(view.inner if view is not None else None)
            background.start(write, path=final)
        except BaseException:
            background.abandon()  # no writer will release the next step
            raise
        released_by_writer = True
        return final
    finally:
        if own and not released_by_writer:
            roots.release()


def _dcp_part(snapshot: ShardSnapshot, aliases: dict[str, list[str]], header: dict | None, *,
              group: ProcessGroup | None) -> Callable[[str], None]:
    """This rank's part of a DCP save (``dcp.save`` is a collective: a rank without pieces takes part too)."""
    return lambda directory: snapshot.write_dcp(directory, aliases, header, group=group)


def _dcp_aliases(module: nn.Module, config) -> dict[str, list[str]]:
    """The tied names a DCP save writes a weight under as well; a model whose state dict holds persistent
    buffers is refused (qn_hf does not save buffers, and FSDP2's strict load would miss them)."""
    model = whole_model(module, config.to_dict())
    if model is module:  # not a transformers class, so no names of its own to save under
        raise ValueError(f"format='dcp' is written for transformers models, not a {type(module).__name__} (a PEFT "
                         f"model's keys depend on how the loading side wraps it); use format='qn', or save_pretrained")
    buffers = persistent_buffers(model)
    if buffers:
        raise ValueError(f"format='dcp': this model's state dict holds the persistent buffers {buffers[:3]}, which "
                         f"qn_hf does not save, so torch's dcp.load into FSDP2 would refuse it; use format='qn'")
    return tied_aliases(model)


def _header(module: nn.Module, placement: ShardPlacement, config, *, step: int | None, virtual_stages: int,
            scaler: LossScaler | None) -> dict:
    """The index without its shards' entries (rank 0 merges those in once every rank has written)."""
    dims = placement.dims
    mesh = {"dp": dims.dp, "tp": dims.tp, "pp": dims.pp, **({"cp": dims.cp} if dims.cp > 1 else {}),
            **({"ep": dims.ep} if dims.ep > 1 else {}),
            **({"dp_shard": dims.dp_shard} if dims.dp_shard > 1 else {}),
            **({"virtual_stages": virtual_stages} if virtual_stages > 1 else {})}
    return new_index(library_version=__version__, step=step, mesh=mesh, config=recorded_config(config, module),
                     tensors={}, optimizer=None, files={}, generation_config=generation_config_of(module),
                     loss_scaler=scaler.state() if scaler is not None else None)


def _write(final: str, files: Callable[[str], None] | None, header: dict | None, *, keep_last: int | None,
           device: torch.device, group: ProcessGroup | None) -> None:
    """Write ``final`` as ``final.partial`` (this rank's ``files``), then rank 0 indexes it (``header``: the
    index the ranks' entries are merged into; None when ``files`` wrote the record: DCP) and publishes it.

    Synchronous (``group`` None): the ranks meet at world barriers and a rank's error is raised there
    (the model's FailTogether guard stops the others). From the writer threads (``group``: theirs):
    every step's outcome is agreed, so every rank raises the same error and none waits on a failed one.
    """
    partial = final + PARTIAL

    def meet(step: Callable[[], None] | None, what: str) -> None:
        error = None
        try:
            if step is not None:
                step()
        except Exception as e:
            if group is None:
                raise
            error = e
        if group is None:
            barrier(device)
        else:
            agree(error, group=group, what=what)

    rank0 = dist.get_rank() == 0  # the group of writer threads, when given, holds every rank in order
    meet((lambda: fresh_dir(partial)) if rank0 else None, f"preparing {partial}")
    meet((lambda: files(partial)) if files is not None else None, f"writing the shards of {final}")
    meet((lambda: _publish(header, partial, final, keep_last=keep_last)) if rank0 else None, f"publishing {final}")


def _publish(index: dict | None, partial: str, final: str, *, keep_last: int | None) -> None:
    """Rank 0: merge every rank's entries into the index, seal it, rename the directory, repoint ``latest``."""
    if index is not None:
        _index(index, partial)
    publish(partial, final)
    point_root(final)  # torch's dcp.load(checkpoint_id=root) reads the newest DCP checkpoint
    if keep_last is not None:
        prune(os.path.dirname(final), keep_last=keep_last)


def _index(index: dict, partial: str) -> None:
    index = json.loads(json.dumps(index))  # a copy: the header may serve again
    for meta_name in sorted(n for n in os.listdir(partial) if n.endswith(".json")):
        with open(os.path.join(partial, meta_name)) as f:
            meta = json.load(f)
        for name, entry in meta["tensors"].items():  # tp ranks each bring their pieces of a tensor
            into = index["tensors"].setdefault(name, {**entry, "pieces": []})
            into["pieces"] = into["pieces"] + entry["pieces"]
        if meta["optimizer"] is not None:
            index["optimizer"] = merge_groups(index["optimizer"], meta["optimizer"])
        index["files"].update(meta.get("files", {}))
        os.unlink(os.path.join(partial, meta_name))
    write_index(index, os.path.join(partial, INDEX))


ROOT_PURPOSE = "saving checkpoints (pm.save_checkpoint)"
ROOT_FIX = ("Two jobs saving under one root delete each other's checkpoints (keep_last) and point latest at each "
            "other's weights: save this job's checkpoints under another root, or stop the job that holds it first "
            "(its lock goes when its process exits)")


def _choose(path: str, *, step: int | None, placement: ShardPlacement, roots: HeldDirectories) -> str:
    """The new checkpoint's directory name, chosen by rank 0 once it holds ``path``. A refusal (a root
    another job holds, a root that cannot be written) reaches every rank with the name, so all of them
    raise it before any collective that would wait on rank 0."""
    outcome: list = [None]
    error = None
    if dist.get_rank() == 0:
        try:
            os.makedirs(path, exist_ok=True)
            roots.hold(path, purpose=ROOT_PURPOSE, fix=ROOT_FIX)
            outcome[0] = os.path.basename(next_checkpoint_dir(path, step=step))
        except (DirectoryInUse, OSError) as e:
            error = e
            outcome[0] = (isinstance(e, DirectoryInUse), str(e) if isinstance(e, DirectoryInUse) else
                          f"cannot save a checkpoint under {path}: {type(e).__name__}: {e}")
    dist.broadcast_object_list(outcome, src=0, device=placement.device)
    if isinstance(outcome[0], tuple):
        in_use, message = outcome[0]
        if isinstance(error, DirectoryInUse):
            raise error
        raise DirectoryInUse(message, path=path) if in_use else CheckpointError(message)
    return outcome[0]


# Checkpoints a run keeps by default: the newest and two before it, so a save that turns out bad
# (a diverged run) never takes the last good state with it.
DEFAULT_KEEP_LAST = 3

@dataclass(frozen=True)
class ShardSnapshot:
    """This rank's file of a checkpoint, in host memory: its tensors by key, their index entries and
    the optimizer's parameter groups, ready to be written without reading the model again."""

    file: str
    tensors: dict[str, torch.Tensor]
    entries: dict[str, dict]
    groups: list | None

    def write_dcp(self, directory: str, aliases: dict[str, list[str]], header: dict | None, *,
                  group: ProcessGroup | None) -> None:
        """The same pieces as a DCP directory, every rank together (``dcp/write.py``)."""
        write_dcp(directory, tensors=self.tensors, entries=self.entries, groups=self.groups, aliases=aliases,
                  header=header, group=group)

    def write(self, directory: str) -> None:
        """This rank's file and the JSON of its entries (merged into the index by rank 0)."""
        written = {}
        if self.tensors:  # a rank whose every piece another holds (a dp_shard group's replica) writes no empty file
            path = os.path.join(directory, self.file)
            save_file(self.tensors, path, metadata={"format": "pt"})
            give_plain_mode(path)  # safetensors creates it owner-only
            fsync_file(path)
            written = {self.file: file_digest(path)}
        write_json({"tensors": self.entries, "optimizer": self.groups, "files": written},
                   os.path.join(directory, self.file.removesuffix(".safetensors") + ".json"))


def shard_snapshot(module: nn.Module, placement: ShardPlacement, view: OptimizerView | None, *,
                   to_host: bool = True) -> ShardSnapshot:
    """What this rank writes: its pieces on the host (``.to("cpu")``: on CPU the live tensors, so the
    file is written before training goes on), or with ``to_host=False`` the live pieces themselves,
    for an asynchronous save to copy (``host_copies.HostCopies``)."""
    coords = placement.coords
    file = shard_file(coords.pp, coords.tp, placement.replica_rank)
    tensors: dict[str, torch.Tensor] = {}
    entries: dict[str, dict] = {}
    for t in local_entries(module, placement, view):
        if not t.writes:
            continue
        pieces = []
        for i, (box, piece) in enumerate(pieces_of(t, placement.shard_rank(t.spec))):
            key = f"{t.name}#{i}" if t.whole else f"{t.name}#dp{placement.replica_rank}.{i}"
            tensors[key] = piece.to("cpu").contiguous() if to_host else piece
            pieces.append({"file": file, "key": key, "box": box})
        entries[t.name] = {"shape": global_shape(t.shape, t.spec), "dtype": dtype_name(t.values.dtype),
                           "pieces": pieces}
    groups = optimizer_groups(module, placement, view) if view is not None else None
    return ShardSnapshot(file, tensors, entries, groups)


def write_shard(module: nn.Module, placement: ShardPlacement, view: OptimizerView | None, directory: str) -> None:
    """This rank's file and the JSON of its entries, written now (a synchronous save)."""
    shard_snapshot(module, placement, view).write(directory)
