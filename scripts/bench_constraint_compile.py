#!/usr/bin/env python3
"""Readiness and a plain Sample while hostile grammars compile.

Against a running samplerd with a model (Generate compiles against the
model's vocabulary), phases alternated for --rounds rounds:

  idle       nothing else runs;
  big-lark   --grammars clients at once, each sending Generate with the
             979 KB Lark alternation of 90,000 literals
             (`start: "w0" | "w1" | ...`, its first literal new each
             request so no cache answers), over and over;
  slow-json  the same with a legal JSON Schema that takes seconds to
             compile: one object of --properties optional string
             properties (just inside limits.max_constraint_rules at the
             default 4,000), new property names each request.

Throughout each phase a probe process asks readiness (gRPC health,
service "") and then sends a plain Sample (--vocab-size logits, default
parameters), every 20 ms. Prints one JSON line per phase: readiness
statuses and latency (p50/p99 ms), Sample codes and latency, and the
grammar requests' codes and answer times; then per phase kind the median
of the rounds' p50 and p99 with their spread (min-max).

Usage: python scripts/bench_constraint_compile.py --addr 127.0.0.1:50051
       [--rounds 3] [--seconds 8] [--grammars 6] [--phases idle,big-lark,slow-json]
Needs grpcio and grpcio-tools (the test venv, scripts/setup-python.sh).
"""

import argparse
import importlib.util
import json
import multiprocessing
import os
import statistics
import struct
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE_PERIOD_S = 0.02


def load_stub_generator():
    path = os.path.join(ROOT, "tests", "python", "harness.py")
    spec = importlib.util.spec_from_file_location("samplerd_test_harness", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.generate_stubs


def pct(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 2)


def probe(addr, seconds, vocab_size, stub_dir, out):
    """Readiness, then a plain Sample, every 20 ms, in a process of its
    own (spawned), so the latencies are the server's, not the grammar
    senders' GIL: (statuses, health ms, Sample codes, Sample ms) on `out`."""
    import grpc

    sys.path.insert(0, stub_dir)
    from samplerd.v1 import sampler_pb2 as pb, sampler_pb2_grpc as pbg
    from samplerd_health import health_pb2, health_pb2_grpc

    logits = struct.pack(f"<{vocab_size}f", *[((i * 7919) % 1000) / 100.0 for i in range(vocab_size)])
    channel = grpc.insecure_channel(addr)
    health = health_pb2_grpc.HealthStub(channel)
    sampler = pbg.SamplerStub(channel)
    ready, health_ms, sample_codes, sample_ms = {}, [], {}, []
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        t0 = time.monotonic()
        try:
            r = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            s = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
        except grpc.RpcError as e:
            s = e.code().name
        health_ms.append((time.monotonic() - t0) * 1e3)
        ready[s] = ready.get(s, 0) + 1
        t0 = time.monotonic()
        try:
            sampler.Sample(pb.SampleRequest(logits_f32le=logits), timeout=30)
            c = "OK"
        except grpc.RpcError as e:
            c = e.code().name
        sample_ms.append((time.monotonic() - t0) * 1e3)
        sample_codes[c] = sample_codes.get(c, 0) + 1
        time.sleep(PROBE_PERIOD_S)
    out.send((ready, health_ms, sample_codes, sample_ms))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--addr", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=8)
    ap.add_argument("--grammars", type=int, default=6)
    ap.add_argument("--properties", type=int, default=4000)
    ap.add_argument("--vocab-size", type=int, default=49152)
    ap.add_argument("--phases", default="idle,big-lark,slow-json")
    args = ap.parse_args()

    tmp = tempfile.TemporaryDirectory(prefix="samplerd-bench-")
    load_stub_generator()(tmp.name)
    import grpc

    from samplerd.v1 import sampler_pb2 as pb, sampler_pb2_grpc as pbg

    opts = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    serial = iter(range(1 << 62))
    serial_lock = threading.Lock()

    def fresh():
        with serial_lock:
            return next(serial)

    def big_lark():
        n = fresh()
        return pb.Constraint(lark=f'start: "n{n}" | ' + " | ".join(f'"w{i}"' for i in range(1, 90_000)))

    def slow_json():
        n = fresh()
        props = {f"s{n}p{i}": {"type": "string"} for i in range(args.properties)}
        return pb.Constraint(json_schema=json.dumps({"type": "object", "properties": props}))

    def phase(kind, make):
        stop = time.monotonic() + args.seconds
        grammar_codes, grammar_ms, messages = {}, [], {}
        lock = threading.Lock()

        def attacker():
            stub = pbg.SamplerStub(grpc.insecure_channel(args.addr, options=opts))
            while time.monotonic() < stop:
                req = pb.GenerateRequest(prompt="x", max_tokens=1,
                                         params=pb.SamplingParams(seed=1, constraint=make()))
                t0 = time.monotonic()
                try:
                    for _ in stub.Generate(req, timeout=120):
                        pass
                    c = "OK"
                except grpc.RpcError as e:
                    c = e.code().name
                    if c not in messages:
                        messages[c] = (e.details() or "")[:300]
                with lock:
                    grammar_ms.append((time.monotonic() - t0) * 1e3)
                    grammar_codes[c] = grammar_codes.get(c, 0) + 1

        receive, send = multiprocessing.Pipe(duplex=False)
        prober = multiprocessing.get_context("spawn").Process(
            target=probe, args=(args.addr, args.seconds, args.vocab_size, tmp.name, send))
        prober.start()
        threads = []
        if make is not None:
            threads = [threading.Thread(target=attacker) for _ in range(args.grammars)]
        for t in threads:
            t.start()
        ready, health_ms, sample_codes, sample_ms = receive.recv()
        prober.join(timeout=30)
        for t in threads:
            t.join(timeout=150)
        return {
            "phase": kind,
            "readiness": ready,
            "health_p50_ms": pct(health_ms, 0.5),
            "health_p99_ms": pct(health_ms, 0.99),
            "sample": sample_codes,
            "sample_p50_ms": pct(sample_ms, 0.5),
            "sample_p99_ms": pct(sample_ms, 0.99),
            "grammar": grammar_codes,
            "grammar_p50_ms": pct(grammar_ms, 0.5),
            "grammar_max_ms": pct(grammar_ms, 1.0),
            "grammar_messages": messages,
        }

    results = []
    for _ in range(args.rounds):
        kinds = {"idle": None, "big-lark": big_lark, "slow-json": slow_json}
        for kind in args.phases.split(","):
            make = kinds[kind]
            r = phase(kind, make)
            print(json.dumps(r), flush=True)
            results.append(r)
    for kind in args.phases.split(","):
        rs = [r for r in results if r["phase"] == kind]
        summary = {"summary": kind}
        for key in ["health_p50_ms", "health_p99_ms", "sample_p50_ms", "sample_p99_ms", "grammar_p50_ms"]:
            xs = [r[key] for r in rs if r[key] is not None]
            if xs:
                summary[key] = {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}
        summary["not_ready"] = sum(n for r in rs for s, n in r["readiness"].items() if s != "SERVING")
        summary["sample_failed"] = sum(n for r in rs for c, n in r["sample"].items() if c != "OK")
        print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    sys.exit(main())
