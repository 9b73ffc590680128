exec(open("tests/parity/_dbg.py").read().replace("os.path.dirname(__file__)", "\"tests/parity\"").split("for ci in map")[0])
logits, params, window = cases[4]
p = dict(params); 
for k,v in NEUTRAL:
    if k=="logit_bias": p.pop(k,None)
    else: p[k]=v
ids, probs = par.llama_survivors(logits, p, window)
mi, mp, ch = ours(logits, p, window)
print(ch, len(ids), len(mi))
j=np.argmax(np.abs(mp-probs)/probs); print(j, mp[j], probs[j], logits[j])
e = np.abs(mp-probs) - (1e-9 + 1e-5*np.abs(probs)); j=np.argmax(e); print(j, mp[j], probs[j], logits[j], e[j], logits.max(), mp.sum(), probs.sum())
