#!/usr/bin/env python3
"""Structured output, checked from outside: `samplerd serve` with the
default model and plugins (core + constraint), Generate under a dozen JSON
Schemas, regexes and a choice, each completed output validated
independently (the `jsonschema` package; `re.fullmatch`), and the same
request + seed giving byte-identical text. Prints "N passed, M failed" and
exits non-zero on any failure.

    python3 tests/python/test_constraint.py --server-bin target/release/samplerd

Needs grpcio, grpcio-tools and jsonschema (the venv from
scripts/setup-python.sh) and the model (scripts/fetch-model.sh).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import jsonschema

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from harness import ROOT, Checks, free_port, generate_stubs, wait_serving  # noqa: E402

RPC_TIMEOUT_S = 120.0

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"], "additionalProperties": False},
    "integer_range": {"type": "integer", "minimum": 10, "maximum": 99},
    "array_max_items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 3},
    "string_pattern": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 1000}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2}},
                "required": ["id", "tags"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    "boolean_field": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    "review": {
        "type": "object",
        "properties": {"score": {"type": "integer", "minimum": 1, "maximum": 5}, "comment": {"type": "string", "maxLength": 12}},
        "required": ["score", "comment"],
        "additionalProperties": False,
    },
    "one_of": {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 5}, {"type": "string", "enum": ["none"]}]},
    "array_of_objects": {
        "type": "array",
        "items": {"type": "object", "properties": {"k": {"type": "string", "maxLength": 5}, "v": {"type": "integer", "minimum": -5, "maximum": 5}}, "required": ["k", "v"], "additionalProperties": False},
        "maxItems": 2,
    },
    "const_and_null": {"type": "object", "properties": {"kind": {"const": "point"}, "label": {"type": ["string", "null"], "maxLength": 10}}, "required": ["kind", "label"], "additionalProperties": False},
    "string_length": {"type": "string", "minLength": 3, "maxLength": 6, "pattern": "^[a-z]+$"},
}

# Bounded, so every seeded output completes within max_tokens (an unbounded
# one, `[a-z]+`, lets a sampled model ramble on; its prefix is still valid).
REGEXES = ["[0-9]{3}-[0-9]{4}", "(yes|no)", "[a-z]{1,10}@[a-z]{1,10}\\.(com|org)", "#[0-9a-f]{6}"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server-bin", default=os.environ.get("SAMPLERD_BIN", os.path.join(ROOT, "target", "release", "samplerd")))
    ap.add_argument("--model", default=os.environ.get("SAMPLERD_MODEL", os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")))
    args = ap.parse_args()
    if not os.path.isfile(args.model):
        print(f"test_constraint: model {args.model} missing (scripts/fetch-model.sh)")
        return 1

    import grpc

    tmp = tempfile.TemporaryDirectory(prefix="samplerd-constraint-")
    generate_stubs(tmp.name)
    from samplerd.v1 import sampler_pb2 as pb, sampler_pb2_grpc as pbg
    from samplerd_health import health_pb2, health_pb2_grpc

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAMPLERD_")}
    proc = subprocess.Popen(
        [os.path.abspath(args.server_bin), "serve", "--listen", f"127.0.0.1:{port}", "--model", os.path.abspath(args.model)],
        cwd=tmp.name,  # no samplerd.toml: the default plugins, core + constraint
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    checks = Checks()
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        wait_serving(channel, health_pb2, health_pb2_grpc, proc)
        stub = pbg.SamplerStub(channel)

        def generate(constraint, seed, prompt, must_stop=True):
            req = pb.GenerateRequest(
                messages=[pb.ChatMessage(role="user", content=prompt)],
                max_tokens=200,
                params=pb.SamplingParams(seed=seed, constraint=constraint),
            )
            text, reason = "", None
            for msg in stub.Generate(req, timeout=RPC_TIMEOUT_S):
                if msg.HasField("token"):
                    text += msg.token.text
                else:
                    text += msg.finished.text
                    reason = msg.finished.finish_reason
            if must_stop:
                assert reason == pb.STOP_TOKEN, (reason, text)
                return text
            return text, reason

        tests = []
        for name, schema in SCHEMAS.items():
            def t(name=name, schema=schema):
                c = pb.Constraint(json_schema=json.dumps(schema))
                for seed in (1, 2):
                    text = generate(c, seed, f"Give an example {name.replace('_', ' ')} as JSON.")
                    value = json.loads(text)
                    jsonschema.validate(value, schema)
                    again = generate(c, seed, f"Give an example {name.replace('_', ' ')} as JSON.")
                    assert again == text, (text, again)
            tests.append((f"json_schema {name}", t))
        for rx in REGEXES:
            def t(rx=rx):
                text = generate(pb.Constraint(regex=rx), 3, "Answer briefly.")
                assert re.fullmatch(rx, text), (rx, text)
            tests.append((f"regex {rx}", t))

        def t_choice():
            values = ["alpha", "beta", "gamma"]
            text = generate(pb.Constraint(choice=pb.StringList(values=values)), 4, "Pick one.")
            assert text in values, text
        tests.append(("choice", t_choice))

        def t_json_object():
            # Any object is allowed, so whether the model closes it within
            # max_tokens depends on its logits, which differ between CPU
            # kernel builds: of a few seeds, every output that stops must
            # be an object, and at least one must stop.
            stopped = 0
            for seed in range(5, 10):
                text, reason = generate(pb.Constraint(json_object=True), seed,
                                        "Reply with a small JSON object.", must_stop=False)
                assert text.lstrip().startswith("{"), text
                if reason == pb.STOP_TOKEN:
                    assert isinstance(json.loads(text), dict), text
                    stopped += 1
            assert stopped > 0, "no seed closed its JSON object within max_tokens"
        tests.append(("json_object", t_json_object))

        def t_invalid_schema():
            try:
                generate(pb.Constraint(json_schema='{"type": 7}'), 1, "x")
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.code()
                assert "params.constraint.json_schema" in e.details(), e.details()
                return
            raise AssertionError("an invalid schema was accepted")
        tests.append(("invalid schema", t_invalid_schema))

        for name, fn in tests:
            checks.run(name, fn)
    except Exception:
        checks.fail()
    finally:
        proc.kill()
        proc.wait()
    return checks.exit_code()


if __name__ == "__main__":
    sys.exit(main())
