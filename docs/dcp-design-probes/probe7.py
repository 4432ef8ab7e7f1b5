import os, time, tempfile, warnings; warnings.filterwarnings("ignore"); t0=time.time()
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType, TensorWriteData
from torch.distributed.checkpoint.metadata import MetadataIndex, ChunkStorageMetadata, TensorProperties
from torch.distributed.fsdp import fully_shard
from torch.distributed.device_mesh import init_device_mesh
import sys; sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else ".")  # the qn_hf checkout
from qn_hf.checkpoint.pieces import flat_runs
d=tempfile.mkdtemp()
dist.init_process_group("gloo", store=dist.FileStore(os.path.join(d,"s"),1), rank=0, world_size=1)
mesh=init_device_mesh("cpu",(1,))
def build(seed):
    torch.manual_seed(seed); m=torch.nn.Sequential(torch.nn.Linear(7,5),torch.nn.Linear(5,3))
    fully_shard(m,mesh=mesh); return m, torch.optim.AdamW(m.parameters(),lr=1e-2)
m,o=build(0); x=torch.randn(4,7); m(x).sum().backward(); o.step(); o.zero_grad()
msd,osd=get_state_dict(m,o); full=lambda t: t.full_tensor() if hasattr(t,"full_tensor") else t
items={}
def add(k,t):
    t=full(t).detach()
    if t.ndim==0: items[(k,())]=t; return
    n=t.numel(); cut=n//3+1  # unaligned ZeRO-like cut: two flat ranges, each as runs of boxes
    for lo,hi in ((0,cut),(cut,n)):
        for box,_ in flat_runs(list(t.shape),lo,hi):
            sl=t[tuple(slice(a,b) for a,b in box)].contiguous(); items[(k,tuple(a for a,_ in box))]=sl
for k,v in msd.items(): add("model."+k,v)
for f,st in osd["state"].items():
    for s,v in st.items(): add(f"optim.state.{f}.{s}",v)
objs={f"optim.param_groups.0.{k}":v for k,v in osd["param_groups"][0].items()}
shapes={**{"model."+k:full(v).shape for k,v in msd.items()},**{f"optim.state.{f}.{s}":full(v).shape for f,st in osd["state"].items() for s,v in st.items()}}
class P(DefaultSavePlanner):
    def set_up_planner(self,state_dict,storage_meta=None,is_coordinator=False): self.is_coordinator=is_coordinator; self.state_dict={}; self.mappings={}
    def create_local_plan(self):
        its=[WriteItem(index=MetadataIndex(k,off),type=WriteItemType.SHARD,tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(off),t.shape),properties=TensorProperties(dtype=t.dtype),size=torch.Size(shapes[k]))) for (k,off),t in items.items()]
        its+=[WriteItem(index=MetadataIndex(k),type=WriteItemType.BYTE_IO) for k in objs]
        self.plan=SavePlan(its,planner_data={}); return self.plan
    def lookup_object(self,i): return objs[i.fqn] if i.offset is None else items[(i.fqn,tuple(i.offset))]
out=os.path.join(d,"c"); dcp.save({},checkpoint_id=out,planner=P())
md=dcp.FileSystemReader(out).read_metadata()
print("chunks of 0.weight", [(tuple(c.offsets),tuple(c.sizes)) for c in md.state_dict_metadata["model.0.weight"].chunks])
m2,o2=build(1); msd2,osd2=get_state_dict(m2,o2)
dcp.load({"model":msd2,"optim":osd2},checkpoint_id=out); set_state_dict(m2,o2,model_state_dict=msd2,optim_state_dict=osd2)
for mm,oo in ((m,o),(m2,o2)): mm(x).sum().backward(); oo.step()
print("equal after next step", all(torch.equal(full(a),full(b)) for a,b in zip(m.state_dict().values(),m2.state_dict().values())), time.time()-t0)
dist.destroy_process_group()
