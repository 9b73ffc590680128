import ctypes, numpy as np, llama_cpp as L
TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")], align=True)
def run(smpls, logits, sorted_=False):
    n=len(logits); data=np.zeros(n,dtype=TOKEN_DATA); data["id"]=np.arange(n); data["logit"]=logits
    arr=L.llama_token_data_array(data.ctypes.data_as(ctypes.POINTER(L.llama_token_data)), n, -1, sorted_)
    for s in smpls: L.llama_sampler_apply(s, ctypes.byref(arr))
    out = np.ctypeslib.as_array(arr.data, shape=(arr.size,)).view(TOKEN_DATA).copy()
    return out
rng=np.random.default_rng(1)
lg=rng.normal(0,3,20).astype(np.float32)
for p in [0.9,0.5,0.2]:
    out=run([L.llama_sampler_init_typical(p,1)], lg)
    # reference
    q=np.exp(lg-lg.max()); q/=q.sum(); H=-(q*np.log(q)).sum(); sc=np.abs(-np.log(q)-H); o=np.argsort(sc,kind="stable"); c=np.cumsum(q[o]); k=np.argmax(c>p)+1
    print(p, sorted(out["id"].tolist()), sorted(o[:k].tolist()))
