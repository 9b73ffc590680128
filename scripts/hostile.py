"""Hostile load against a running samplerd (the last phase of scripts/soak.sh).

For --seconds, at once:
  - oversized Generate requests (16 MB prompts): must be RESOURCE_EXHAUSTED;
  - Sample requests whose logit_bias has more entries than the vocabulary:
    must be INVALID_ARGUMENT (or RESOURCE_EXHAUSTED once the budget is full);
  - SampleStream sessions at 262,144 logits opened and held (up to
    --streams): each is served or refused with RESOURCE_EXHAUSTED (memory
    budget or stream limit), never anything else;
  - --idle-connections TCP connections that never send a byte, reopened
    when the server closes them (handshake deadline);
  - hostile constraints (deep GBNF nesting, long GBNF/Lark rule chains,
    JSON Schema $ref chains and cycles, a 90,000-literal Lark alternation,
    deep regex groups, an exponential regex, and schemas that are legal but
    take seconds to compile, each new so the cache cannot answer), through
    Generate (the model's vocabulary) and, with --vocabulary, Sample: each
    refused (INVALID_ARGUMENT over a limit, RESOURCE_EXHAUSTED when the
    compile budget, the compile queue or the memory budget refuses it) or
    served, never anything else;
while health is checked every 20 ms (latency recorded) and the server's RSS
(/proc/PID/status) is sampled; health runs in a process of its own. Prints one JSON line and exits non-zero if a
request got an unexpected status, the server died, health p99 reached
--health-p99-ms, or the RSS went over --max-rss-bytes.

Usage: python scripts/hostile.py --addr 127.0.0.1:50051 --pid PID
       [--seconds 30] [--max-rss-bytes N]
Needs grpcio and grpcio-tools (the test venv, scripts/setup-python.sh).
"""

import argparse
import importlib.util
import json
import os
import socket
import struct
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEALTH_PERIOD_S = 0.02
VOCAB = 262_144


