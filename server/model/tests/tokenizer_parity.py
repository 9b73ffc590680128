#!/usr/bin/env python3
"""Tokenizer parity: our token ids (via `model_probe tokenize`) must equal
llama.cpp's for every case (`Llama(vocab_only=True).tokenize(text,
add_bos=False, special=True)`, as llama-server tokenizes prompts).

Run: $HOME/.cache/samplerd/venv/bin/python server/model/tests/tokenizer_parity.py
(needs models/SmolLM2-135M-Instruct.Q4_1.gguf; exits 0 with a notice if absent).
Also checks byte-level decoding: our bytes for each id list == llama.cpp's detokenize.

The other pre-tokenizer families (`tokenizer.ggml.pre`: Llama 3's
`llama-bpe`, `qwen2`, `gpt-2`, `default`) are checked on tiny models that
carry the shipped vocabulary and merges under that name (written with the
`gguf` package, as arch_parity.py writes them): ids only, since their
decoding is the same byte-level one.

SentencePiece (`tokenizer.ggml.model = "llama"`, Llama 2 and Mistral
v0.1–v0.3) is checked on arch_parity.py's `mistral-spm` model, ids and the
bytes of every token, with cases around its special tokens and its space
prefix.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llamacpp_ref as R  # noqa: E402

CASES = [
    "Hello", "Hello world", "hello World!", " leading space", "trailing space ", "",
    "a  b   c    d", "     ", "\n", "line one\nline two\n\nline four", "\ttab\tseparated\t",
    " \n \t mixed \r\n whitespace", "1234567890", "3.14159 and 2,718 and -42", "x=1+2*3/4",
    "I'm, you're, it's, we'll, they'd, I've", "CamelCaseWords and snake_case_words",
    "URL: https://example.com/path?q=1&r=2", "email@example.org", "naïve café résumé",
    "日本語のテキスト", "中文字符和数字123", "한국어 텍스트", "Привет, мир!", "مرحبا بالعالم",
    "emoji 😀👍🏽🎉 family 👨‍👩‍👧", "math ∑∫√∞ ≠ ≤", "code: fn main() { println!(\"hi\"); }",
    "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n日本語?<|im_end|>\n",
    "text<|endoftext|>more", "<|im_end|><|im_end|>", "<|im_start|", "< |im_start| >",
    "<repo_name>samplerd<filename>main.rs", "multiple   \n\n\n   newlines   \n",
    "repeated!!!!!!!!!!!! ??? ...", "   \t\t\n\n  ", "A" * 300, "ab " * 100,
]


# Where the families differ: digit groups, upper-case contractions,
# whitespace before newlines, punctuation runs.
FAMILY_CASES = CASES + [
    "12345678 and 1,234,567.89", "I'LL SEE YOU'RE THERE, WE'D", "tabs\t\t\nand  \n\n  spaces",
    "x+=y^2|z~w<=>v", "a   \r\n   b", "$100 for 3 items!!!", "٣٤٥ Arabic-Indic digits",
]


SPM_CASES = FAMILY_CASES + [
    "[INST] Hello [/INST]", "<s>[INST]What?[/INST] Fine.</s>", "[INST]x[/INST]y", "<unk> and <s>",
    "a</s>b</s>", "[INST]  two spaces", "[/INST]\n", "  ", "▁ already escaped ▁▁", "[INST[/INST]]",
]


def check_spm():
    """Ids and token bytes of a SentencePiece vocabulary against llama.cpp's."""
    try:
        import gguf
    except ImportError:
        print("NOTICE: the gguf package is absent (scripts/setup-python.sh installs it); skipping SentencePiece")
        return 0
    import tempfile
    import arch_parity as A
    reader = gguf.GGUFReader(R.MODEL)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tiny-spm.gguf")
        A.write_model(gguf, reader, path, A.VARIANTS["mistral-spm"], 1)
        llm = R.load(vocab_only=True, model=path)
        ours = R.probe("tokenize", path, stdin=json.dumps(SPM_CASES))["ids"]
        refs = [llm.tokenize(t.encode(), add_bos=False, special=True) for t in SPM_CASES]
        bad = 0
        for text, mine, ref in zip(SPM_CASES, ours, refs):
            if ref != mine:
                bad += 1
                print(f"MISMATCH [spm] {text!r}\n  llama.cpp {ref}\n  ours      {mine}")
        n_bytes = sum(any(0 < i - 2 <= 256 for i in ref) for ref in refs)
        our_bytes = R.probe("detokenize", path, stdin=json.dumps(refs))["bytes"]
        for text, ids, b in zip(SPM_CASES, refs, our_bytes):
            want = b"".join(llm.detokenize([i], special=True) for i in ids)
            if bytes(b) != want:
                bad += 1
                print(f"DECODE MISMATCH [spm] {text!r}: llama.cpp {want!r} ours {bytes(b)!r}")
        del llm
    print(f"tokenizer.ggml.model = 'llama' (SentencePiece): {len(SPM_CASES)} cases (ids and token bytes), "
          f"{bad} mismatches ({n_bytes} use byte-fallback tokens)")
    if n_bytes == 0:
        print("FAIL control: no case falls back to byte tokens; the check is blind to them")
        bad += 1
    return bad


