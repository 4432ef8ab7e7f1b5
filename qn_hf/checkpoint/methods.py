"""The checkpoint side of a ``ParallelModel``: its state dict, Hugging Face directories, and checkpoints in
qn_hf's format or torch.distributed.checkpoint's, saved from and loaded into any mesh.

A mixin of ``ParallelModel``, which hands these what they read as one value, its ``checkpoint_view``
(``view.py``): nothing else of the model is read here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .adapter import save_adapter
from .dcp.names import KeyMap
from .errors import CheckpointFormat, checkpoint_format
from .export import save_pretrained
from .full_state import full_state_dict
from .hf import DEFAULT_MAX_SHARD_BYTES
from .load import load_checkpoint
from .save import DEFAULT_KEEP_LAST, save_checkpoint
from .view import CheckpointView


class CheckpointMethods:
    """``ParallelModel``'s state dict, ``save_pretrained``, and its checkpoints."""

    checkpoint_view: CheckpointView

    def state_dict(self, *, max_bytes: int | None = None) -> dict[str, torch.Tensor]:
        """The unsharded model's state dict (HF names, whole CPU tensors) on every rank; collective.
        Refused above ``max_bytes`` (default: half the free host memory per rank): see full_state.py."""
        v = self.checkpoint_view
        v.ready()
        with v.failures.guard("state_dict"):
            return full_state_dict(v.module, placement=v.placement, max_bytes=max_bytes)

    def save_pretrained(self, path: str, *, max_shard_size: int = DEFAULT_MAX_SHARD_BYTES) -> None:
        """Write a consolidated Hugging Face directory that ``from_pretrained`` loads unchanged
        (streamed tensor by tensor; files of at most ``max_shard_size`` bytes); for a PEFT model, the
        adapter directory that ``PeftModel.from_pretrained(base, path)`` loads."""
        v = self.checkpoint_view
        v.ready()
        with v.failures.guard("save_pretrained"):
            if v.adapter is not None:
                save_adapter(v.module, path, placement=v.placement, adapter=v.adapter)
                return
            save_pretrained(v.module, path, placement=v.placement, config=v.config, max_shard_bytes=max_shard_size)

    def save_checkpoint(self, path: str, optimizer: torch.optim.Optimizer | None = None, step: int | None = None,
                        *, keep_last: int | None = DEFAULT_KEEP_LAST, asynchronous: bool = False,
                        format: CheckpointFormat | str = CheckpointFormat.QN) -> str:
        """Sharded checkpoint ``path/ckpt-<step>`` (optimizer state, fp16's loss scale) made ``latest``, loading at any
        mesh; keeps the newest ``keep_last`` (None: all). Holds ``path`` while the model lives: other jobs refused.
        ``asynchronous``: return at once, written and published in the background (``wait_checkpoint``).
        ``format="dcp"``: a ``torch.distributed.checkpoint`` directory as torch's FSDP2 recipe saves and loads it."""
        kind = checkpoint_format(format)  # refused on every rank before anything is written
        v = self.checkpoint_view
        v.ready()
        self.wait_checkpoint()  # one save in flight at a time: the next copy reuses its host buffers
        with v.failures.guard("save_checkpoint"):
            return save_checkpoint(v.module, path, placement=v.placement, config=v.config, optimizer=optimizer,
                                   step=step, virtual_stages=v.virtual_stages, keep_last=keep_last, scaler=v.scaler,
                                   roots=v.held_roots, background=v.saves if asynchronous else None, format=kind)

    def wait_checkpoint(self, *, release: bool = False) -> str | None:
        """Wait for the save in flight (every rank); its published directory (None: none), or any rank's error.
        ``release``: also free the host memory asynchronous saves keep for the next one (``close`` does too)."""
        return self.checkpoint_view.saves.wait(release=release)

    def load_checkpoint(self, path: str, optimizer: torch.optim.Optimizer | None = None, *,
                        key_map: KeyMap | Callable[[str], str | None] | None = None) -> dict:
        """Load a checkpoint saved at any mesh (fp16's loss scale included); return its metadata (``{"step": 1}``).
        A ``torch.distributed.checkpoint`` directory (torch's recipe, accelerate's, qn_hf's ``format="dcp"``)
        loads too; ``key_map`` renames its keys (a function, or a ``KeyMap`` such as ``torchtitan_llama(config)``)."""
        v = self.checkpoint_view
        v.ready()
        self.wait_checkpoint()
        with v.failures.guard("load_checkpoint"):
            return load_checkpoint(v.module, path, placement=v.placement, model_type=v.config.model_type,
                                   optimizer=optimizer, cast=v.cast, config=v.config.to_dict(), scaler=v.scaler,
                                   key_map=key_map)
