#!/usr/bin/env python3
"""Architecture parity: tiny random-weight GGUFs of each supported
architecture variant, written here with the `gguf` package, must give our
greedy tokens (`model_probe greedy`, 2 threads) equal to llama.cpp's
(n_threads=2) for every step (at least 24 tokens unless both stop at an
end-of-generation token), with each chosen token's log-probability within
1e-3.

Models (2 layers, 128 wide, Q8_0 matrices and F32 norms, which both sides
use as stored; the tokenizer and chat template are copied from the shipped
SmolLM2 model, so prompts tokenize identically):

* llama3-rope-freqs: `llama` with Llama 3.1-style `rope_freqs.weight`
  factors (computed as llama.cpp's converter does for rope_type "llama3",
  with a small original context so they act within a short prompt) and tied
  embeddings (no `output.weight`). A control run of the same file without
  the factors must differ from llama.cpp's logits, so ignoring them fails.
* llama-linear-rope: `llama` with `rope.scaling.type` linear, factor 4.
* qwen3: no biases, per-head q/k RMSNorm, NEOX RoPE, key_length 64 with 4
  heads (query width 256 != embedding 128, as Qwen3-0.6B), tied embeddings;
  and qwen3-hd128: Qwen3's real head size 128, a separate `output.weight`.
* mistral: `llama` as Mistral GGUFs are: 4:1 grouped-query attention,
  rope base 1e6, key_length 32 with 8 heads (query width 256, as Mistral
  Nemo), a separate `output.weight`, and `attention.sliding_window` (8,
  shorter than every prompt, so applying it would change the tokens), which
  llama.cpp's llama architecture ignores (so do we).
* mistral-spm: `llama` with a SentencePiece vocabulary
  (`tokenizer.ggml.model = "llama"`, as Mistral v0.1–v0.3 and Llama 2
  GGUFs): `<unk> <s> </s>`, the 256 `<0xXX>` byte tokens, `[INST]` and
  `[/INST]` as control tokens, and the shipped model's whole-character
  tokens as `▁`-pieces scored by their merge rank (`spm_vocabulary`), with
  a Mistral-style `[INST]` chat template.

The reference is computed here, on this machine, never stored.
Run: $HOME/.cache/samplerd/venv/bin/python server/model/tests/arch_parity.py [N]
(needs models/SmolLM2-135M-Instruct.Q4_1.gguf and the `gguf` package; exits
0 with a notice if either is absent).
"""
import json
import math
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llamacpp_ref as R  # noqa: E402
import numpy as np  # noqa: E402

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "List three prime numbers and explain why they are prime."}],
    [{"role": "user", "content": "Explain in two sentences how a bicycle stays upright."}],
]
LOGPROB_TOL = 1e-3
MIN_TOKENS = 24
N_EMBD, N_FF, N_LAYER = 128, 256, 2
# Scale of the attention-output and down projections: with tied embeddings
# a larger one keeps random models from repeating one or two tokens.
GAIN = 1.0


def llama3_rope_factors(head_dim, base, factor=8.0, low=1.0, high=4.0, orig_ctx=64):
    """The factors llama.cpp's convert_hf_to_gguf.py (LlamaModel,
    generate_extra_tensors) writes for rope_type "llama3"."""
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / (base ** (i / head_dim))
        wavelen = 2 * math.pi / freq
        if wavelen < orig_ctx / high:
            out.append(1.0)
        elif wavelen > orig_ctx / low:
            out.append(factor)
        else:
            smooth = (orig_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


VARIANTS = {
    "llama3-rope-freqs": dict(arch="llama", n_head=4, n_kv=2, head_dim=None, base=500000.0,
                              tied=True, rope_freqs=True, gain=8.0),
    "llama-linear-rope": dict(arch="llama", n_head=4, n_kv=4, head_dim=None, base=10000.0,
                              tied=False, extra={"rope.scaling.type": "linear", "rope.scaling.factor": 4.0}),
    "qwen3": dict(arch="qwen3", n_head=4, n_kv=2, head_dim=64, base=1000000.0, tied=True,
                  qk_norm=True, eps=1e-6, gain=6.0),
    # Qwen3's real head size (128) with 4 heads: query width 4x the embedding.
    "qwen3-hd128": dict(arch="qwen3", n_head=4, n_kv=2, head_dim=128, base=1000000.0, tied=False,
                        qk_norm=True, eps=1e-6, gain=6.0),
    "mistral": dict(arch="llama", n_head=8, n_kv=2, head_dim=32, base=1000000.0, tied=False,
                    extra={"attention.sliding_window": 8}),
    "mistral-spm": dict(arch="llama", n_head=8, n_kv=2, head_dim=None, base=1000000.0, tied=False,
                        spm=True),
}

MISTRAL_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + '\n\n' }}"
    "{% elif message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)


