#!/usr/bin/env python3
"""Stale citations in the documentation (run by scripts/ci/docs.sh).

(a) Paths. In docs/*.md, README.md and every folder's README.md, each word
    of an inline code span or fenced code block, and each link target, that
    looks like a repository path must name a tracked file or folder. A word
    looks like a path when it ends in a known source extension (`.rs`,
    `.md`, `.sh`, ...) or contains a `/` and starts with a top-level entry
    of the repository or of the document's folder. It resolves when it
    names a tracked file or folder relative to the repository root, to the
    document's folder, or as the tail of a tracked path (so the docs may
    write `transport/tls.rs` for `server/src/transport/tls.rs` and
    `rng.rs` for the one `rng.rs`). `*` globs and `{a,b}` alternatives are
    expanded, `<placeholder>` matches one path segment or part of one, and
    paths that are not tracked by design (the model folder, build output)
    are listed in ALLOWED below.

(b) Code. Every `Type::function`, `module::function` and
    `file.rs::function` named in docs/ARCHITECTURE.md must exist: the
    function defined (`fn name`) in the file, in a file with an `impl` or
    `trait` of the type, or in the module's files; `Type::Item` and
    `module::Type` need the type (or enum variant, constant, module)
    defined there.

(c) Examples. A line `<!-- example: PATH -->` must be followed by a fenced
    code block holding exactly the file PATH (which CI runs), so the
    example a reader copies is the one that was run.

Each stale citation is printed as `FILE:LINE: ...`; the exit status is 1 if
there is any.
"""

import fnmatch
import os
import re
import subprocess
import sys

# File extensions that make a word a path citation.
EXTENSIONS = (
    ".rs", ".md", ".sh", ".py", ".toml", ".proto", ".h", ".c", ".cu",
    ".json", ".yaml", ".yml", ".go", ".js", ".mjs", ".ts", ".txt", ".lock",
    ".gguf", ".cfg", ".jinja", ".lark", ".gbnf",
)

# Paths the docs cite that are not in the repository by design (fnmatch
# patterns, matched against the word and against it relative to the
# document's folder). Add to it only what can never be tracked.
ALLOWED = (
    # made by a run: downloaded models, build and benchmark output
    "models", "models/*", "*.gguf",       # scripts/fetch-model.sh
    "target", "target/*",                 # cargo
    "bench-results", "bench-results/*",   # scripts/bench-all.sh
    "fuzz/artifacts/*", "fuzz/target/*",  # cargo fuzz
    "samplerd/v1/sampler_pb2*.py",        # generated from the proto by a client's build
    "clients/go/build", "clients/go/build/*",  # clients/go/build.sh
    "*.tgz",                              # npm pack
    # install commands the kits' READMEs give from the repository root
    "./clients/node", "./clients/python",
    # other projects' files, cited for where a behaviour comes from
    "src/llama-*.cpp", "common/common.h",   # llama.cpp
    "google/rpc/*.proto",                   # googleapis (the rich error details)
    "vllm/v1/*",                            # vLLM
    "task/coop/mod.rs", "scheduler/multi_thread/worker.rs",  # tokio
    # the reader's own files in examples
    "my_stage.c", "story.schema.json", "tokenizer.json",
)

# Where code citations of a crate name (`samplerd_sampling::...`) look.
CRATE_PREFIX = "samplerd_"


def git(*args):
    return subprocess.run(
        ["git", *args], check=True, capture_output=True, text=True
    ).stdout


def tracked_paths():
    files = [f for f in git("ls-files", "-z").split("\0") if f]
    dirs = set()
    for f in files:
        d = os.path.dirname(f)
        while d and d not in dirs:
            dirs.add(d)
            d = os.path.dirname(d)
    return files, dirs


FILES, DIRS = tracked_paths()
ALL = set(FILES) | DIRS
TOP = {p.split("/")[0] for p in ALL}
RS_FILES = [f for f in FILES if f.endswith(".rs")]


def dependency_crates():
    """Names (as Rust spells them) of every crate in the lock files."""
    names = set()
    for f in FILES:
        if os.path.basename(f) == "Cargo.lock":
            with open(f, encoding="utf-8") as fh:
                names |= {
                    n.replace("-", "_") for n in re.findall(r'^name = "([^"]+)"', fh.read(), re.M)
                }
    return names


EXTERNAL_CRATES = dependency_crates()


def docs():
    out = []
    for f in FILES:
        if not f.endswith(".md"):
            continue
        if os.path.dirname(f) == "docs" or os.path.basename(f) == "README.md":
            out.append(f)
    return sorted(out)


def expand_braces(word):
    m = re.search(r"\{([^{}]*)\}", word)
    if not m:
        return [word]
    out = []
    for alt in m.group(1).split(","):
        out += expand_braces(word[: m.start()] + alt + word[m.end():])
    return out


