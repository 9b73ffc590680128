import sys, json, subprocess, os, tempfile
sys.argv=[sys.argv[0]]+sys.argv[1:]
import numpy as np
sys.path.insert(0, os.path.dirname(__file__))
import importlib.util
spec = importlib.util.spec_from_file_location("par", os.path.join(os.path.dirname(__file__), "test_sampler_parity.py"))
par = importlib.util.module_from_spec(spec); spec.loader.exec_module(par)
# regenerate cases exactly as main()
n_cases = int(os.environ.get("PARITY_CASES", "300"))
rng = np.random.default_rng(20261130)
vocabs = [2, 3, 10, 100, 1000, 5000, 32000, 49152, 151936]
cases, chunks = [], []
for i in range(n_cases):
    vocab = int(vocabs[i % len(vocabs)]) if i < 3 * len(vocabs) else int(rng.choice(vocabs[:6]))
    logits = (rng.normal(0, 3, vocab)).astype(np.float32)
    if vocab > 4 and rng.random() < 0.2:
        logits[rng.integers(0, vocab, size=2)] = -np.inf
    if rng.random() < 0.1:
        logits[: min(vocab, 5)] = logits[0]
    window = rng.integers(0, max(2, min(vocab, 50)), size=int(rng.integers(0, 100))).tolist()
    if rng.random() < 0.2:
        window.append(vocab + 5)
    params = par.random_params(rng, vocab)
    cases.append((logits, params, window))
NEUTRAL = [("logit_bias", None), ("repeat_last_n", 0), ("top_n_sigma", -1.0), ("top_k", 0), ("typical_p", 1.0), ("top_p", 1.0), ("min_p", 0.0), ("temperature", 1.0)]
def ours(logits, params, window):
    with tempfile.TemporaryDirectory() as tmp:
        p = os.path.join(tmp, "l.f32"); logits.astype("<f4").tofile(p)
        c = {"offset":0, "vocab":len(logits), "params":params, "window":window}
        out = subprocess.run([par.PROBE, par.PLUGIN, p], input=json.dumps(c), capture_output=True, text=True).stdout
    r = json.loads(out)
    if "error" in r: return None, None, r["error"]
    s = r["survivors"]; return np.array([x[0] for x in s]), np.array([x[1] for x in s]), r["chain"]
def cmp(logits, params, window):
    ids, probs = par.llama_survivors(logits, params, window)
    mi, mp, ch = ours(logits, params, window)
    if mi is None: return "ERR "+ch
    if len(mi)!=len(ids) or not np.array_equal(mi, ids):
        return f"surv ours {len(mi)} llama {len(ids)} extra {sorted(set(mi.tolist())-set(ids.tolist()))[:5]} missing {sorted(set(ids.tolist())-set(mi.tolist()))[:5]}"
    if not np.allclose(mp, probs, rtol=1e-5, atol=1e-9): return "prob"
    return None
for ci in map(int, os.environ["CASES"].split(",")):
    logits, params, window = cases[ci]
    print("case", ci, len(logits), {k:v for k,v in params.items() if k!='logit_bias'}, "ties" if len(logits)>1 and logits[0]==logits[1] else "", "ninf" if np.isinf(logits).any() else "")
    # find first stage prefix that fails: neutralise stages from the end
    for upto in range(len(NEUTRAL)+1):
        p = dict(params)
        for k, v in NEUTRAL[upto:]:
            if k == "logit_bias": p.pop(k, None)
            else: p[k] = v
        if upto < len(NEUTRAL) and p.get("temperature") == 0.0: p["temperature"] = 1.0
        r = cmp(logits, p, window)
        if r:
            print("  first failing prefix through", NEUTRAL[upto-1][0] if upto else "-", ":", r); break
    else:
        print("  no prefix fails?")
