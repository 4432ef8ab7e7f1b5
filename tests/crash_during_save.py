"""Run as a script: save checkpoint step 1, then die by SIGKILL inside the save of step 2.

    python tests/crash_during_save.py MODEL_DIR CKPT_DIR {before,shard,index,latest}

before: as save_checkpoint starts; shard: inside the first shard file (left torn); index: inside the
index; latest: inside the pointer. (Saving removes no other checkpoint; a kill while older ones are
pruned is tests/test_checkpoint_safety.py's.)
"""

import os
import signal
import sys

import torch

import qn_hf
import qn_hf.checkpoint.files as files
import qn_hf.checkpoint.save as save
from qn_hf.checkpoint.names import LATEST
from tests.models import load, make_batch


def main() -> None:
    model_dir, ckpt, where = sys.argv[1:4]
    pm = qn_hf.parallelize(load("gpt2", model_dir))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    for step in (1, 2):
        opt.zero_grad()
        pm.train_step(make_batch("gpt2", size=2, seed=step))
        opt.step()
        if step == 2:
            real_save, real_json = save.save_file, files.write_json

            def dying_save(tensors, filename, metadata=None):
                real_save(tensors, filename, metadata=metadata)
                with open(filename, "r+b") as f:  # leave a torn file behind, then die
                    f.truncate(os.path.getsize(filename) // 2)
                os.kill(os.getpid(), signal.SIGKILL)

            real_index = save.write_index

            def dying_json(obj, target):  # the pointer ``latest``
                if target.endswith(LATEST):
                    with open(target + ".tmp", "w") as f:
                        f.write('"ckpt-0000')
                    os.kill(os.getpid(), signal.SIGKILL)
                real_json(obj, target)

            def dying_index(index, target):  # the index, written sealed
                with open(target + ".tmp", "w") as f:
                    f.write('{"torn": ')
                os.kill(os.getpid(), signal.SIGKILL)
                real_index(index, target)

            if where == "before":
                os.kill(os.getpid(), signal.SIGKILL)
            elif where == "shard":
                save.save_file = dying_save
            elif where == "index":
                save.write_index = dying_index
            else:
                files.write_json = dying_json  # publish()
        pm.save_checkpoint(ckpt, optimizer=opt, step=step)
        if step == 1:
            pm.save_pretrained(ckpt + "-step1-hf")


if __name__ == "__main__":
    main()
