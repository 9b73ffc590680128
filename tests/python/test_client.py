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
import struct
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import ROOT, Checks, free_port, generate_stubs, wait_serving  # noqa: E402

RPC_TIMEOUT_S = 10.0


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
    checks = Checks()
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
                checks.run(name[2:], fn)
    except Exception:
        checks.fail()
    finally:
        proc.kill()
        _, err = proc.communicate(timeout=10)
        if checks.failed:
            sys.stderr.write(err.decode(errors="replace")[-4000:])
        tmp.cleanup()
    return checks.exit_code()


if __name__ == "__main__":
    sys.exit(main())
