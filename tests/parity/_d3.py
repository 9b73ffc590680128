import numpy as np, sys
sys.argv=["x"]
import importlib.util
spec = importlib.util.spec_from_file_location("par", "tests/parity/test_sampler_parity.py")
par = importlib.util.module_from_spec(spec); spec.loader.exec_module(par)
L=np.array([2.0,2.0,2.0],dtype=np.float32)
for n,rp,f,pr in [(0,1.5,1.0,0.0),(0,1.0,0.0,0.3),(1,1.0,0.0,0.3),(64,1.0,1.0,0.0),(64,0.8,0,0),(-1,2.0,0,0)]:
    for w in ([0,0,1],[0,0,1,2,2,2]):
        ids,pr_=par.llama_survivors(L,{"temperature":1.0,"top_k":0,"top_p":1.0,"repeat_last_n":n,"repeat_penalty":rp,"frequency_penalty":f,"presence_penalty":pr},w)
        print(n,rp,f,pr,w, np.log(pr_/pr_.max()))