def bytes_to_unicode():
    """GPT-2's byte-to-character table (the shipped BPE vocabulary's)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, n = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return table


def spm_vocabulary(reader):
    """A SentencePiece-style vocabulary (texts, scores, token types) made
    from the shipped BPE one: every normal token that is whole UTF-8
    characters becomes a piece with spaces as `▁`, scored by minus its id
    (its merge rank), so each piece's parts are pieces too; other bytes go
    through the `<0xXX>` tokens, as in Llama 2's and Mistral's vocabularies."""
    u2b = {c: b for b, c in bytes_to_unicode().items()}
    texts = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["[INST]", "[/INST]"]
    types = [2, 3, 3] + [6] * 256 + [3, 3]
    scores = [0.0] * len(texts)
    seen = set(texts)
    tokens = reader.fields["tokenizer.ggml.tokens"]
    token_types = reader.fields["tokenizer.ggml.token_type"].contents()
    for i, t in enumerate(tokens.contents()):
        if token_types[i] != 1:
            continue
        try:
            piece = bytes(u2b[c] for c in t).decode("utf-8").replace(" ", "\u2581")
        except (KeyError, UnicodeDecodeError):
            continue
        if piece not in seen:
            seen.add(piece)
            texts.append(piece)
            types.append(1)
            scores.append(-float(i))
    return texts, scores, types


def write_spm_tokenizer(gguf, w, reader):
    """Writes `spm_vocabulary` and the Mistral-style template; the vocabulary size."""
    texts, scores, types = spm_vocabulary(reader)
    w.add_tokenizer_model("llama")
    w.add_token_list(texts)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_chat_template(MISTRAL_TEMPLATE)
    return len(texts)


def write_model(gguf, reader, path, v, seed, with_rope_freqs=True, pre=None):
    """Writes variant `v` to `path` with random weights from `seed`
    (`pre`: another `tokenizer.ggml.pre` than the shipped model's)."""
    rng = np.random.default_rng(seed)
    arch = v["arch"]
    hd = v["head_dim"] or N_EMBD // v["n_head"]
    dq, dkv = v["n_head"] * hd, v["n_kv"] * hd
    w = gguf.GGUFWriter(path, arch)
    w.add_context_length(2048)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(v["n_head"])
    w.add_head_count_kv(v["n_kv"])
    if v["head_dim"]:
        w.add_key_length(hd)
        w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(v["base"])
    w.add_layer_norm_rms_eps(v.get("eps", 1e-5))
    for key, val in v.get("extra", {}).items():
        k = f"{arch}.{key}"
        if isinstance(val, str):
            w.add_string(k, val)
        elif isinstance(val, float):
            w.add_float32(k, val)
        else:
            w.add_uint32(k, val)
    if v.get("spm"):
        n_vocab = write_spm_tokenizer(gguf, w, reader)
    else:
        n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    # The shipped model's tokenizer and chat template.
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer.") or v.get("spm"):
            continue
        if name == "tokenizer.ggml.pre" and pre is not None:
            w.add_string(name, pre)
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(name, field.contents(), vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(name, field.contents(), vtype)
    q8 = gguf.GGMLQuantizationType.Q8_0

    def mat(name, rows, cols, std):
        x = (rng.standard_normal((rows, cols)) * std).astype(np.float32)
        w.add_tensor(name, gguf.quants.quantize(x, q8), raw_dtype=q8)

    def vec(name, n, base=1.0, std=0.1):
        w.add_tensor(name, (base + rng.standard_normal(n) * std).astype(np.float32))

    mat("token_embd.weight", n_vocab, N_EMBD, 0.25)
    for i in range(N_LAYER):
        b = f"blk.{i}."
        vec(b + "attn_norm.weight", N_EMBD)
        mat(b + "attn_q.weight", dq, N_EMBD, 0.5 / math.sqrt(N_EMBD))
        mat(b + "attn_k.weight", dkv, N_EMBD, 0.5 / math.sqrt(N_EMBD))
        mat(b + "attn_v.weight", dkv, N_EMBD, 1.0 / math.sqrt(N_EMBD))
        mat(b + "attn_output.weight", N_EMBD, dq, v.get("gain", GAIN) / math.sqrt(dq))
        if v.get("qk_norm"):
            vec(b + "attn_q_norm.weight", hd, 1.0, 0.3)
            vec(b + "attn_k_norm.weight", hd, 1.0, 0.3)
        vec(b + "ffn_norm.weight", N_EMBD)
        mat(b + "ffn_gate.weight", N_FF, N_EMBD, 1.0 / math.sqrt(N_EMBD))
        mat(b + "ffn_up.weight", N_FF, N_EMBD, 1.0 / math.sqrt(N_EMBD))
        mat(b + "ffn_down.weight", N_EMBD, N_FF, v.get("gain", GAIN) / math.sqrt(N_FF))
    vec("output_norm.weight", N_EMBD)
    if not v["tied"]:
        mat("output.weight", n_vocab, N_EMBD, 0.25)
    if v.get("rope_freqs") and with_rope_freqs:
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(hd, v["base"]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def check(model, n, label):
    """Number of failing prompts of `model`, and the worst |Δlogprob|."""
    llm = R.load(n_threads=2, model=model)
    failed, worst = 0, 0.0
    for msgs in PROMPTS:
        ours = R.probe("greedy", model, str(n), stdin=json.dumps({"messages": msgs}))
        ids = llm.tokenize(ours["prompt"].encode(), add_bos=True, special=True)
        if ids != ours["prompt_ids"]:
            failed += 1
            print(f"{label}: PROMPT TOKENS DIFFER for {msgs!r}")
            continue
        ref_lp = []
        ref, _ = R.greedy(llm, ids, n, logprobs=ref_lp)
        same = 0
        while same < min(len(ref), len(ours["tokens"])) and ref[same] == ours["tokens"][same]:
            same += 1
        dlp = max((abs(a - b) for a, b in zip(ref_lp[:same], ours["logprobs"][:same])), default=0.0)
        worst = max(worst, dlp)
        stopped_early = len(ref) < n and R.is_eog(llm, ref[-1])
        ok = ref == ours["tokens"] and dlp <= LOGPROB_TOL and (len(ref) >= min(n, MIN_TOKENS) or stopped_early)
        failed += not ok
        print(f"{label}: {'OK  ' if ok else 'FAIL'} {same}/{len(ref)} tokens equal, max |Δlogprob| {dlp:.2e}"
              f" ({len(set(ref))} distinct)"
              f"{' (stopped at end-of-generation)' if stopped_early else ''}: {msgs[-1]['content'][:40]!r}")
        if ref != ours["tokens"]:
            print(f"  llama.cpp {ref}\n  ours      {ours['tokens']}")
    del llm
    return failed, worst


def factors_matter(gguf, reader, tmp, v, model, seed):
    """The rope_freqs model's llama.cpp logits differ from those of the same
    weights without the tensor (so a host ignoring it fails `check`)."""
    bare = os.path.join(tmp, "llama3-no-rope-freqs.gguf")
    write_model(gguf, reader, bare, v, seed, with_rope_freqs=False)
    ids = list(range(300, 340))
    logits = []
    for path in (model, bare):
        llm = R.load(n_threads=2, model=path)
        llm.reset()
        llm.eval(ids)
        logits.append(R.last_logits(llm))
        del llm
    diff = float(np.abs(logits[0] - logits[1]).max())
    print(f"control: without rope_freqs.weight the last logits move by up to {diff:.3f}")
    return diff > 1e-2


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    if not os.path.exists(R.MODEL):
        print(f"NOTICE: {R.MODEL} absent (run scripts/fetch-model.sh); skipping")
        return 0
    try:
        import gguf
    except ImportError:
        print("NOTICE: the gguf package is absent (scripts/setup-python.sh installs it); skipping")
        return 0
    reader = gguf.GGUFReader(R.MODEL)
    failed, worst = 0, 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for seed, (name, v) in enumerate(VARIANTS.items(), start=1):
            path = os.path.join(tmp, f"tiny-{name}.gguf")
            write_model(gguf, reader, path, v, seed)
            bad, dlp = check(path, n, name)
            failed += bad
            worst = max(worst, dlp)
            if v.get("rope_freqs") and not factors_matter(gguf, reader, tmp, v, path, seed):
                print("FAIL control: rope_freqs.weight does not change llama.cpp's logits; the test is blind")
                failed += 1
    print(f"arch_parity: {failed} failure(s), max |Δlogprob| {worst:.2e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
