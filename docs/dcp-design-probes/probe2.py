import pickle, pickletools, io, glob, os, sys, torch
d=sys.argv[1]
data=open(os.path.join(d,".metadata"),"rb").read()
globs=set()
ops=list(pickletools.genops(data))
strs=[]
for i,(op,arg,pos) in enumerate(ops):
    if op.name in ("GLOBAL",): globs.add(arg)
    if op.name=="STACK_GLOBAL":
        globs.add((strs[-2],strs[-1]))
    if op.name in ("SHORT_BINUNICODE","BINUNICODE","UNICODE"): strs.append(arg)
print(sorted(map(str,globs)))
print("metadata bytes", len(data))
# BYTE_IO with weights_only
from torch.distributed.checkpoint import FileSystemReader
md=FileSystemReader(d).read_metadata()
f=open(os.path.join(d,"__0_0.distcp"),"rb").read()
for idx,si in md.storage_data.items():
    if idx.fqn.startswith("optim.param_groups"):
        v=torch.load(io.BytesIO(f[si.offset:si.offset+si.length]),weights_only=True)
        print(idx.fqn, repr(v)[:80])
    elif idx.fqn.endswith("wte.weight.step") or idx.fqn=="model.transformer.wpe.weight":
        b=f[si.offset:si.offset+si.length]
        print(idx, si, b[:4], torch.load(io.BytesIO(b),weights_only=True).shape)
