"""A small Python client kit for samplerd.v1.Sampler.

    import samplerd_client as sc
    channel, stub = sc.connect("127.0.0.1:50051")
    r = sc.sample_logits(stub, np.array([0.5, 4.0, 1.0]), temperature=0.0)

The gRPC stubs are generated from the repository's proto/ with grpcio-tools
on first import (and again whenever the proto is newer) into gen/ beside
this file, which git ignores; `python samplerd_client.py` just generates.
Needs grpcio, grpcio-tools, grpcio-status, googleapis-common-protos, numpy.
"""

import json
import os
import queue
import random
import sys
import time
from dataclasses import dataclass, field

import grpc
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_DIR = os.environ.get("SAMPLERD_PROTO_DIR", os.path.join(HERE, "..", "..", "proto"))
GEN_DIR = os.environ.get("SAMPLERD_PY_GEN_DIR", os.path.join(HERE, "gen"))
PROTO = "samplerd/v1/sampler.proto"

# clients/service-config.json: round_robin over every address the name
# resolves to, and retries of the idempotent RPCs (Sample, SampleBatch,
# ListStages, Tokenize, Detokenize, GetServerInfo, health Check) on
# UNAVAILABLE and RESOURCE_EXHAUSTED. gRPC's built-in retry cannot read
# RetryInfo (a message inside grpc-status-details-bin); it honours the
# grpc-retry-pushback-ms trailer, which samplerd sends with the same delay (and "-1", do not retry, on
# refusals that retrying cannot fix). The streams are not retried by gRPC
# once they have answered; SampleStream and Generate below resume them.
# An installed kit (pip install ./clients/python) has no checkout around it:
# its stubs and this config were put in the `samplerd` package at build time.
INSTALLED = not os.path.exists(os.path.join(PROTO_DIR, PROTO))
SERVICE_CONFIG_PATH = os.environ.get("SAMPLERD_SERVICE_CONFIG", os.path.join(HERE, "..", "service-config.json"))
if INSTALLED and "SAMPLERD_SERVICE_CONFIG" not in os.environ:
    from importlib.resources import files as _files

    SERVICE_CONFIG = json.loads(_files("samplerd").joinpath("service-config.json").read_text())
else:
    with open(SERVICE_CONFIG_PATH) as _f:
        SERVICE_CONFIG = json.load(_f)

# The server takes messages up to limits.max_message_bytes (64 MiB by
# default); grpcio would otherwise stop at 4 MiB received.
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.service_config", json.dumps(SERVICE_CONFIG)),
    ("grpc.enable_retries", 1),
]

# What a stream resumes on. A samplerd status (one with an ErrorInfo in the
# samplerd.v1 domain) is judged by the code it carries: UNAVAILABLE always
# (draining, the connection aged, no sampling thread), RESOURCE_EXHAUSTED
# only with a RetryInfo (a full queue frees up; an oversized message does
# not). A status samplerd did not send is the transport's or a proxy's: the
# call was lost on the way (a replica died, a balancer reset the stream),
# whatever code the client library made of it (UNAVAILABLE; CANCELLED or
# INTERNAL for a stream reset by a proxy) — resumable too. Deadlines and
# the client's own cancellation never are.
LOST_IN_TRANSIT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL,
                   grpc.StatusCode.UNKNOWN)
# Resumes in a row without progress before a stream gives up.
MAX_RESUMES = 5
# Windows a resumed stream sends at most (limits.max_window_tokens).
MAX_WINDOW_TOKENS = 65536


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
    if INSTALLED:
        from samplerd.v1 import sampler_pb2, sampler_pb2_grpc

        return sampler_pb2, sampler_pb2_grpc
    generated = os.path.join(GEN_DIR, "samplerd", "v1", "sampler_pb2_grpc.py")
    proto = os.path.join(PROTO_DIR, PROTO)
    if not os.path.exists(generated) or os.path.getmtime(generated) < os.path.getmtime(proto):
        generate_stubs()
    if GEN_DIR not in sys.path:
        sys.path.insert(0, GEN_DIR)
    from samplerd.v1 import sampler_pb2, sampler_pb2_grpc

    return sampler_pb2, sampler_pb2_grpc


pb, pb_grpc = _load_stubs()