def load_stub_generator():
    path = os.path.join(ROOT, "tests", "python", "harness.py")
    spec = importlib.util.spec_from_file_location("samplerd_test_harness", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.generate_stubs


def rss_bytes(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def health_loop(addr, seconds, stub_dir, out):
    """Health checks every 20 ms in a process of its own (spawned), so the
    latencies are the server's, not this client's GIL: [ms, ...] or an
    error code, sent on `out`."""
    import grpc

    sys.path.insert(0, stub_dir)
    from samplerd_health import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(addr))
    stop = time.monotonic() + seconds
    latencies, failures = [], []
    while time.monotonic() < stop:
        t0 = time.monotonic()
        try:
            stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        except grpc.RpcError as e:
            failures.append(e.code().name)
        latencies.append((time.monotonic() - t0) * 1e3)
        time.sleep(HEALTH_PERIOD_S)
    out.send((latencies, failures))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--addr", required=True)
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--idle-connections", type=int, default=200)
    ap.add_argument("--health-p99-ms", type=float, default=100)
    ap.add_argument("--max-rss-bytes", type=int, default=0, help="0: not checked")
    ap.add_argument("--vocabulary", default="",
                    help="a [vocabularies] name for constrained Sample requests (its token count: --vocab-size)")
    ap.add_argument("--vocab-size", type=int, default=49152)
    args = ap.parse_args()

    import multiprocessing

    tmp = tempfile.TemporaryDirectory(prefix="samplerd-hostile-")
    load_stub_generator()(tmp.name)
    # Spawned before this process opens any channel (gRPC and fork do not
    # mix), and spawned rather than forked for the same reason.
    receive, send = multiprocessing.Pipe(duplex=False)
    checker = multiprocessing.get_context("spawn").Process(
        target=health_loop, args=(args.addr, args.seconds, tmp.name, send))
    checker.start()

    import grpc

    from samplerd.v1 import sampler_pb2 as pb, sampler_pb2_grpc as pbg

    opts = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    stop = time.monotonic() + args.seconds
    lock = threading.Lock()
    codes = {}  # (what, code) -> count
    unexpected = []

    def record(what, code, allowed):
        with lock:
            codes[f"{what}:{code}"] = codes.get(f"{what}:{code}", 0) + 1
            if code not in allowed and len(unexpected) < 20:
                unexpected.append(f"{what}: {code}")

    def oversized_prompts():
        stub = pbg.SamplerStub(grpc.insecure_channel(args.addr, options=opts))
        prompt = "x" * (16 << 20)
        while time.monotonic() < stop:
            try:
                for _ in stub.Generate(pb.GenerateRequest(prompt=prompt), timeout=10):
                    pass
                record("oversized-generate", "OK", set())
            except grpc.RpcError as e:
                record("oversized-generate", e.code().name, {"RESOURCE_EXHAUSTED"})

    def big_bias():
        stub = pbg.SamplerStub(grpc.insecure_channel(args.addr, options=opts))
        logits = struct.pack(f"<{1000}f", *([0.5] * 1000))
        bias = {i: 1.0 for i in range(200_000)}
        req = pb.SampleRequest(logits_f32le=logits, params=pb.SamplingParams(logit_bias=bias))
        while time.monotonic() < stop:
            try:
                stub.Sample(req, timeout=10)
                record("big-bias", "OK", set())
            except grpc.RpcError as e:
                # Refused by its entries, or by the budget first when the
                # held streams have filled it.
                record("big-bias", e.code().name, {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"})

    def held_streams():
        stub = pbg.SamplerStub(grpc.insecure_channel(args.addr, options=opts))
        logits = struct.pack(f"<{VOCAB}f", *([0.25] * VOCAB))
        held = []
        while time.monotonic() < stop:
            if len(held) >= args.streams:
                time.sleep(0.05)
                continue
            gate = threading.Event()

            def requests():
                yield pb.SampleStreamRequest(logits_f32le=logits)
                gate.wait(args.seconds + 5)

            try:
                it = stub.SampleStream(requests(), timeout=args.seconds + 30)
                next(it)
                record("held-stream", "OK", {"OK"})
                held.append((gate, it))
            except grpc.RpcError as e:
                gate.set()
                record("held-stream", e.code().name, {"RESOURCE_EXHAUSTED"})
                time.sleep(0.05)
        for gate, _ in held:
            gate.set()

    def idle_connections():
        host, port = args.addr.rsplit(":", 1)
        socks = []
        closed = 0
        while time.monotonic() < stop:
            while len(socks) < args.idle_connections:
                try:
                    socks.append(socket.create_connection((host, int(port)), timeout=5))
                except OSError:
                    break
            alive = []
            for s in socks:
                s.setblocking(False)
                try:
                    data = s.recv(1)
                    if data == b"":
                        closed += 1
                        s.close()
                        continue
                except BlockingIOError:
                    pass
                except OSError:
                    closed += 1
                    s.close()
                    continue
                alive.append(s)
            socks = alive
            time.sleep(0.2)
        with lock:
            codes["idle-connections:closed-by-server"] = closed
        for s in socks:
            s.close()

    def grammars():
        """Hostile constraints, one after another; a legal but slow schema
        is made new each time (its property names), so only the compile
        budget answers it."""
        stub = pbg.SamplerStub(grpc.insecure_channel(args.addr, options=opts))
        refused = {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}
        cases = [
            ("gbnf-nest", "gbnf", "root ::= " + "(" * 5000 + '"a"' + ")" * 5000, refused),
            ("gbnf-chain", "gbnf", "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(1000))
             + 'r1000 ::= "a"\n', refused),
            ("lark-chain", "lark", "start: a0\n" + "".join(f"a{i}: a{i + 1}\n" for i in range(700))
             + 'a700: "a"\n', refused),
            ("lark-alternation", "lark", "start: " + " | ".join(f'"w{i}"' for i in range(90_000)), refused),
            ("json-ref-chain", "json_schema", json.dumps({
                "$ref": "#/$defs/a0",
                "$defs": {**{f"a{i}": {"$ref": f"#/$defs/a{i + 1}"} for i in range(700)},
                          "a700": {"type": "string"}}}), refused),
            ("json-ref-cycle", "json_schema", json.dumps({
                "$ref": "#/$defs/a0",
                "$defs": {f"a{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/a{(i + 1) % 200}"}}}
                          for i in range(200)}}), refused),
            ("regex-nest", "regex", "(" * 5000 + "a" + ")" * 5000, refused),
            ("regex-blowup", "regex", "[ab]*a[ab]{30}", refused | {"OK"}),
        ]
        n = 0
        while time.monotonic() < stop:
            n += 1
            slow = json.dumps({"type": "object", "properties": {
                f"s{n}p{i}": {"type": "string"} for i in range(3000)}})
            for name, kind, text, allowed in cases + [("slow-schema", "json_schema", slow, refused | {"OK"})]:
                if time.monotonic() >= stop:
                    break
                params = pb.SamplingParams(seed=1, constraint=pb.Constraint(**{kind: text}))
                try:
                    for _ in stub.Generate(pb.GenerateRequest(prompt="x", max_tokens=1, params=params),
                                           timeout=30):
                        pass
                    record(f"grammar-generate-{name}", "OK", allowed)
                except grpc.RpcError as e:
                    record(f"grammar-generate-{name}", e.code().name, allowed)
                if not args.vocabulary:
                    continue
                params.vocabulary = args.vocabulary
                logits = struct.pack(f"<{args.vocab_size}f", *([0.5] * args.vocab_size))
                try:
                    stub.Sample(pb.SampleRequest(logits_f32le=logits, params=params), timeout=30)
                    record(f"grammar-sample-{name}", "OK", allowed)
                except grpc.RpcError as e:
                    record(f"grammar-sample-{name}", e.code().name, allowed)

    threads = [threading.Thread(target=f, daemon=True)
               for f in (oversized_prompts, big_bias, held_streams, idle_connections, grammars)]
    for t in threads:
        t.start()

    rss_max, died = 0, False
    while time.monotonic() < stop:
        try:
            rss_max = max(rss_max, rss_bytes(args.pid))
        except OSError:
            died = True
            break
        time.sleep(0.1)
    latencies, failures = receive.recv() if receive.poll(30) else ([], ["no report"])
    checker.join(timeout=10)
    for f in failures:
        record("health", f, {"OK"})
    for t in threads:
        t.join(timeout=args.seconds + 40)

    latencies.sort()
    p = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else float("nan")
    report = {
        "seconds": args.seconds,
        "health_checks": len(latencies),
        "health_p50_ms": round(p(0.50), 2),
        "health_p99_ms": round(p(0.99), 2),
        "rss_max_mib": round(rss_max / (1 << 20), 1),
        "codes": codes,
        "unexpected": unexpected,
        "server_died": died,
    }
    print(json.dumps(report, sort_keys=True))
    ok = (not unexpected and not died and latencies and p(0.99) < args.health_p99_ms
          and (args.max_rss_bytes == 0 or rss_max <= args.max_rss_bytes))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