def tail_match(pattern):
    """Tracked paths equal to `pattern` or ending in `/pattern` (fnmatch)."""
    if not any(c in pattern for c in "*?["):
        if pattern in ALL:
            return True
        suffix = "/" + pattern
        return any(p.endswith(suffix) for p in ALL)
    return any(
        fnmatch.fnmatchcase(p, pattern) or fnmatch.fnmatchcase(p, "*/" + pattern)
        for p in ALL
    )


def resolves(word, docdir):
    for w in expand_braces(word):
        w = re.sub(r"<[^<>/]*>", "*", w).rstrip("/")
        if not w or w in (".", ".."):
            continue
        here = os.path.normpath(os.path.join(docdir, w)) if docdir else w
        if any(fnmatch.fnmatchcase(c, a) for c in (w, here) for a in ALLOWED):
            continue
        if w.startswith("../") or w.startswith("./"):
            ok = tail_match(here) and not here.startswith("..")
        else:
            ok = tail_match(w) or (docdir and tail_match(here))
        if not ok:
            return False
    return True


WORD = re.compile(r"^[A-Za-z0-9_.*{},<>+/-]+$")


def path_like(word, docdir):
    if not WORD.match(word) or "/" not in word and "." not in word:
        return False
    if word.startswith(("/", "-", ".")) and not word.startswith(("./", "../")):
        return False
    if word.endswith(EXTENSIONS) or re.search(r"\.\{[a-z,]+\}$", word):
        return True
    if "/" in word:
        first = word.split("/")[0]
        if first in (".", ".."):
            return True
        local = os.path.normpath(os.path.join(docdir, first)) if docdir else first
        return first in TOP or local in ALL or any(
            fnmatch.fnmatchcase(first, a) for a in ALLOWED
        )
    return False


def code_spans(text, start, end):
    """(offset, content) of the inline code spans in text[start:end], as
    CommonMark pairs them: a run of n backticks opens a span that the next
    run of exactly n closes, within one paragraph; an unclosed run is
    literal."""
    out = []
    runs = [(m.start(), len(m.group(0))) for m in re.finditer(r"`+", text[start:end])]
    i = 0
    while i < len(runs):
        at, n = runs[i]
        close = next((j for j in range(i + 1, len(runs)) if runs[j][1] == n), None)
        if close is None:
            i += 1
            continue
        a = start + at + n
        out.append((a, text[a : start + runs[close][0]]))
        i = close + 1
    return out


def spans(text):
    """(offset, content, fenced) of fenced code blocks, inline code spans
    and link targets."""
    out = []
    fence = re.compile(r"^( {0,3})(```+|~~~+)[^\n]*\n(.*?)^\1\2[ \t]*$", re.M | re.S)
    prose = []  # (start, end) of the text between fences
    at = 0
    for m in fence.finditer(text):
        out.append((m.start(3), m.group(3), True))
        prose.append((at, m.start()))
        at = m.end()
    prose.append((at, len(text)))
    for a, b in prose:
        # paragraphs: code spans do not cross a blank line
        para = a
        for m in re.finditer(r"\n[ \t]*\n", text[a:b]):
            out += [(o, c, False) for o, c in code_spans(text, para, a + m.start())]
            para = a + m.end()
        out += [(o, c, False) for o, c in code_spans(text, para, b)]
        for m in re.finditer(r"\]\(([^)\s]+)\)", text[a:b]):
            target = m.group(1).split("#")[0]
            if target and "://" not in target and not target.startswith("mailto:"):
                out.append((a + m.start(1), target, False))
    return out


def line_of(text, offset):
    return text.count("\n", 0, offset) + 1


def words(content):
    for m in re.finditer(r"\S+", content):
        w = m.group(0).strip("()[],;:'\"`!?")
        w = re.sub(r"[.,;:]+$", "", w) if not w.endswith(EXTENSIONS) else w
        yield m.start(), w


def check_paths(doc, text, problems):
    docdir = os.path.dirname(doc)
    for start, content, fenced in spans(text):
        for off, w in words(content):
            if "::" in w or "://" in w or "=" in w or "$" in w or "@" in w:
                continue
            if path_like(w, docdir) and not resolves(w, docdir):
                problems.append(f"{doc}:{line_of(text, start + off)}: no such path: {w}")


# --- (b) code citations -------------------------------------------------

_cache = {}


def read(path):
    if path not in _cache:
        with open(path, encoding="utf-8", errors="replace") as f:
            _cache[path] = f.read()
    return _cache[path]


def files_defining(regex, files=None):
    rx = re.compile(regex, re.M)
    return [f for f in (files if files is not None else RS_FILES) if rx.search(read(f))]


def fn_def(name):
    return r"\bfn\s+" + re.escape(name) + r"\b"


def type_def(name):
    return r"\b(?:struct|enum|trait|type|union)\s+" + re.escape(name) + r"\b"


def item_def(name):
    """A function, type, constant, static, module or macro called `name`."""
    n = re.escape(name)
    return (
        r"\b(?:fn|struct|enum|trait|type|union|const|static|mod)\s+" + n + r"\b"
        r"|\bmacro_rules!\s*" + n + r"\b"
    )


