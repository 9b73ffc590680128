// Every samplerd.v1.Sampler RPC once, with plain @grpc/grpc-js (no kit).
//
//   npm install @grpc/grpc-js @grpc/proto-loader protobufjs google-proto-files
//   node every_rpc.js [host:port]      # default $SAMPLERD_ADDR or 127.0.0.1:50051
//
// Run from the repository root (the proto is loaded from proto/), or set
// SAMPLERD_PROTO_DIR. With `[auth]` on, set SAMPLERD_TOKEN. Generate,
// Tokenize and Detokenize need a server started with a model; the
// shared-memory rows, a client on the server's host.
'use strict';
const fs = require('node:fs');
const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const protobuf = require('protobufjs');
const googleProtoFiles = require('google-proto-files');

const addr = (process.argv[2] || process.env.SAMPLERD_ADDR || '127.0.0.1:50051').replace(/^http:\/\//, '');
const protoDir = process.env.SAMPLERD_PROTO_DIR || path.resolve('proto');
const loaderOptions = { keepCase: true, longs: String, enums: String, defaults: true, oneofs: true };
const definition = protoLoader.loadSync('samplerd/v1/sampler.proto', { ...loaderOptions, includeDirs: [protoDir] });
const { samplerd } = grpc.loadPackageDefinition(definition);
// grpc-js stops at 4 MiB received by default; a 256-row SampleBatch with
// n_probs = 1024 answers 4.2 MB. Match the server's limits.max_message_bytes.
const client = new samplerd.v1.Sampler(addr, grpc.credentials.createInsecure(), {
  'grpc.max_receive_message_length': 64 << 20,
  'grpc.max_send_message_length': 64 << 20,
});
const metadata = new grpc.Metadata();
if (process.env.SAMPLERD_TOKEN) metadata.set('authorization', `Bearer ${process.env.SAMPLERD_TOKEN}`);

// Logits as little-endian f32 bytes: the Float32Array's memory, not the
// array (protobufjs would write one byte per element).
function f32le(values) {
  const f32 = Float32Array.from(values);
  const b = Buffer.alloc(f32.length * 4);
  f32.forEach((x, i) => b.writeFloatLE(x, i * 4));
  return b;
}
const deadline = (ms = 5000) => ({ deadline: Date.now() + ms });
const unary = (method, req) => new Promise((resolve, reject) =>
  client[method](req, metadata, deadline(), (err, res) => (err ? reject(err) : resolve(res))));
// All messages of a server stream, once it has ended.
const collect = (call) => new Promise((resolve, reject) => {
  const out = [];
  call.on('data', (m) => out.push(m));
  call.on('error', reject);
  call.on('end', () => resolve(out));
});

const logits = [0.5, 1.0, -2.0, 4.25, 3.0, 0.0]; // token 3 is the largest
const greedy = { temperature: 0, seed: '7' };

async function main() {
  const info = await unary('GetServerInfo', {});
  console.log('GetServerInfo:', info.version, info.model ? info.model.file_name : '(no model)');

  const stages = await unary('ListStages', {});
  console.log('ListStages:', stages.stages.map((s) => s.name).slice(0, 6), '...');

  const r = await unary('Sample', { logits_f32le: f32le(logits), params: greedy, n_probs: 2 });
  if (r.token_id !== 3) throw new Error(`Sample: ${r.token_id}`);
  console.log('Sample:', r.token_id, 'seed', r.seed, 'top-2', r.probs.map((p) => p.token_id));

  // SampleStream: one sequence; the server keeps its penalty window and step.
  const stream = client.SampleStream(metadata, deadline());
  const answers = collect(stream);
  stream.write({ logits_f32le: f32le(logits), params: { temperature: 0, repeat_penalty: 2 } });
  stream.write({ logits_f32le: f32le(logits) });
  stream.write({ logits_f32le: f32le(logits) });
  stream.end();
  console.log('SampleStream:', (await answers).map((m) => m.token_id));

  // SampleBatch: many rows in one message, one dtype.
  const rows = [0, 1, 2, 3].map((i) => ({ logits: f32le(logits.map((_, j) => logits[(j - i + 6) % 6])) }));
  const batch = await unary('SampleBatch', { rows, dtype: 'LOGITS_DTYPE_F32LE', params: greedy });
  console.log('SampleBatch:', batch.rows.map((m) => m.token_id));

  // SampleBatchStream: many sequences, each keeps its state; `leave` ends one.
  const bs = client.SampleBatchStream(metadata, deadline());
  const steps = collect(bs);
  bs.write({
    dtype: 'LOGITS_DTYPE_F32LE', params: greedy, rows: [
      { sequence_id: '1', logits: f32le(logits) },
      { sequence_id: '2', logits: f32le([...logits].reverse()) },
    ],
  });
  bs.write({ dtype: 'LOGITS_DTYPE_F32LE', leave: ['2'], rows: [{ sequence_id: '1', logits: f32le(logits) }] });
  bs.end();
  for (const m of await steps) {
    console.log('SampleBatchStream:', m.sequence_ids.map((id, i) => [id, m.rows[i].token_id]));
  }

  // RegisterSharedMemory / UnregisterSharedMemory: on the server's host,
  // rows are read in place from a file in /dev/shm (writing through the
  // file is enough; Node maps none without a native addon).
  const shmPath = `/dev/shm/samplerd-example-${process.pid}`;
  const region = `example-${process.pid}`;
  fs.writeFileSync(shmPath, f32le(logits), { mode: 0o600 });
  try {
    await unary('RegisterSharedMemory', { name: region, path: shmPath, byte_size: String(4 * logits.length) });
    const shared = await unary('Sample', { shared: { region, count: logits.length }, params: greedy });
    await unary('UnregisterSharedMemory', { name: region });
    console.log('Sample from shared memory:', shared.token_id);
  } finally {
    fs.rmSync(shmPath, { force: true });
  }

  if (info.model && info.model.file_name) {
    const { tokens } = await unary('Tokenize', { text: 'Hello, world' });
    const { text } = await unary('Detokenize', { tokens });
    if (text !== 'Hello, world') throw new Error(`Detokenize: ${text}`);
    console.log('Tokenize:', tokens, 'Detokenize:', JSON.stringify(text));

    // Generate: a server stream of `token` events, then one `finished`.
    const gen = client.Generate({
      messages: [{ role: 'user', content: 'Say hi.' }], max_tokens: 16, params: { seed: '7' },
    }, metadata, deadline(60000));
    for (const m of await collect(gen)) {
      if (m.event === 'token') process.stdout.write(m.token.text);
      else console.log(`\nGenerate: ${m.finished.finish_reason}, ${m.finished.usage.completion_tokens} tokens, seed ${m.finished.seed}`);
    }
  }

  // Errors carry google.rpc details in the grpc-status-details-bin trailer.
  try {
    await unary('Sample', { logits_f32le: f32le(logits), params: { top_p: 1.5 } });
    throw new Error('top_p = 1.5 was accepted');
  } catch (err) {
    if (err.code !== grpc.status.INVALID_ARGUMENT) throw err;
    const include = path.dirname(googleProtoFiles.getProtoPath());
    const root = new protobuf.Root();
    root.resolvePath = (_origin, target) => path.join(include, target);
    root.loadSync(['google/rpc/status.proto', 'google/rpc/error_details.proto'], { keepCase: true });
    const status = root.lookupType('google.rpc.Status').decode(err.metadata.get('grpc-status-details-bin')[0]);
    const badRequest = status.details.find((d) => d.type_url.endsWith('/google.rpc.BadRequest'));
    const fields = root.lookupType('google.rpc.BadRequest').decode(badRequest.value).field_violations;
    console.log('error:', grpc.status[err.code], fields.map((v) => v.field));
  }
  client.close();
}

main().catch((err) => { console.error(err); process.exit(1); });
