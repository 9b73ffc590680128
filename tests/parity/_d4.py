import ctypes, numpy as np, llama_cpp as L
lib=L.llama_cpp._lib
f=lib.llama_sampler_init_penalties
TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")], align=True)
def run(args, types, window, logits):
    f.argtypes=types; f.restype=L.llama_sampler_p_ctypes
    s=f(*args)
    n=len(logits); data=np.zeros(n,dtype=TOKEN_DATA); data["id"]=np.arange(n); data["logit"]=logits
    arr=L.llama_token_data_array(data.ctypes.data_as(ctypes.POINTER(L.llama_token_data)), n, -1, False)
    for t in window: L.llama_sampler_accept(s,t)
    L.llama_sampler_apply(s, ctypes.byref(arr)); L.llama_sampler_free(s)
    return data["logit"]
lg=np.array([2,2,2,2],dtype=np.float32)
w=[0,1,2,2,3]
I,F=ctypes.c_int32,ctypes.c_float
for ln in [0,1,2,3,64]:
    print(ln, "5-arg", run((4,ln,1.0,1.0,0.0),[I,I,F,F,F],w,lg), "4-arg", run((ln,1.0,1.0,0.0),[I,F,F,F],w,lg))