def module_files(name):
    """The .rs files of module or crate `name`."""
    if name == "crate":
        return RS_FILES
    if name.startswith(CRATE_PREFIX):
        crate = name.replace("_", "-")
        out = []
        for f in FILES:
            if os.path.basename(f) == "Cargo.toml" and re.search(
                r'^name\s*=\s*"' + re.escape(crate) + r'"', read(f), re.M
            ):
                d = os.path.dirname(f)
                out += [r for r in RS_FILES if r.startswith(d + "/" if d else "")]
        return out
    return [
        f for f in RS_FILES
        if os.path.basename(f) == name + ".rs" or ("/" + name + "/") in ("/" + f)
    ]


def variant_of(enum, name):
    """Files where `name` is a variant of enum `enum`."""
    out = []
    for f in files_defining(r"\benum\s+" + re.escape(enum) + r"\b"):
        body = read(f)
        for m in re.finditer(r"\benum\s+" + re.escape(enum) + r"\b[^{]*\{", body):
            depth, i = 1, m.end()
            while i < len(body) and depth:
                depth += {"{": 1, "}": -1}.get(body[i], 0)
                i += 1
            if re.search(r"^\s*" + re.escape(name) + r"\b", body[m.end():i], re.M):
                out.append(f)
    return out


def code_problem(token):
    """Why `a::b` (or `path.rs::b`) is stale, or None."""
    segs = token.split("::")
    qual, last = segs[-2], segs[-1]
    if qual in ("std", "core", "alloc", "Self", "self", "super") or not last:
        return None
    if segs[0] in EXTERNAL_CRATES and not segs[0].startswith(CRATE_PREFIX):
        return None  # another crate's item
    if qual.endswith(".rs"):
        files = [f for f in RS_FILES if f == qual or f.endswith("/" + qual)]
        if not files:
            return f"no file {qual}"
        if not files_defining(item_def(last), files) and not any(
            re.search(r"\b" + re.escape(last) + r"!", read(f)) for f in files
        ):
            return f"{qual} defines no `{last}`"
        return None
    if qual[:1].isupper():
        if not files_defining(type_def(qual)):
            return f"no type {qual}"
        impls = files_defining(
            r"\b(?:impl\b[^{;]*\b" + re.escape(qual) + r"\b|trait\s+" + re.escape(qual) + r"\b)"
        )
        if files_defining(item_def(last), impls) or variant_of(qual, last):
            return None
        return f"no `{last}` in an impl of {qual}"
    files = module_files(qual)
    if not files:
        # a module declared inline or re-exported under this name
        if not files_defining(r"\bmod\s+" + re.escape(qual) + r"\b|\bas\s+" + re.escape(qual) + r"\b"):
            return f"no module {qual}"
        files = RS_FILES
    if files_defining(item_def(last), files) or module_files(last) or variant_of(qual, last):
        return None
    if any(re.search(r"\b" + re.escape(last) + r"!", read(f)) for f in files):
        return None  # a macro
    return f"module {qual} defines no `{last}`"


CODE = re.compile(r"(?<![\w:])((?:[\w./-]+\.rs|[A-Za-z_]\w*)(?:::[A-Za-z_]\w*)+)(?![\w(])?")


def check_code(doc, text, problems):
    for start, content, fenced in spans(text):
        joined = re.sub(r"::\s+", "::", content)
        for m in CODE.finditer(joined):
            token = m.group(1)
            why = code_problem(token)
            if os.environ.get("DOCS_CHECK_VERBOSE"):
                print(f"{doc}: {token}: {why or 'ok'}", file=sys.stderr)
            if why:
                # the offset in `joined` approximates the line
                problems.append(f"{doc}:{line_of(text, start + m.start())}: {token}: {why}")


EXAMPLE = re.compile(r"^<!-- example: (\S+) -->\n```[^\n]*\n(.*?)^```$", re.M | re.S)


def check_examples(doc, text, problems):
    for marker in re.finditer(r"^<!-- example: (\S+) -->$", text, re.M):
        m = EXAMPLE.match(text, marker.start())
        path = marker.group(1)
        if not m:
            why = "not followed by a fenced code block"
        elif not os.path.isfile(path):
            why = "no such file"
        elif read(path) != m.group(2):
            why = "the code block differs from the file (copy the file into it)"
        else:
            continue
        problems.append(f"{doc}:{line_of(text, marker.start())}: example {path}: {why}")


def main():
    problems = []
    for doc in docs():
        text = read(doc)
        check_paths(doc, text, problems)
        check_examples(doc, text, problems)
        if doc == "docs/ARCHITECTURE.md":
            check_code(doc, text, problems)
    def key(p):
        f, line = p.split(":")[:2]
        return f, int(line)

    for p in sorted(problems, key=key):
        print(p)
    if problems:
        print(f"docs: {len(problems)} stale citation(s)", file=sys.stderr)
        return 1
    print(f"docs: citations in {len(docs())} files resolve")
    return 0


if __name__ == "__main__":
    os.chdir(git("rev-parse", "--show-toplevel").strip())
    sys.exit(main())