def connect(address, *, credentials=None, ready_timeout=10.0, options=()):
    """A channel and a SamplerStub, once the channel is connected (bounded:
    grpc.FutureTimeoutError after ready_timeout seconds). `address` is
    host:port, or any gRPC target — `dns:///samplerd-headless.ns.svc:50051`
    for a fleet, `ipv4:10.0.0.1:50051,10.0.0.2:50051` — balanced round-robin
    with retries (clients/service-config.json), `unix:///path/samplerd.sock`
    for a Unix socket; samplerctl's http:// form
    (its SAMPLERD_ADDR) is taken too. `options` are more channel options."""
    address = address.removeprefix("http://")
    opts = CHANNEL_OPTIONS + list(options)
    if address.startswith("unix") and not any(k == "grpc.default_authority" for k, _ in opts):
        # grpcio (1.85) sends a Unix-socket target's path, percent-encoded,
        # as the :authority (`run%2Fsamplerd%2Fsamplerd.sock`), which the
        # server's HTTP/2 layer refuses: every call ends with RST_STREAM
        # PROTOCOL_ERROR, surfacing as INTERNAL.
        opts.append(("grpc.default_authority", "localhost"))
    if credentials is None:
        channel = grpc.insecure_channel(address, options=opts)
    else:
        channel = grpc.secure_channel(address, credentials, options=opts)
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


# Bytes per logit and the numpy dtype a SharedRows array has, by wire dtype
# (numpy has no bfloat16: a bf16 region is uint16, the top halves of f32s).
_SHARED_DTYPES = {"f32": (4, "<f4"), "f16": (2, "<f2"), "bf16": (2, "<u2")}


class SharedRows:
    """`rows` × `vocab` logits in a shared-memory region the server reads in
    place: no logits cross the socket (docs/API.md, "Shared-memory rows").

        with sc.shared_rows(stub, rows=8, vocab=151936) as shm:
            shm.array[3] = logits                    # numpy view, (rows, vocab)
            stub.Sample(pb.SampleRequest(shared=shm.row(3)))

    The region is a file in /dev/shm made by
    multiprocessing.shared_memory (the server must run on the same host or
    in the same pod, and may read files of this user: a Unix socket, or the
    same user over TCP). Leave a row alone until its response has arrived.
    `close()` (or leaving the `with`) unregisters and removes it; the
    server also releases it when this channel's connection closes.
    """

    def __init__(self, stub, rows, vocab, *, dtype="f32", name=None, metadata=None, timeout=10.0):
        from multiprocessing import shared_memory

        if dtype not in _SHARED_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_SHARED_DTYPES)}, got {dtype!r}")
        if rows < 1 or vocab < 1:
            raise ValueError(f"rows and vocab must be >= 1, got {rows} and {vocab}")
        width, np_dtype = _SHARED_DTYPES[dtype]
        self.stub, self.vocab, self.width, self.metadata = stub, vocab, width, metadata
        self.dtype = {"f32": pb.LOGITS_DTYPE_F32LE, "f16": pb.LOGITS_DTYPE_F16LE, "bf16": pb.LOGITS_DTYPE_BF16LE}[dtype]
        size = rows * vocab * width
        self.shm = shared_memory.SharedMemory(create=True, size=size, name=name)
        self.name = self.shm.name.lstrip("/")
        self.array = np.ndarray((rows, vocab), dtype=np_dtype, buffer=self.shm.buf)
        try:
            stub.RegisterSharedMemory(
                pb.RegisterSharedMemoryRequest(name=self.name, path=f"/dev/shm/{self.name}", byte_size=size),
                metadata=metadata,
                timeout=timeout,
            )
        except BaseException:
            self._release()
            raise

    def row(self, i, count=None):
        """The `SharedLogits` naming row `i` (its first `count` logits; all
        `vocab` by default) for SampleRequest.shared, SampleStreamRequest.shared,
        BatchRow.shared or BatchStreamRow.shared."""
        if not 0 <= i < self.array.shape[0]:
            raise IndexError(f"row {i} of {self.array.shape[0]}")
        return pb.SharedLogits(region=self.name, offset=i * self.vocab * self.width, count=count or self.vocab, dtype=self.dtype)

    def _release(self):
        self.array = None
        self.shm.close()
        self.shm.unlink()

    def close(self, timeout=10.0):
        """Unregisters the region and removes its file. A region the server
        released already is not an error: the connection that registered
        it closed (`transport.release_shared_on_disconnect`), e.g. when the
        server aged it out (`limits.max_connection_age_secs`) and its last
        call ended, while this call runs on the channel's next connection."""
        try:
            self.stub.UnregisterSharedMemory(pb.UnregisterSharedMemoryRequest(name=self.name), metadata=self.metadata, timeout=timeout)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.NOT_FOUND:
                raise
        finally:
            self._release()

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.close()


