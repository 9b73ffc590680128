#!/usr/bin/env python3
"""No import circle between the files of a Rust crate.

Every tracked crate (a Cargo.toml beside src/lib.rs or src/main.rs) is
read as a graph: one node per module file, an arrow from a file to each
module file whose items it names, through `use` declarations or paths in
the code (`crate::a::b::Item`, `super::x::Item`, `self::x`, or a child
module's name). A module and its own ancestors and descendants are not
arrows: a folder's mod.rs is its face (it declares and re-exports its
children, they take its shared items). Test modules (`#[cfg(test)] mod …
{ … }`) are left out. Any circle — files that reach each other — is
printed with the names that tie it, and the check fails: split the shared
part into a file both can stand on.

Reads source text only (no compiler): a path spelled through a
re-export is resolved to the file that re-exports it, which is what the
reader of the code sees too. Takes well under a second.
"""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def tracked(pattern):
    out = subprocess.run(
        ["git", "ls-files", "--", pattern], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    return [ROOT / p for p in out.split()]


def strip_tests_and_comments(text):
    """The text without `//` comments and `#[cfg(test)] mod x { … }` blocks."""
    text = re.sub(r"//[^\n]*", "", text)
    while True:
        m = re.search(r"#\[cfg\(test\)\]\s*(pub(\([^)]*\))?\s+)?mod\s+\w+\s*\{", text)
        if not m:
            return text
        depth, i = 0, m.end() - 1
        while i < len(text):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    break
            i += 1
        text = text[: m.start()] + text[i + 1 :]


def expand_use(tree):
    """`a::{b, c::{d, e as f}, *}` -> [[a, b], [a, c, d], [a, c, e], [a]]."""
    tree = re.sub(r"\s+as\s+\w+", "", tree)
    if not re.fullmatch(r"[\w:{},\s*]+", tree) or tree.count("{") != tree.count("}"):
        return []  # not a use declaration (the word in a string)
    tree = re.sub(r"\s+", "", tree)
    out = []

    def walk(prefix, s):
        # Split s at top-level commas.
        parts, depth, cur = [], 0, ""
        for ch in s:
            if ch == "," and depth == 0:
                parts.append(cur)
                cur = ""
                continue
            depth += ch == "{"
            depth -= ch == "}"
            cur += ch
        parts.append(cur)
        for part in filter(None, parts):
            if "{" in part:
                head, rest = part.split("{", 1)
                walk(prefix + [x for x in head.split("::") if x], rest[: rest.rindex("}")])
            else:
                segs = [x for x in part.split("::") if x and x != "*"]
                out.append(prefix + segs)

    walk([], tree)
    return out


def module_path(src, f):
    rel = f.relative_to(src).with_suffix("").parts
    if rel in (("lib",), ("main",)):
        return ()
    if rel[-1] == "mod":
        rel = rel[:-1]
    return tuple(rel)


def crate_graph(src, files):
    mods = {module_path(src, f): f for f in files}
    edges = {}  # (from_file, to_file) -> set of names
    for f in files:
        here = module_path(src, f)
        # A mod.rs / lib.rs file is its module; `super` of a.rs is its parent.
        text = strip_tests_and_comments(f.read_text(errors="replace"))
        paths = []
        for m in re.finditer(r"\buse\s+([^;]+);", text):
            paths += expand_use(m.group(1))
        for m in re.finditer(r"\b((?:crate|super|self)(?:::\w+)+)", text):
            paths.append(m.group(1).split("::"))
        for p in paths:
            absolute = resolve(here, p, mods)
            if absolute is None:
                continue
            # The longest prefix that is a module file.
            for n in range(len(absolute), -1, -1):
                target = tuple(absolute[:n])
                if target in mods:
                    break
            else:
                continue
            if target[: len(here)] == here or here[: len(target)] == target:
                continue  # itself, an ancestor or a descendant
            name = absolute[n] if n < len(absolute) else absolute[-1]
            edges.setdefault((f, mods[target]), set()).add(name)
    return edges


def resolve(here, p, mods):
    """`p` as a path from the crate root, or None for another crate's."""
    if not p:
        return None
    p = list(p)
    if p[0] == "crate":
        return p[1:]
    if p[0] in ("self", "super"):
        base = list(here)
        while p and p[0] in ("self", "super"):
            if p.pop(0) == "super":
                if not base:
                    return None
                base.pop()
        return base + p
    if tuple(here) + (p[0],) in mods:  # a child module, named bare
        return list(here) + p
    return None


def circles(edges):
    """Strongly connected components of two or more files (Tarjan)."""
    graph = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index, low, stack, on, found = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def main():
    failed = 0
    crates = 0
    for toml in tracked("*Cargo.toml"):
        src = toml.parent / "src"
        if not ((src / "lib.rs").exists() or (src / "main.rs").exists()):
            continue
        crates += 1
        files = [f for f in tracked(str(src.relative_to(ROOT)) + "/*.rs") if "/bin/" not in str(f)]
        edges = crate_graph(src, files)
        for comp in circles(edges):
            failed += 1
            names = [str(f.relative_to(ROOT)) for f in comp]
            print(f"import circle: {', '.join(names)}", file=sys.stderr)
            for a in comp:
                for b in comp:
                    if (a, b) in edges:
                        tied = ", ".join(sorted(edges[(a, b)]))
                        print(f"  {a.relative_to(ROOT)} -> {b.relative_to(ROOT)}: {tied}", file=sys.stderr)
    if failed:
        print(f"{failed} import circle(s): move what both sides need into a file both can import", file=sys.stderr)
        return 1
    print(f"no import circle in {crates} crates")
    return 0


if __name__ == "__main__":
    sys.exit(main())
