import os, tempfile, warnings; warnings.filterwarnings("ignore")
import torch, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageWriter, HuggingFaceStorageReader
d=tempfile.mkdtemp()
try:
    dcp.save({"w":torch.ones(2,3),"lr":0.1}, storage_writer=HuggingFaceStorageWriter(d), no_dist=True)
    print(sorted(os.listdir(d)))
    out={"w":torch.zeros(2,3),"lr":0.0}
    dcp.load(out, storage_reader=HuggingFaceStorageReader(d), no_dist=True); print(out)
except BaseException as e: print("HF storage with a non-tensor:", type(e).__name__, str(e)[:200])
d2=tempfile.mkdtemp()
dcp.save({"w":torch.ones(2,3)}, storage_writer=HuggingFaceStorageWriter(d2), no_dist=True)
print(sorted(os.listdir(d2)))
out={"w":torch.zeros(2,3)}; dcp.load(out, storage_reader=HuggingFaceStorageReader(d2), no_dist=True); print(out["w"].sum())