def shared_rows(stub, rows, vocab, **kwargs):
    """A registered shared-memory region of `rows` × `vocab` logits: see
    SharedRows (`dtype` "f32", "f16" or "bf16"; `name`, `metadata` for a
    bearer token, `timeout`)."""
    return SharedRows(stub, rows, vocab, **kwargs)


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


def retry_delay(err, attempt):
    """How long to wait before resuming a stream after `err` (the
    attempt-th failure in a row, from 0), or None when it is not worth it
    (see LOST_IN_TRANSIT): RetryInfo's delay when the server sent one, else
    exponential backoff with jitter (50 ms doubling to 1 s, as the service
    config's policy)."""
    if not isinstance(err, grpc.RpcError) or attempt >= MAX_RESUMES:
        return None
    rich = rich_error(err)
    backoff = random.uniform(0, min(1.0, 0.05 * 2**attempt))
    if rich is None or rich.domain != "samplerd.v1":
        return backoff if err.code() in LOST_IN_TRANSIT else None
    # samplerd's own status (its code, which a stream reset right after it
    # may have replaced in err.code()).
    if rich.retry_delay_s is not None:
        return rich.retry_delay_s
    return backoff if rich.code == grpc.StatusCode.UNAVAILABLE.value[0] else None


def _constrained(params):
    return params.HasField("constraint") or any(s.name == "constraint" for s in params.chain)


