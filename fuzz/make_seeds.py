#!/usr/bin/env python3
"""Writes the hand-made seeds of the fuzz corpus (fuzz/corpus/<target>/seed-*).

Run with the test venv's python (it needs grpcio-tools for the protobuf
seeds): ~/.cache/samplerd/venv/bin/python fuzz/make_seeds.py
The fuzzer's own finds are added to the same folders by scripts/ci/fuzz.sh
(minimised with -merge=1).
"""
import os
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CORPUS = os.path.join(HERE, "corpus")


def put(target, name, data):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "seed-" + name), "wb") as f:
        f.write(data)


# --- GGUF: a tiny but complete llama model (1 layer, 32-wide, byte vocab) ---
def gguf_str(s):
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


T_U32, T_I32, T_F32, T_BOOL, T_STR, T_ARR = 4, 5, 6, 7, 8, 9


def kv(key, typ, val):
    out = gguf_str(key) + struct.pack("<I", typ)
    if typ == T_U32:
        out += struct.pack("<I", val)
    elif typ == T_I32:
        out += struct.pack("<i", val)
    elif typ == T_F32:
        out += struct.pack("<f", val)
    elif typ == T_BOOL:
        out += struct.pack("<?", val)
    elif typ == T_STR:
        out += gguf_str(val)
    elif typ == T_ARR:
        etyp, items = val
        out += struct.pack("<IQ", etyp, len(items))
        for it in items:
            out += gguf_str(it) if etyp == T_STR else struct.pack("<i", it)
    return out


def byte_chars():
    out, n = [], 0
    for b in range(256):
        keep = 33 <= b <= 126 or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF
        if keep:
            out.append(chr(b))
        else:
            n += 1
            out.append(chr(255 + n))
    return out


def q8_0(rows, cols, seed):
    # Each block: f16 scale + 32 int8 quants.
    out = bytearray()
    x = seed
    for _ in range(rows * cols // 32):
        out += struct.pack("<e", 0.01)
        for _ in range(32):
            x = (x * 1103515245 + 12345) & 0x7FFFFFFF
            out += struct.pack("<b", (x >> 16) % 255 - 127)
    return bytes(out)


def f32s(n, v):
    return struct.pack("<%df" % n, *([v] * n))


def tiny_gguf(arch="llama", template=None, with_tensors=True):
    d, heads, kv_heads, ff = 32, 2, 1, 32
    toks = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + byte_chars() + ["Ġt", "he"]
    nv = len(toks)
    meta = [
        kv("general.architecture", T_STR, arch),
        kv(arch + ".context_length", T_U32, 64),
        kv(arch + ".embedding_length", T_U32, d),
        kv(arch + ".block_count", T_U32, 1),
        kv(arch + ".feed_forward_length", T_U32, ff),
        kv(arch + ".attention.head_count", T_U32, heads),
        kv(arch + ".attention.head_count_kv", T_U32, kv_heads),
        kv(arch + ".rope.freq_base", T_F32, 10000.0),
        kv(arch + ".attention.layer_norm_rms_epsilon", T_F32, 1e-5),
        kv("tokenizer.ggml.model", T_STR, "gpt2"),
        kv("tokenizer.ggml.pre", T_STR, "smollm"),
        kv("tokenizer.ggml.tokens", T_ARR, (T_STR, toks)),
        kv("tokenizer.ggml.token_type", T_ARR, (T_I32, [3, 3, 3] + [1] * (nv - 3))),
        kv("tokenizer.ggml.merges", T_ARR, (T_STR, ["Ġ t", "h e"])),
        kv("tokenizer.ggml.bos_token_id", T_U32, 1),
        kv("tokenizer.ggml.eos_token_id", T_U32, 2),
        kv("tokenizer.ggml.add_bos_token", T_BOOL, False),
    ]
    if template is not None:
        meta.append(kv("tokenizer.chat_template", T_STR, template))
    tensors = []  # (name, dims innermost-first, ggml type, data)
    if with_tensors:
        dkv = kv_heads * d // heads
        tensors.append(("token_embd.weight", [d, nv], 8, q8_0(nv, d, 1)))
        for name, rows, cols in [
            ("attn_q", d, d), ("attn_k", dkv, d), ("attn_v", dkv, d),
            ("attn_output", d, d), ("ffn_gate", ff, d), ("ffn_up", ff, d),
            ("ffn_down", d, ff),
        ]:
            tensors.append(("blk.0.%s.weight" % name, [cols, rows], 8, q8_0(rows, cols, rows + cols)))
        tensors.append(("blk.0.attn_norm.weight", [d], 0, f32s(d, 1.0)))
        tensors.append(("blk.0.ffn_norm.weight", [d], 0, f32s(d, 1.0)))
        tensors.append(("output_norm.weight", [d], 0, f32s(d, 1.0)))
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(meta)) + b"".join(meta)
    offset, data = 0, b""
    for name, dims, typ, raw in tensors:
        out += gguf_str(name) + struct.pack("<I", len(dims))
        out += b"".join(struct.pack("<Q", x) for x in dims)
        out += struct.pack("<IQ", typ, offset)
        pad = (-len(raw)) % 32
        data += raw + b"\0" * pad
        offset += len(raw) + pad
    out += b"\0" * ((-len(out)) % 32)
    return out + data


