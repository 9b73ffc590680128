#!/usr/bin/env python3
"""Python client test for samplerd: proof that a non-Rust client works from
the proto alone.

Generates stubs from proto/ with grpcio-tools into a temporary directory,
starts `samplerd serve` on a free port, waits (bounded) for the standard
health check to report SERVING, runs Sample / SampleStream / ListStages
checks and kills the server at the end. Prints "N passed, M failed" and
exits non-zero on any failure.

    python3 tests/python/test_client.py --server-bin target/debug/samplerd

Needs grpcio + grpcio-tools (the venv from scripts/setup-python.sh).
"""

import argparse
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEALTH_TIMEOUT_S = 20.0
RPC_TIMEOUT_S = 10.0

# The standard gRPC health protocol (grpc/health/v1/health.proto, trimmed to
# Check); generated alongside samplerd's proto.
HEALTH_PROTO = """
syntax = "proto3";
package grpc.health.v1;
message HealthCheckRequest { string service = 1; }
message HealthCheckResponse {
  enum ServingStatus { UNKNOWN = 0; SERVING = 1; NOT_SERVING = 2; SERVICE_UNKNOWN = 3; }
  ServingStatus status = 1;
}
service Health { rpc Check(HealthCheckRequest) returns (HealthCheckResponse); }
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def generate_stubs(out_dir):
    from grpc_tools import protoc
    import grpc_tools

    health_dir = os.path.join(out_dir, "protos")
    # File path samplerd_health/ (not grpc/, which would shadow grpcio);
    # the proto package, and so the wire name, stays grpc.health.v1.
    os.makedirs(os.path.join(health_dir, "samplerd_health"))
    with open(os.path.join(health_dir, "samplerd_health", "health.proto"), "w") as f:
        f.write(HEALTH_PROTO)
    well_known = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    for include, proto in [
        (os.path.join(ROOT, "proto"), "samplerd/v1/sampler.proto"),
        (health_dir, "samplerd_health/health.proto"),
    ]:
        rc = protoc.main([
            "grpc_tools.protoc",
            f"-I{include}",
            f"-I{well_known}",
            f"--python_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            proto,
        ])
        if rc != 0:
            raise RuntimeError(f"protoc failed for {proto}")
    for d in ["samplerd", "samplerd/v1", "samplerd_health"]:
        open(os.path.join(out_dir, d, "__init__.py"), "a").close()
    sys.path.insert(0, out_dir)


def wait_serving(channel, health_pb2, health_grpc, proc):
    stub = health_grpc.HealthStub(channel)
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    last = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"samplerd exited with {proc.returncode}")
        try:
            r = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
            if r.status == health_pb2.HealthCheckResponse.SERVING:
                return
            last = r.status
        except Exception as e:  # not listening yet
            last = e
        time.sleep(0.05)
    raise RuntimeError(f"samplerd not SERVING within {HEALTH_TIMEOUT_S}s (last: {last})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server-bin", default=os.environ.get("SAMPLERD_BIN", os.path.join(ROOT, "target", "debug", "samplerd")))
    args = ap.parse_args()
    server_bin = os.path.abspath(args.server_bin)

    import grpc

    tmp = tempfile.TemporaryDirectory(prefix="samplerd-py-")
    generate_stubs(tmp.name)
    from samplerd.v1 import sampler_pb2 as pb, sampler_pb2_grpc as pbg
    from samplerd_health import health_pb2, health_pb2_grpc

    port = free_port()
    env = dict(os.environ)
    env.pop("SAMPLERD_CONFIG", None)
    proc = subprocess.Popen(
        [server_bin, "serve", "--listen", f"127.0.0.1:{port}"],
        cwd=tmp.name,  # no samplerd.toml here: built-in defaults only
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    passed, failed = 0, 0
    opts = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=opts)
        wait_serving(channel, health_pb2, health_pb2_grpc, proc)
        stub = pbg.SamplerStub(channel)

        logits = [((i * 7919) % 1000) / 250.0 - 2.0 for i in range(32000)]
        best = 12345
        logits[best] = 10.0  # a unique maximum
        raw = struct.pack(f"<{len(logits)}f", *logits)

        def t_greedy_floats():
            r = stub.Sample(pb.SampleRequest(logits=logits, params=pb.SamplingParams(temperature=0.0)), timeout=RPC_TIMEOUT_S)
            assert r.token_id == best, (r.token_id, best)
            assert r.seed == 42, r.seed
            assert r.logprob < 0.0

        def t_bytes_equal_floats():
            a = stub.Sample(pb.SampleRequest(logits=logits, step=3), timeout=RPC_TIMEOUT_S)
            b = stub.Sample(pb.SampleRequest(logits_f32le=raw, step=3), timeout=RPC_TIMEOUT_S)
            assert a == b, (a, b)

        def t_n_probs():
            r = stub.Sample(pb.SampleRequest(logits_f32le=raw, n_probs=4), timeout=RPC_TIMEOUT_S)
            assert len(r.probs) == 4
            assert r.probs[0].token_id == best

        def t_invalid_argument():
            try:
                stub.Sample(pb.SampleRequest(logits=logits, params=pb.SamplingParams(top_p=1.5)), timeout=RPC_TIMEOUT_S)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.code()
                assert "top_p" in e.details() and "1.5" in e.details(), e.details()
                return
            raise AssertionError("top_p=1.5 accepted")

        def t_stream_equals_sample():
            window = [1, 2, 3]
            params = pb.SamplingParams(seed=9, repeat_penalty=1.3, top_k=50)
            steps = [[((i * (7 + s)) % 97) / 20.0 for i in range(500)] for s in range(10)]
            msgs = [
                pb.SampleStreamRequest(
                    logits=l,
                    previous_tokens=window if i == 0 else [],
                    params=params if i == 0 else None,
                )
                for i, l in enumerate(steps)
            ]
            streamed = list(stub.SampleStream(iter(msgs), timeout=RPC_TIMEOUT_S))
            assert len(streamed) == len(steps)
            prev = list(window)
            for t, l in enumerate(steps):
                r = stub.Sample(pb.SampleRequest(logits=l, previous_tokens=prev, params=params, step=t), timeout=RPC_TIMEOUT_S)
                assert r == streamed[t], (t, r, streamed[t])
                prev.append(r.token_id)

        def t_list_stages():
            r = stub.ListStages(pb.ListStagesRequest(), timeout=RPC_TIMEOUT_S)
            names = {s.name for s in r.stages}
            assert {"top_k", "dist", "greedy"} <= names, names
            assert r.default_chain[-1].name == "dist"

        def t_generate_without_model():
            try:
                list(stub.Generate(pb.GenerateRequest(prompt="hi"), timeout=RPC_TIMEOUT_S))
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.FAILED_PRECONDITION, e.code()
                return
            raise AssertionError("Generate without a model succeeded")

        for name, fn in list(locals().items()):
            if name.startswith("t_"):
                try:
                    fn()
                    passed += 1
                    print(f"ok   {name[2:]}")
                except Exception:
                    failed += 1
                    print(f"FAIL {name[2:]}")
                    traceback.print_exc()
    except Exception:
        failed += 1
        traceback.print_exc()
    finally:
        proc.kill()
        _, err = proc.communicate(timeout=10)
        if failed:
            sys.stderr.write(err.decode(errors="replace")[-4000:])
        tmp.cleanup()
    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 and passed > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
