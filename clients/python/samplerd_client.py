"""A small Python client kit for samplerd.v1.Sampler.

    import samplerd_client as sc
    channel, stub = sc.connect("127.0.0.1:50051")
    r = sc.sample_logits(stub, np.array([0.5, 4.0, 1.0]), temperature=0.0)

The gRPC stubs are generated from the repository's proto/ with grpcio-tools
on first import (and again whenever the proto is newer) into gen/ beside
this file, which git ignores; `python samplerd_client.py` just generates.
Needs grpcio, grpcio-tools, grpcio-status, googleapis-common-protos, numpy.
"""

import os
import queue
import sys
from dataclasses import dataclass, field

import grpc
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_DIR = os.environ.get("SAMPLERD_PROTO_DIR", os.path.join(HERE, "..", "..", "proto"))
GEN_DIR = os.environ.get("SAMPLERD_PY_GEN_DIR", os.path.join(HERE, "gen"))
PROTO = "samplerd/v1/sampler.proto"

# The server takes messages up to limits.max_message_bytes (64 MiB by
# default); grpcio would otherwise stop at 4 MiB received.
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
]


def generate_stubs(out_dir=GEN_DIR, proto_dir=PROTO_DIR):
    """Runs grpc_tools.protoc: sampler_pb2.py and sampler_pb2_grpc.py."""
    import grpc_tools
    from grpc_tools import protoc

    os.makedirs(out_dir, exist_ok=True)
    well_known = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    rc = protoc.main([
        "grpc_tools.protoc",
        f"-I{proto_dir}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        PROTO,
    ])
    if rc != 0:
        raise RuntimeError(f"protoc failed on {os.path.join(proto_dir, PROTO)}")
    for d in ("samplerd", os.path.join("samplerd", "v1")):
        open(os.path.join(out_dir, d, "__init__.py"), "a").close()


def _load_stubs():
    generated = os.path.join(GEN_DIR, "samplerd", "v1", "sampler_pb2_grpc.py")
    proto = os.path.join(PROTO_DIR, PROTO)
    if not os.path.exists(generated) or os.path.getmtime(generated) < os.path.getmtime(proto):
        generate_stubs()
    if GEN_DIR not in sys.path:
        sys.path.insert(0, GEN_DIR)
    from samplerd.v1 import sampler_pb2, sampler_pb2_grpc

    return sampler_pb2, sampler_pb2_grpc


pb, pb_grpc = _load_stubs()


def connect(address, *, credentials=None, ready_timeout=10.0):
    """A channel and a SamplerStub, once the channel is connected (bounded:
    grpc.FutureTimeoutError after ready_timeout seconds). `address` is
    host:port; samplerctl's http:// form (its SAMPLERD_ADDR) is taken too."""
    address = address.removeprefix("http://")
    if credentials is None:
        channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    else:
        channel = grpc.secure_channel(address, credentials, options=CHANNEL_OPTIONS)
    grpc.channel_ready_future(channel).result(timeout=ready_timeout)
    return channel, pb_grpc.SamplerStub(channel)


def f32le(logits):
    """Logits as `logits_f32le`: little-endian IEEE-754 f32, 4 bytes each.

    '<f4' (not float32, which is the host's order) makes the bytes right on
    any machine; asarray copies only when the dtype or order differs.
    """
    a = np.asarray(logits, dtype="<f4")
    if a.ndim != 1:
        raise ValueError(f"logits must be one-dimensional, got shape {a.shape}")
    return a.tobytes()


