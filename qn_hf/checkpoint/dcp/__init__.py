"""``torch.distributed.checkpoint`` (DCP) checkpoints in and out: what FSDP2, accelerate and torchtitan save
loads into any qn_hf mesh, and qn_hf saves what they load.

``metadata`` reads torch's ``.metadata`` without running it; ``names`` maps DCP keys to the model's names
(``KeyMap``; ``torchtitan.torchtitan_llama``); ``index`` makes a DCP checkpoint a qn_hf index whose
pieces are byte spans of ``.distcp`` files, so the box reader of ``pieces`` reads it at any mesh;
``directory`` finds DCP directories (torch's, accelerate's, qn_hf's) and qn_hf's sealed ``qn_hf.json``;
``write`` saves each rank's own boxes with ``dcp.save``.
"""

from .names import KeyMap, RowOrder
from .torchtitan import torchtitan_llama

__all__ = ["KeyMap", "RowOrder", "torchtitan_llama"]
