import warnings, time; t0=time.time()
import torch, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
import sys
d=sys.argv[1]  # a DCP directory, e.g. the one probe1.py writes
t=torch.empty(37,16)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    dcp.load({"model":{"transformer.wte.weight":t}}, checkpoint_id=d, no_dist=True)
    print("no_dist load ok", t.abs().sum().item()>0, [str(x.message)[:60] for x in w][:2])
    sd=_load_state_dict_from_keys({"optim.param_groups.0.lr","model.transformer.wpe.weight"}, checkpoint_id=d)
    print("from_keys", {k: type(v).__name__ for k,v in sd.items()}, sd.get("optim"))
print(time.time()-t0)
