"""Every samplerd.v1.Sampler RPC once, with plain grpcio (no kit).

    python -m grpc_tools.protoc -I proto --python_out=. --grpc_python_out=. \
        proto/samplerd/v1/sampler.proto
    python every_rpc.py [host:port]          # default $SAMPLERD_ADDR or 127.0.0.1:50051

With `[auth]` on, set SAMPLERD_TOKEN. Generate, Tokenize and Detokenize
need a server started with a model; the shared-memory rows, a client on
the server's host.
"""

import os
import sys

import grpc
import numpy as np
from samplerd.v1 import sampler_pb2 as pb
from samplerd.v1 import sampler_pb2_grpc as pb_grpc

addr = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("SAMPLERD_ADDR", "127.0.0.1:50051")
addr = addr.removeprefix("http://")
# grpcio stops at 4 MiB received by default; a 256-row SampleBatch with
# n_probs = 1024 answers 4.2 MB. Match the server's limits.max_message_bytes.
channel = grpc.insecure_channel(addr, options=[
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
])
stub = pb_grpc.SamplerStub(channel)
token = os.environ.get("SAMPLERD_TOKEN")
metadata = [("authorization", f"Bearer {token}")] if token else []


def f32le(x):
    """Logits as little-endian f32 bytes, whatever the host's order."""
    return np.asarray(x, dtype="<f4").tobytes()


logits = [0.5, 1.0, -2.0, 4.25, 3.0, 0.0]  # token 3 is the largest
greedy = pb.SamplingParams(temperature=0.0, seed=7)

# GetServerInfo: version, model, limits; the request id comes back in a header.
info, call = stub.GetServerInfo.with_call(pb.GetServerInfoRequest(), metadata=metadata, timeout=5)
request_id = dict(call.initial_metadata()).get(info.request_id_header)
print("GetServerInfo:", info.version, info.model.file_name or "(no model)", "request id", request_id)

# ListStages: the loaded stages and the default chain.
stages = stub.ListStages(pb.ListStagesRequest(), metadata=metadata, timeout=5)
print("ListStages:", [s.name for s in stages.stages][:6], "...")

# Sample: one row, stateless. gzip on the request (the response is then
# compressed too, under the default compression.responses = auto).
r = stub.Sample(pb.SampleRequest(logits_f32le=f32le(logits), params=greedy, n_probs=2),
                metadata=metadata, timeout=5, compression=grpc.Compression.Gzip)
assert r.token_id == 3, r
print("Sample:", r.token_id, "seed", r.seed, "top-2", [p.token_id for p in r.probs])

# SampleStream: one sequence; the server keeps its penalty window and step.
def stream_requests():
    first = pb.SampleStreamRequest(logits_f32le=f32le(logits),
                                   params=pb.SamplingParams(temperature=0.0, repeat_penalty=2.0))
    yield first
    for _ in range(2):
        yield pb.SampleStreamRequest(logits_f32le=f32le(logits))


print("SampleStream:", [r.token_id for r in stub.SampleStream(stream_requests(), metadata=metadata, timeout=5)])

# SampleBatch: many rows in one message, one dtype.
rows = [pb.BatchRow(logits=f32le(np.roll(logits, i)), step=0) for i in range(4)]
batch = stub.SampleBatch(pb.SampleBatchRequest(rows=rows, dtype=pb.LOGITS_DTYPE_F32LE, params=greedy),
                         metadata=metadata, timeout=5)
assert [r.token_id for r in batch.rows] == [(3 + i) % 6 for i in range(4)], batch
print("SampleBatch:", [r.token_id for r in batch.rows])

# SampleBatchStream: many sequences, each keeps its state; `leave` ends one.
def batch_steps():
    yield pb.SampleBatchStreamRequest(dtype=pb.LOGITS_DTYPE_F32LE, params=greedy, rows=[
        pb.BatchStreamRow(sequence_id=1, logits=f32le(logits)),
        pb.BatchStreamRow(sequence_id=2, logits=f32le(logits[::-1])),
    ])
    yield pb.SampleBatchStreamRequest(dtype=pb.LOGITS_DTYPE_F32LE, leave=[2], rows=[
        pb.BatchStreamRow(sequence_id=1, logits=f32le(logits)),
    ])


for m in stub.SampleBatchStream(batch_steps(), metadata=metadata, timeout=5):
    print("SampleBatchStream:", list(zip(m.sequence_ids, [r.token_id for r in m.rows])))

# RegisterSharedMemory / UnregisterSharedMemory: on the server's host, rows
# are read in place from a file in /dev/shm (transport.shared_memory_dirs).
from multiprocessing import shared_memory

region = shared_memory.SharedMemory(create=True, size=4 * len(logits))
try:
    np.ndarray(len(logits), dtype="<f4", buffer=region.buf)[:] = logits
    stub.RegisterSharedMemory(pb.RegisterSharedMemoryRequest(
        name=region.name, path=f"/dev/shm/{region.name}", byte_size=region.size), metadata=metadata, timeout=5)
    shared = pb.SharedLogits(region=region.name, offset=0, count=len(logits), dtype=pb.LOGITS_DTYPE_F32LE)
    r = stub.Sample(pb.SampleRequest(shared=shared, params=greedy), metadata=metadata, timeout=5)
    assert r.token_id == 3, r
    stub.UnregisterSharedMemory(pb.UnregisterSharedMemoryRequest(name=region.name), metadata=metadata, timeout=5)
    print("Sample from shared memory:", r.token_id)
finally:
    region.close()
    region.unlink()

if info.model.file_name:
    # Tokenize and Detokenize with the model's vocabulary.
    ids = stub.Tokenize(pb.TokenizeRequest(text="Hello, world"), metadata=metadata, timeout=5).tokens
    text = stub.Detokenize(pb.DetokenizeRequest(tokens=ids), metadata=metadata, timeout=5).text
    assert text == "Hello, world", text
    print("Tokenize:", list(ids), "Detokenize:", repr(text))

    # Generate: a server-side stream of Token messages, then one Finished.
    req = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="Say hi.")],
                             max_tokens=16, params=pb.SamplingParams(seed=7))
    for m in stub.Generate(req, metadata=metadata, timeout=60):
        if m.HasField("token"):
            print(m.token.text, end="", flush=True)
        else:
            f = m.finished
            print(f"\nGenerate: {pb.FinishReason.Name(f.finish_reason)}, "
                  f"{f.usage.completion_tokens} tokens, seed {f.seed}")

# Errors carry google.rpc details (grpcio-status reads them).
try:
    stub.Sample(pb.SampleRequest(logits_f32le=f32le(logits), params=pb.SamplingParams(top_p=1.5)),
                metadata=metadata, timeout=5)
    raise SystemExit("top_p = 1.5 was accepted")
except grpc.RpcError as e:
    from grpc_status import rpc_status
    from google.rpc import error_details_pb2

    status = rpc_status.from_call(e)
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            print("error:", e.code().name, [v.field for v in bad.field_violations])
