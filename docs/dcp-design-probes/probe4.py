import os, io, time, tempfile, dataclasses, warnings
warnings.filterwarnings("ignore")
t0=time.time()
import torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType, TensorWriteData
from torch.distributed.checkpoint.metadata import MetadataIndex, ChunkStorageMetadata, TensorProperties
from torch.distributed.fsdp import fully_shard
from torch.distributed.device_mesh import init_device_mesh
import transformers
transformers.logging.set_verbosity_error()
d=tempfile.mkdtemp()
dist.init_process_group("gloo", store=dist.FileStore(os.path.join(d,"store"),1), rank=0, world_size=1)
cfg=transformers.GPT2Config(n_layer=2,n_embd=16,n_head=2,vocab_size=37,n_positions=16,bos_token_id=0,eos_token_id=0,resid_pdrop=0.0,embd_pdrop=0.0,attn_pdrop=0.0)
mesh=init_device_mesh("cpu",(1,))
def build(seed):
    torch.manual_seed(seed); m=transformers.GPT2LMHeadModel(cfg)
    for b in m.transformer.h: fully_shard(b,mesh=mesh)
    fully_shard(m,mesh=mesh); return m, torch.optim.AdamW(m.parameters(),lr=1e-3)
m,opt=build(0)
x=torch.randint(0,37,(2,8))
m(input_ids=x,labels=x).loss.backward(); opt.step(); opt.zero_grad()
msd,osd=get_state_dict(m,opt)
full=lambda t: t.full_tensor() if hasattr(t,"full_tensor") else t
# "pieces": every >=1-d tensor cut into two row boxes (as two ranks would hold them)
pieces={}   # flat key -> (global shape, dtype, [(offsets, tensor)])
def add(key,t):
    t=full(t).detach()
    if t.ndim==0: pieces[key]=(t.shape,t.dtype,[((),t)]); return
    h=(t.shape[0]+1)//2
    pieces[key]=(t.shape,t.dtype,[((0,)*t.ndim,t[:h].contiguous()),((h,)+(0,)*(t.ndim-1),t[h:].contiguous())])
for k,v in msd.items(): add("model."+k,v)
for fqn,st in osd["state"].items():
    for s,v in st.items(): add(f"optim.state.{fqn}.{s}",v)
objects={}; mappings={}
for i,g in enumerate(osd["param_groups"]):
    for k,v in g.items(): objects[f"optim.param_groups.{i}.{k}"]=v; mappings[f"optim.param_groups.{i}.{k}"]=("optim","param_groups",i,k)
for k in pieces:
    if k.startswith("model."): mappings[k]=("model",k[6:])
    else:
        fqn,_,s=k[len("optim.state."):].rpartition("."); mappings[k]=("optim","state",fqn,s)
class PiecesPlanner(DefaultSavePlanner):
    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
        self.is_coordinator=is_coordinator; self.mappings=mappings; self.state_dict={}
        self.by_index={}
    def create_local_plan(self):
        items=[]
        for k,(shape,dtype,parts) in pieces.items():
            for off,t in parts:
                idx=MetadataIndex(k,off)
                items.append(WriteItem(index=idx,type=WriteItemType.SHARD,tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(off),sizes=t.shape),
                    properties=TensorProperties(dtype=dtype),size=torch.Size(shape))))
                self.by_index[(k,tuple(off))]=t
        if self.is_coordinator:
            for k in objects: items.append(WriteItem(index=MetadataIndex(k),type=WriteItemType.BYTE_IO))
        self.plan=SavePlan(items,planner_data=self.mappings); return self.plan
    def lookup_object(self, index):
        if index.offset is None: return objects[index.fqn]
        return self.by_index[(index.fqn,tuple(index.offset))]
out=os.path.join(d,"qn_dcp")
dcp.save({},checkpoint_id=out,planner=PiecesPlanner())
md=dcp.FileSystemReader(out).read_metadata()
print("written", sorted(os.listdir(out)), md.state_dict_metadata["model.transformer.wte.weight"].chunks)
# FSDP2 side: fresh model, dcp.load + set_state_dict
m2,opt2=build(1)
msd2,osd2=get_state_dict(m2,opt2)
dcp.load({"model":msd2,"optim":osd2},checkpoint_id=out)
set_state_dict(m2,opt2,model_state_dict=msd2,optim_state_dict=osd2)
ok=all(torch.equal(full(a),full(b)) for a,b in zip(m.state_dict().values(),m2.state_dict().values()))
s1,s2=opt.state_dict(),opt2.state_dict()
okopt=all(torch.equal(full(s1["state"][i][k]),full(s2["state"][i][k])) for i in s1["state"] for k in s1["state"][i])
print("weights equal",ok,"optim equal",okopt, s2["param_groups"][0]["lr"], s2["state"][0]["step"])
# own box reader: byte range + torch.load(weights_only=True), sub-box of a chunk
r=dcp.FileSystemReader(out); md=r.read_metadata()
ch=md.state_dict_metadata["model.transformer.h.0.mlp.c_fc.weight"].chunks[1]
info=md.storage_data[MetadataIndex("model.transformer.h.0.mlp.c_fc.weight",ch.offsets)]
with open(os.path.join(out,info.relative_path),"rb") as f:
    f.seek(info.offset); blob=f.read(info.length)
t=torch.load(io.BytesIO(blob),weights_only=True,map_location="cpu")
print("chunk", tuple(ch.offsets), tuple(ch.sizes), t.shape, torch.equal(t[:, 3:7], full(msd["transformer.h.0.mlp.c_fc.weight"])[ch.offsets[0]:, 3:7]))
# next steps equal
for mm,oo in ((m,opt),(m2,opt2)):
    l=mm(input_ids=x,labels=x).loss; l.backward(); oo.step(); print("next loss",l.item())
print("after step equal", all(torch.equal(full(a),full(b)) for a,b in zip(m.state_dict().values(),m2.state_dict().values())))
dist.destroy_process_group(); print("t",time.time()-t0)
