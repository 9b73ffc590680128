"""What the Python client tests share: stubs generated from proto/, a free
port, the bounded wait for SERVING, and the check runner that counts and
reports results. Not a test itself (the runner picks up test_*.py).
"""

import os
import socket
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEALTH_TIMEOUT_S = 20.0

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


class Checks:
    """Runs named checks, counting each pass and failure (with its
    traceback); a failure outside any check counts once too."""

    def __init__(self):
        self.passed = 0
        self.failed = 0

    def run(self, name, fn):
        try:
            fn()
            self.passed += 1
            print(f"ok   {name}")
        except Exception:
            self.fail(name)

    def fail(self, name=None):
        """Counts a failure that happened outside `run` (setup, teardown)."""
        self.failed += 1
        if name:
            print(f"FAIL {name}")
        traceback.print_exc()

    def exit_code(self):
        """Prints the totals: 0 when something ran and nothing failed."""
        print(f"{self.passed} passed, {self.failed} failed")
        return 0 if self.failed == 0 and self.passed > 0 else 1
