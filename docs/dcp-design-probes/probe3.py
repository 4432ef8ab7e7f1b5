import pickle, sys, os
seen=set()
class U(pickle.Unpickler):
    def find_class(self, module, name):
        seen.add((module,name)); return super().find_class(module,name)
md=U(open(os.path.join(sys.argv[1],".metadata"),"rb")).load()
for s in sorted(seen): print(s)
print(type(md.planner_data), list(md.planner_data.items())[-1])