put("gguf", "tiny-llama", tiny_gguf())
put("gguf", "tiny-qwen2-metadata-only", tiny_gguf("qwen2", with_tensors=False))
put("gguf", "chatml-template", tiny_gguf(
    template="{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    with_tensors=False))
put("gguf", "header-only", b"GGUF" + struct.pack("<IQQ", 3, 0, 0))

# --- text-ish seeds for the byte-level targets ---
put("utf8_streamer", "cjk-emoji", "a你好😀b\xff".encode("utf-8", "surrogatepass") + b"\x02\x01\x03")
put("utf8_streamer", "invalid", b"\xe4\xbdx\xf0\x9f\x98\xc3\x28\xed\xa0\x80")
put("stop_filter", "ab", bytes([1, 2, 2, 0, 1, 1, 4, 2, 0, 1, 3, 1, 0, 2, 0, 1]))
put("stop_filter", "raw", b"\x00\x02\x03wor\x02ld\x05\x03hel\x04lo wo\x03rld")
put("chain", "typed-default", bytes([1] + [0] * 40 + list(range(0, 250, 3))))
put("chain", "explicit", bytes([0, 3, 1, 2, 4, 0, 7, 9, 200, 1, 2, 3, 5] + list(range(0, 250, 7))))

# --- protobuf requests, encoded by the real generated code ---
with tempfile.TemporaryDirectory() as tmp:
    subprocess.check_call([
        sys.executable, "-m", "grpc_tools.protoc", "-I", os.path.join(ROOT, "proto"),
        "--python_out", tmp, os.path.join(ROOT, "proto/samplerd/v1/sampler.proto"),
    ])
    sys.path.insert(0, tmp)
    from samplerd.v1 import sampler_pb2 as pb

    def sample(name, **kw):
        put("proto_request", "sample-" + name, b"\x00" + pb.SampleRequest(**kw).SerializeToString())

    def generate(name, **kw):
        put("proto_request", "generate-" + name, b"\x01" + pb.GenerateRequest(**kw).SerializeToString())

    sample("floats", logits=[0.1, 2.5, 0.3, -1.0], previous_tokens=[1, 2], step=3, n_probs=2)
    sample("bytes-greedy", logits_f32le=struct.pack("<4f", 1, 2, 3, 4),
           params=pb.SamplingParams(temperature=0.0, seed=7))
    sample("typed", logits=[0.5] * 16, params=pb.SamplingParams(
        top_k=3, top_p=0.9, min_p=0.05, repeat_penalty=1.3, logit_bias={1: 5.0},
        samplers=["top_k", "temperature"]), post_sampling_probs=True, n_probs=3)
    sample("chain", logits=[1.0, 0.0, -1.0], params=pb.SamplingParams(chain=[
        pb.StageSpec(name="top_k", params={"k": pb.ParamValue(number=2)}),
        pb.StageSpec(name="dist")]))
    def batch(name, **kw):
        put("proto_request", "batch-" + name, b"\x02" + pb.SampleBatchRequest(**kw).SerializeToString())

    batch("f32", rows=[
        pb.BatchRow(logits=struct.pack("<8f", 0.5, 1.5, -1.0, 2.0, 0.0, 0.25, 3.0, -2.0)),
        pb.BatchRow(logits=struct.pack("<8f", 1.0, 0.0, 2.5, -0.5, 0.75, 1.25, -1.5, 0.5),
                    step=3, previous_tokens=[2, 6]),
    ], n_probs=2)
    generate("prompt", prompt="Hello", max_tokens=4, stop=["\n"], params=pb.SamplingParams(seed=1))
    generate("chat", messages=[pb.ChatMessage(role="user", content="Hi 你好")], max_tokens=2, n_probs=3)
    generate("bad-role", messages=[pb.ChatMessage(role="robot", content="x")])

# --- constraint: a kind byte (0 JSON Schema, 1 regex, 2 Lark, 3 GBNF), then
# grammar text: ordinary grammars and small forms of the hostile shapes ---
def constraint(name, kind, text):
    put("constraint", name, bytes([kind]) + text.encode())


constraint("json-person", 0, '{"type":"object","properties":{"name":{"type":"string"},'
           '"age":{"type":"integer","minimum":0}},"required":["name"]}')
constraint("json-ref-cycle", 0, '{"$ref":"#/$defs/a","$defs":{"a":{"type":"object",'
           '"properties":{"x":{"$ref":"#/$defs/b"}}},"b":{"anyOf":[{"$ref":"#/$defs/a"},'
           '{"type":"null"}]}}}')
constraint("json-ref-chain", 0, '{"$ref":"#/$defs/a0","$defs":{'
           + ",".join(f'"a{i}":{{"$ref":"#/$defs/a{i + 1}"}}' for i in range(20))
           + ',"a20":{"type":"string"}}}')
constraint("regex-date", 1, r"\d{4}-\d{2}-\d{2}")
constraint("regex-nested", 1, "((a|b)*c(d{1,3}|[e-g]+))+")
constraint("lark-expr", 2, 'start: expr\nexpr: term (("+" | "-") term)*\n'
           'term: NUMBER | "(" expr ")"\nNUMBER: /[0-9]+/\n')
constraint("lark-chain", 2, "start: a0\n" + "".join(f"a{i}: a{i + 1}\n" for i in range(20)) + 'a20: "x"\n')
constraint("lark-json", 2, 'start: "x" %json {"type":"array","items":{"type":"integer"}}\n')
constraint("gbnf-arith", 3, 'root ::= expr\nexpr ::= term (("+" | "-") term)*\n'
           'term ::= [0-9]+ | "(" expr ")"\n')
constraint("gbnf-nest", 3, "root ::= " + "(" * 40 + '"a"' + ")" * 40 + "\n")
print("seeds written under", CORPUS)