class SampleStream:
    """One sequence over SampleStream, one step at a time.

    The first message carries the parameters, the initial penalty window
    and the first step; the server then appends each chosen token to the
    window and counts the steps, so `step()` sends only logits:

        with SampleStream(stub, temperature=0.0) as s:
            r0 = s.step(logits0)
            r1 = s.step(logits1)

    When the stream fails with UNAVAILABLE (its replica died or drained,
    its connection aged) or a RESOURCE_EXHAUSTED with RetryInfo, the step
    is resumed on a new stream — on whichever replica the channel picks —
    whose first message carries the window so far (`previous_tokens` +
    the tokens chosen), the next step number, the same parameters and seed
    and, with a constraint, the constraint's output: the server rebuilds
    exactly the state the old stream had, so the answers are the same bits
    (docs/API.md, "Resuming a stream"). `resumes` counts them. Give a
    `seed` for that: without one, a server configured with `seed =
    "random"` would draw a new one (the responses carry the seed used).
    """

    def __init__(self, stub, *, previous_tokens=(), first_step=0, constraint_tokens=(), timeout=60.0,
                 resume=True, **params):
        self._stub = stub
        self._timeout = timeout
        self._resume = resume
        self._window = list(previous_tokens)
        self._first_step = first_step
        self._params = pb.SamplingParams(**params)
        self._constraint_tokens = list(constraint_tokens)
        self.tokens = []  # every token chosen so far, in order
        self.resumes = 0
        self._open()

    def _open(self):
        self._requests = queue.Queue()
        self._sent_first = False
        # grpcio sends what the iterator yields, from its own thread; None
        # (from close) ends the iterator and so half-closes the stream.
        self._call = self._stub.SampleStream(iter(self._requests.get, None), timeout=self._timeout)

    def _first_fields(self):
        """The first message's fields for the stream as it stands now."""
        first = pb.SampleStreamRequest(
            previous_tokens=(self._window + self.tokens)[-MAX_WINDOW_TOKENS:],
            params=self._params,
            first_step=self._first_step + len(self.tokens),
        )
        if _constrained(self._params):
            first.constraint_tokens.extend(self._constraint_tokens + self.tokens)
        return first

    def step(self, logits, *, n_probs=0):
        data = f32le(logits)
        attempt = 0
        while True:
            msg = pb.SampleStreamRequest(logits_f32le=data, n_probs=n_probs)
            if not self._sent_first:
                msg.MergeFrom(self._first_fields())
                self._sent_first = True
            self._requests.put(msg)
            try:
                r = next(self._call)
            except grpc.RpcError as err:
                delay = retry_delay(err, attempt) if self._resume else None
                if delay is None:
                    raise
                attempt += 1
                self.resumes += 1
                self._requests.put(None)  # ends the old call's request thread
                time.sleep(delay)
                self._open()
                continue
            self.tokens.append(r.token_id)
            return r

    def close(self):
        """Half-closes the stream and waits for the server to end it. Every
        step has its answer by then, so a connection lost in between (the
        replica killed or drained right after the last answer) loses
        nothing and is not raised."""
        self._requests.put(None)
        try:
            for _ in self._call:  # the server ends the stream after our half-close
                pass
        except grpc.RpcError as err:
            if err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                raise

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
    cancel() leaves the server generating until max_tokens or the deadline.

    A stream that fails with UNAVAILABLE (or RESOURCE_EXHAUSTED with
    RetryInfo) is resumed: the same request again with
    `resume.token_ids` = the tokens received and the seed the server
    reported (`samplerd-seed` header), so the iteration goes on with
    exactly the tokens and text an uninterrupted run sends; `resumes`
    counts them."""

    def __init__(self, stub, request, timeout, resume=True):
        self._stub = stub
        self._request = request
        self._timeout = timeout
        self._resume = resume
        self._cancelled = False
        self._call = stub.Generate(request, timeout=timeout)
        self.seed = request.params.seed if request.params.HasField("seed") else None
        self.tokens = []
        self.finished = None
        self.resumes = 0

    def _resumed(self):
        req = pb.GenerateRequest()
        req.CopyFrom(self._request)
        req.resume.token_ids[:] = [t.token_id for t in self.tokens]
        if self.seed is not None:
            req.params.seed = self.seed
        return req

    def __iter__(self):
        attempt = 0
        while True:
            try:
                for msg in self._call:
                    if self.seed is None:
                        self.seed = next((int(v) for k, v in self._call.initial_metadata()
                                          if k == "samplerd-seed"), None)
                    if self._cancelled:
                        continue  # one already-received event; the error follows
                    if msg.HasField("token"):
                        attempt = 0
                        self.tokens.append(msg.token)
                        yield msg.token
                    else:
                        self.finished = msg.finished
                break
            except grpc.RpcError as err:
                delay = None if self._cancelled or not self._resume else retry_delay(err, attempt)
                if delay is None:
                    raise
                attempt += 1
                self.resumes += 1
                time.sleep(delay)
                self._call = self._stub.Generate(self._resumed(), timeout=self._timeout)
        if self.finished is None and not self._cancelled:
            raise RuntimeError("Generate ended without a Finished event")

    def cancel(self):
        self._cancelled = True
        self._call.cancel()

    @property
    def text(self):
        tail = self.finished.text if self.finished is not None else ""
        return "".join(t.text for t in self.tokens) + tail


def generate(stub, prompt=None, *, messages=(), max_tokens=None, stop=(), ignore_eos=False, n_probs=0, timeout=60.0,
             resume=True, **params):
    """Starts a streamed Generate (the server needs a model). `messages` is
    a list of (role, content) pairs, rendered with the model's chat template;
    else `prompt` is used raw. `timeout` is the call's deadline (each
    resumed call gets its own): past it the iteration raises grpc.RpcError
    DEADLINE_EXCEEDED. `resume=False` turns resuming off. Other keyword
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
    return Generation(stub, req, timeout, resume=resume)


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
    grpc.RpcError) into a RichError; None when the server sent none. Its
    `code` is the server's (grpc_status.rpc_status.from_call refuses a
    status whose code differs from the call's, which happens when a stream
    reset follows the server's trailers)."""
    from google.rpc import error_details_pb2 as ed
    from google.rpc import status_pb2

    raw = next((v for k, v in (err.trailing_metadata() or ()) if k == "grpc-status-details-bin"), None)
    if raw is None:
        return None
    st = status_pb2.Status.FromString(raw)
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