def check_families(shipped):
    """Ids of the other pre-tokenizer families against llama.cpp's;
    `shipped`: llama.cpp's ids of FAMILY_CASES under the shipped model's
    own family (a control: Llama 3's and the default family must split
    some of them differently, or the check would be blind)."""
    try:
        import gguf
    except ImportError:
        print("NOTICE: the gguf package is absent (scripts/setup-python.sh installs it); skipping the families")
        return 0
    import tempfile
    import arch_parity as A
    reader = gguf.GGUFReader(R.MODEL)
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        for pre in ["llama-bpe", "qwen2", "gpt-2", "default"]:
            path = os.path.join(tmp, f"tiny-{pre}.gguf")
            A.write_model(gguf, reader, path, A.VARIANTS["llama-linear-rope"], 1, pre=pre)
            llm = R.load(vocab_only=True, model=path)
            ours = R.probe("tokenize", path, stdin=json.dumps(FAMILY_CASES))["ids"]
            n_bad, n_differ = 0, 0
            for text, mine, other in zip(FAMILY_CASES, ours, shipped):
                ref = llm.tokenize(text.encode(), add_bos=False, special=True)
                n_differ += ref != other
                if ref != mine:
                    n_bad += 1
                    print(f"MISMATCH [{pre}] {text!r}\n  llama.cpp {ref}\n  ours      {mine}")
            print(f"tokenizer.ggml.pre = {pre!r}: {len(FAMILY_CASES)} cases, {n_bad} mismatches "
                  f"({n_differ} split otherwise than the shipped model's family)")
            bad += n_bad
            if pre in ("llama-bpe", "default") and n_differ == 0:
                print(f"FAIL control: {pre!r} splits every case as the shipped family does; the check is blind")
                bad += 1
            del llm
    return bad


def main():
    if not os.path.exists(R.MODEL):
        print(f"NOTICE: {R.MODEL} absent (run scripts/fetch-model.sh); skipping")
        return 0
    llm = R.load(vocab_only=True)
    ours = R.probe("tokenize", R.MODEL, stdin=json.dumps(CASES))["ids"]
    bad = 0
    for text, mine in zip(CASES, ours):
        ref = llm.tokenize(text.encode(), add_bos=False, special=True)
        if ref != mine:
            bad += 1
            print(f"MISMATCH {text!r}\n  llama.cpp {ref}\n  ours      {mine}")
    refs = [llm.tokenize(t.encode(), add_bos=False, special=True) for t in CASES]
    our_bytes = R.probe("detokenize", R.MODEL, stdin=json.dumps(refs))["bytes"]
    for text, ids, b in zip(CASES, refs, our_bytes):
        want = llm.detokenize(ids, special=True)
        if bytes(b) != want:
            bad += 1
            print(f"DECODE MISMATCH {text!r}: llama.cpp {want!r} ours {bytes(b)!r}")
    print(f"tokenizer parity: {len(CASES)} cases (ids and decoded bytes), {bad} mismatches")
    bad += check_families([llm.tokenize(t.encode(), add_bos=False, special=True) for t in FAMILY_CASES])
    bad += check_spm()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
