#!/usr/bin/env python3
"""What resuming a Generate costs (docs/PERFORMANCE.md, "Resuming a
Generate"): two `samplerd serve` on loopback with the default model, one
with the prompt cache (generate.prompt_cache_entries = 4) and one without
(0), as two replicas of a fleet.

Each round generates MAX_TOKENS tokens (seeded, ignore_eos, a new seed per
round) and cuts the stream after CUT of them on the cached server (the
client cancels: its session goes to the cache, as when the connection
broke). Then, alternating which goes first:
  - `uninterrupted`: the whole request, fresh, on the uncached server —
    its time to the first token, and from token CUT to Finished;
  - `resume, cached`: the same request with `resume.token_ids` = the CUT
    tokens on the replica that ran it (its prompt cache holds the session);
  - `resume, uncached`: the same on the other replica (the prompt is
    prefilled and the CUT tokens replayed one decode step each).
Each resumed stream must equal the uninterrupted run's tail (tokens, text,
Finished) — the script fails otherwise. Prints medians (min–max) of the
time to the first resumed token and to Finished.

  cargo build --release --workspace
  $SAMPLERD_VENV/bin/python scripts/bench-resume.py [--rounds 6] [--max-tokens 96] [--cut 48]
"""

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "clients", "python"))
import samplerd_client as sc  # noqa: E402

pb = sc.pb

QUESTION = ("You are a support assistant of a small bicycle shop: answer politely, mention opening hours only "
            "when asked, never invent prices. Question {}: can you true a wheel by Friday, and what does a "
            "full service include?")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(binary, model, cache_entries, log_dir, name):
    port = free_port()
    env = dict(os.environ, SAMPLERD_METRICS__LISTEN="127.0.0.1:0",
               SAMPLERD_GENERATE__PROMPT_CACHE_ENTRIES=str(cache_entries))
    log = open(os.path.join(log_dir, f"{name}.log"), "wb")
    proc = subprocess.Popen([binary, "serve", "--model", model, "--listen", f"127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    return proc, f"127.0.0.1:{port}"


def request(rnd, max_tokens, resume=()):
    req = pb.GenerateRequest(
        messages=[pb.ChatMessage(role="user", content=QUESTION.format(rnd))],
        params=pb.SamplingParams(seed=1000 + rnd, temperature=0.8, top_k=40),
        max_tokens=max_tokens, ignore_eos=True)
    req.resume.token_ids[:] = list(resume)
    return req


def run(stub, req, cut=None):
    """(tokens, Finished, seconds to the first token, seconds from the
    start to Finished, seconds from token `cut` to Finished)."""
    t0 = time.perf_counter()
    first = at_cut = None
    tokens, finished = [], None
    for msg in stub.Generate(req, timeout=300):
        now = time.perf_counter()
        if msg.HasField("token"):
            first = first if first is not None else now
            tokens.append(msg.token)
            if cut is not None and len(tokens) == cut:
                at_cut = now
        else:
            finished = msg.finished
    end = time.perf_counter()
    return tokens, finished, first - t0, end - t0, (end - at_cut) if at_cut is not None else None


def cut_run(stub, req, cut):
    call = stub.Generate(req, timeout=300)
    ids = []
    for msg in call:
        if msg.HasField("token"):
            ids.append(msg.token.token_id)
            if len(ids) == cut:
                call.cancel()
                break
    return ids


def summary(xs):
    return f"{statistics.median(xs) * 1e3:8.1f} ({min(xs) * 1e3:.1f}–{max(xs) * 1e3:.1f})"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--cut", type=int, default=48)
    args = ap.parse_args()
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    binary = os.environ.get("SAMPLERD_BIN", os.path.join(target, "release", "samplerd"))
    model = os.environ.get("SAMPLERD_MODEL", os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    logs = tempfile.mkdtemp(prefix="bench-resume-")
    procs = []
    try:
        cached_proc, cached_addr = start(binary, model, 4, logs, "cached")
        uncached_proc, uncached_addr = start(binary, model, 0, logs, "uncached")
        procs = [cached_proc, uncached_proc]
        _, cached = sc.connect(cached_addr, ready_timeout=120)
        _, uncached = sc.connect(uncached_addr, ready_timeout=120)
        # Warm both (model pages, thread pools).
        for stub in (cached, uncached):
            run(stub, request(-1, 8))
        times = {k: [] for k in ("fresh first", "tail", "cached first", "cached end", "uncached first",
                                 "uncached end")}
        for rnd in range(args.rounds):
            ids = cut_run(cached, request(rnd, args.max_tokens), args.cut)
            jobs = [
                ("uninterrupted", lambda: run(uncached, request(rnd, args.max_tokens), cut=args.cut)),
                ("cached", lambda: run(cached, request(rnd, args.max_tokens, ids))),
                ("uncached", lambda: run(uncached, request(rnd, args.max_tokens, ids))),
            ]
            if rnd % 2:
                jobs.reverse()
            out = {name: job() for name, job in jobs}
            whole = out["uninterrupted"]
            if [t.token_id for t in whole[0][:args.cut]] != ids:
                sys.exit(f"round {rnd}: the cut run's tokens differ from the uninterrupted run's")
            for name in ("cached", "uncached"):
                tokens, fin = out[name][0], out[name][1]
                if ([t.SerializeToString() for t in tokens] != [t.SerializeToString() for t in whole[0][args.cut:]]
                        or fin.text != whole[1].text or fin.finish_reason != whole[1].finish_reason):
                    sys.exit(f"round {rnd}: the resume on the {name} replica differs from the uninterrupted run")
                if fin.usage.resumed_tokens != args.cut:
                    sys.exit(f"round {rnd}: usage.resumed_tokens = {fin.usage.resumed_tokens}, not {args.cut}")
                times[f"{name} first"].append(out[name][2])
                times[f"{name} end"].append(out[name][3])
            times["fresh first"].append(whole[2])
            times["tail"].append(whole[4])
            print(f"round {rnd}: resumed streams equal the uninterrupted run's last "
                  f"{args.max_tokens - args.cut} tokens", flush=True)
        print(f"\n{args.rounds} rounds, {args.max_tokens} tokens cut after {args.cut}; ms, median (min–max)")
        print(f"{'':<34} {'to the first token':>26} {'to Finished':>26}")
        print(f"{'uninterrupted (its last tokens)':<34} {summary(times['fresh first']):>26} "
              f"{summary(times['tail']):>26}")
        print(f"{'resumed, prompt cache holds it':<34} {summary(times['cached first']):>26} "
              f"{summary(times['cached end']):>26}")
        print(f"{'resumed, other replica (no cache)':<34} {summary(times['uncached first']):>26} "
              f"{summary(times['uncached end']):>26}")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    main()