def sparse_row(logits, n):
    """The top `n` of a row as a `SparseLogits` (the `sparse` field of
    SampleRequest, SampleStreamRequest and the batch rows): the ids of the
    n largest logits (ascending: the server's cheapest order; among equal
    values at the cut any may be taken) with their f32 values, the
    log-sum-exp of every other logit computed in float64 (-inf when nothing
    is left, or all of it is -inf), and the row's length.

    The server answers exactly what the whole row would, or refuses with
    FAILED_PRECONDITION when the chain needs more of it (docs/API.md,
    "Sparse rows").
    """
    a = np.asarray(logits, dtype=np.float32)
    if a.ndim != 1:
        raise ValueError(f"logits must be one-dimensional, got shape {a.shape}")
    if not 1 <= n <= a.size:
        raise ValueError(f"n must be in [1, {a.size}], got {n}")
    ids = np.sort(np.argpartition(-a, n - 1)[:n]) if n < a.size else np.arange(a.size)
    rest = np.delete(a, ids).astype(np.float64)
    top = rest.max() if rest.size else -np.inf
    if top == -np.inf:
        lse = -np.inf
    else:
        lse = top + np.log(np.sum(np.exp(rest - top)))
    return pb.SparseLogits(ids=ids.tolist(), values=a[ids].tolist(), rest_logsumexp=float(lse), vocab_size=a.size)


def sample_logits(stub, logits, *, step=0, previous_tokens=(), n_probs=0, timeout=10.0, **params):
    """One stateless Sample step with the logits (a numpy array or any
    sequence of floats) sent as raw bytes. Keyword arguments beyond the
    request's own are SamplingParams fields (temperature=0.0, seed=7, ...);
    unset ones take the server's defaults. Returns the SampleResponse."""
    req = pb.SampleRequest(
        logits_f32le=f32le(logits),
        previous_tokens=list(previous_tokens),
        params=pb.SamplingParams(**params),
        step=step,
        n_probs=n_probs,
    )
    return stub.Sample(req, timeout=timeout)


class SampleStream:
    """One sequence over SampleStream, one step at a time.

    The first message carries the parameters, the initial penalty window
    and the first step; the server then appends each chosen token to the
    window and counts the steps, so `step()` sends only logits:

        with SampleStream(stub, temperature=0.0) as s:
            r0 = s.step(logits0)
            r1 = s.step(logits1)
    """

    def __init__(self, stub, *, previous_tokens=(), first_step=0, timeout=60.0, **params):
        self._requests = queue.Queue()
        self._first = pb.SampleStreamRequest(
            previous_tokens=list(previous_tokens),
            params=pb.SamplingParams(**params),
            first_step=first_step,
        )
        self._sent_first = False
        # grpcio sends what the iterator yields, from its own thread; None
        # (from close) ends the iterator and so half-closes the stream.
        self._call = stub.SampleStream(iter(self._requests.get, None), timeout=timeout)

    def step(self, logits, *, n_probs=0):
        msg = pb.SampleStreamRequest(logits_f32le=f32le(logits), n_probs=n_probs)
        if not self._sent_first:
            msg.MergeFrom(self._first)
            self._sent_first = True
        self._requests.put(msg)
        return next(self._call)

    def close(self):
        self._requests.put(None)
        for _ in self._call:  # the server ends the stream after our half-close
            pass

    def cancel(self):
        self._call.cancel()
        self._requests.put(None)  # ends the request iterator's thread too

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is None:
            self.close()
        else:
            self.cancel()


class Generation:
    """A streaming Generate call: iterate for Token messages; `finished`
    holds the Finished event once the iteration ends. `cancel()` stops it
    (the server stops generating): the iteration then raises grpc.RpcError
    with code CANCELLED and yields nothing more. A loop left early without
    cancel() leaves the server generating until max_tokens or the deadline."""

    def __init__(self, call):
        self._call = call
        self._cancelled = False
        self.tokens = []
        self.finished = None

    def __iter__(self):
        for msg in self._call:
            if self._cancelled:
                continue  # one already-received event; the error follows
            if msg.HasField("token"):
                self.tokens.append(msg.token)
                yield msg.token
            else:
                self.finished = msg.finished
        if self.finished is None and not self._cancelled:
            raise RuntimeError("Generate ended without a Finished event")

    def cancel(self):
        self._cancelled = True
        self._call.cancel()

    @property
    def text(self):
        tail = self.finished.text if self.finished is not None else ""
        return "".join(t.text for t in self.tokens) + tail


