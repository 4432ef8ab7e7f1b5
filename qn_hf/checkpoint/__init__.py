"""Sharded safetensors checkpoints in Hugging Face key space that load into any mesh, and Hugging Face
directories in and out.

Layout of a checkpoint directory ``path``::

    path/latest                      name of the current checkpoint (replaced atomically)
    path/.qn_hf.lock                 held by the job saving here (``lock``): a second job is refused
    path/ckpt-000020/index.json      every tensor: HF name, global shape, dtype, and its pieces; each
                                     file's size and CRC-32; the loss scale; its own SHA-256 first
    path/ckpt-000020/shard-pp0-tp0.safetensors   what the rank at (pp=0, tp=0) of dp rank 0 holds

One concept per file: ``format`` (names, dtypes, boxes, which rank writes, index validation),
``names`` (``ckpt-<step>`` directories and ``latest``), ``files`` (durable writes, digests,
publishing), ``pieces`` (reading any box of a tensor), ``save`` and ``load`` (from and into a
sharded model), ``hf`` (Hugging Face directories), ``export`` (``save_pretrained`` from the mesh),
``stream`` (safetensors written one tensor at a time), ``convert`` (offline conversions), ``layout``
(where every tensor goes at a mesh, from the config alone), ``full_state`` (``pm.state_dict()``),
``atomic`` (whole-or-nothing files), ``seal`` (the index's own digest), ``tiling`` (pieces that tile a
tensor once), ``optimizer_state`` (parameter groups, and every state tensor of every parameter at
load), ``lock`` (one job per directory: ``hold_directory``, also for a training script's output),
``background`` (asynchronous saves: the copy, then the writing in the background), ``methods`` (the checkpoint
side of ``ParallelModel``) and ``view`` (what it reads of the model, as one value).
"""

from .format import FORMAT, INDEX, VERSION, CheckpointError, checkpoint_dir, read_index
from .lock import DirectoryInUse, hold_directory

__all__ = ["FORMAT", "INDEX", "VERSION", "CheckpointError", "DirectoryInUse", "checkpoint_dir", "hold_directory",
           "read_index"]
