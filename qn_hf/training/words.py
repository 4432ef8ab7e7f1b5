"""Meshes in messages: ``dp=2 tp=1 pp=1 dp_shard=2`` (counts: ``arguments.plural``).

Pure text, no torch: the training scripts and ``qn-hf-check`` print with it before anything is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config.parallel_config import ParallelConfig


def mesh_words(parallel: ParallelConfig) -> str:
    """The dimensions of ``parallel`` as the logs name them: ``dp=2 tp=1 pp=1``, then each other one in
    use (``dp_shard=2 cp=2 sp ep=2``)."""
    d = parallel.dims
    extra = [f"dp_shard={d.dp_shard}"] if d.dp_shard > 1 else []
    extra += [f"cp={d.cp}"] if d.cp > 1 else []
    extra += ["sp"] if parallel.sequence_parallel else []
    extra += [f"ep={d.ep}"] if d.ep > 1 else []
    return " ".join([f"dp={d.dp} tp={d.tp} pp={d.pp}", *extra])
