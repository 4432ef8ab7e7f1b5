import os, time, tempfile, shutil
t0=time.time()
import torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.device_mesh import init_device_mesh
import transformers
d=tempfile.mkdtemp()
dist.init_process_group("gloo", store=dist.FileStore(os.path.join(d,"store"),1), rank=0, world_size=1)
cfg=transformers.GPT2Config(n_layer=2,n_embd=16,n_head=2,vocab_size=37,n_positions=16)
torch.manual_seed(0)
m=transformers.GPT2LMHeadModel(cfg)
mesh=init_device_mesh("cpu",(1,))
for b in m.transformer.h: fully_shard(b,mesh=mesh)
fully_shard(m,mesh=mesh)
opt=torch.optim.AdamW(m.parameters(),lr=1e-3)
x=torch.randint(0,37,(2,8))
m(input_ids=x,labels=x).loss.backward(); opt.step()
msd,osd=get_state_dict(m,opt)
print("model keys", list(msd)[:3], len(msd), "lm_head" in str(list(msd)))
print("msd types", {type(v).__name__ for v in msd.values()})
print("osd state keys", list(osd["state"])[:3], len(osd["state"]))
k0=list(osd["state"])[0]
print({k:(type(v).__name__, getattr(v,'shape',None), getattr(v,'dtype',None), getattr(v,'device',None)) for k,v in osd["state"][k0].items()})
print("pg", {k:v for k,v in osd["param_groups"][0].items() if k!="params"}, osd["param_groups"][0]["params"][:3])
out=os.path.join(d,"ckpt")
dcp.save({"model":msd,"optim":osd},checkpoint_id=out)
print(sorted(os.listdir(out)), out)
md=dcp.FileSystemReader(out).read_metadata()
for k,v in list(md.state_dict_metadata.items()):
    if "h.1" in k or "h.0.attn.c_attn" in k: continue
    print(k, type(v).__name__, getattr(v,"size",None), [ (tuple(c.offsets),tuple(c.sizes)) for c in getattr(v,"chunks",[])][:2], getattr(getattr(v,"properties",None),"dtype",None))
print("planner_data sample", list(md.planner_data.items())[:3] if md.planner_data else None)
print("storage_data sample", list(md.storage_data.items())[:2])
print("version", md.version, md.storage_meta)
dist.destroy_process_group()
print("t", time.time()-t0)