def generate(stub, prompt=None, *, messages=(), max_tokens=None, stop=(), ignore_eos=False, n_probs=0, timeout=60.0, **params):
    """Starts a streamed Generate (the server needs a model). `messages` is
    a list of (role, content) pairs, rendered with the model's chat template;
    else `prompt` is used raw. `timeout` is the call's deadline: past it the
    iteration raises grpc.RpcError DEADLINE_EXCEEDED. Other keyword
    arguments are SamplingParams fields."""
    req = pb.GenerateRequest(
        prompt=prompt or "",
        messages=[pb.ChatMessage(role=r, content=c) for r, c in messages],
        params=pb.SamplingParams(**params),
        stop=list(stop),
        ignore_eos=ignore_eos,
        n_probs=n_probs,
    )
    if max_tokens is not None:
        req.max_tokens = max_tokens
    return Generation(stub.Generate(req, timeout=timeout))


@dataclass
class RichError:
    """The google.rpc.Status of a failed call, samplerd's details picked out."""

    code: int
    message: str
    reason: str = ""  # ErrorInfo.reason, e.g. SAMPLERD_PARAM_OUT_OF_RANGE
    domain: str = ""  # ErrorInfo.domain: "samplerd.v1"
    metadata: dict = field(default_factory=dict)  # ErrorInfo.metadata
    field_violations: list = field(default_factory=list)  # BadRequest: [(field, description)]
    retry_delay_s: float = None  # RetryInfo
    resource: tuple = None  # ResourceInfo: (type, name)
    details: list = field(default_factory=list)  # every detail, unpacked where known


def rich_error(err):
    """Decodes the grpc-status-details-bin trailer of a failed call (a
    grpc.RpcError) into a RichError; None when the server sent none."""
    from google.rpc import error_details_pb2 as ed
    from grpc_status import rpc_status

    st = rpc_status.from_call(err)
    if st is None:
        return None
    out = RichError(code=st.code, message=st.message)
    known = [ed.ErrorInfo, ed.BadRequest, ed.RetryInfo, ed.ResourceInfo, ed.DebugInfo,
             ed.QuotaFailure, ed.PreconditionFailure, ed.RequestInfo, ed.Help, ed.LocalizedMessage]
    for any_msg in st.details:
        cls = next((c for c in known if any_msg.Is(c.DESCRIPTOR)), None)
        if cls is None:
            out.details.append(any_msg)
            continue
        d = cls()
        any_msg.Unpack(d)
        out.details.append(d)
        if cls is ed.ErrorInfo:
            out.reason, out.domain, out.metadata = d.reason, d.domain, dict(d.metadata)
        elif cls is ed.BadRequest:
            out.field_violations += [(v.field, v.description) for v in d.field_violations]
        elif cls is ed.RetryInfo:
            out.retry_delay_s = d.retry_delay.seconds + d.retry_delay.nanos / 1e9
        elif cls is ed.ResourceInfo:
            out.resource = (d.resource_type, d.resource_name)
    return out


def describe_error(err):
    """A failed call in a few lines, rich details included."""
    lines = [f"{err.code().name}: {err.details()}"]
    rich = rich_error(err)
    if rich is None:
        lines.append("  (no grpc-status-details-bin trailer)")
        return "\n".join(lines)
    if rich.reason:
        meta = "".join(f" {k}={v}" for k, v in sorted(rich.metadata.items()))
        lines.append(f"  reason: {rich.reason} (domain {rich.domain}){meta}")
    lines += [f"  field {f}: {d}" for f, d in rich.field_violations]
    if rich.retry_delay_s is not None:
        lines.append(f"  retry after {rich.retry_delay_s:g} s")
    if rich.resource is not None:
        lines.append(f"  resource: {rich.resource[0]} {rich.resource[1]}")
    return "\n".join(lines)


if __name__ == "__main__":
    generate_stubs()
    print(f"generated {PROTO} stubs in {GEN_DIR}")
