'use strict';
// A small Node.js client for samplerd.v1.Sampler, built on @grpc/grpc-js and
// @grpc/proto-loader (the proto is loaded at run time: nothing generated).
//
//   const kit = require('./samplerd_client');
//   const client = kit.connect('127.0.0.1:50051');
//   const r = await kit.sample(client, new Float32Array([0.5, 4, 1]), { temperature: 0 });

const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const protobuf = require('protobufjs');
const googleProtoFiles = require('google-proto-files');

// A packed kit (`npm pack`, then `npm install samplerd-client-0.1.0.tgz`)
// carries the proto and the service config beside this file (the prepack
// script copies them); in the checkout they are the repository's.
const BUNDLED = fs.existsSync(path.join(__dirname, 'proto', 'samplerd', 'v1', 'sampler.proto'));
// The proto/ directory (override to use a copy elsewhere).
const PROTO_DIR = process.env.SAMPLERD_PROTO_DIR
  || (BUNDLED ? path.join(__dirname, 'proto') : path.resolve(__dirname, '..', '..', 'proto'));

// keepCase: field names exactly as in the proto (`logits_f32le`, not
// `logitsF32le`), the same spelling as the other kits and the docs.
// longs: String: uint64 seeds and steps arrive as decimal strings, so a seed
// above 2^53 is not rounded by a JS number. enums: String: `'MAX_TOKENS'`
// rather than 3. defaults: unset scalars read as 0/''/false. oneofs: a
// GenerateResponse carries `event: 'token' | 'finished'`.
const LOADER_OPTIONS = { keepCase: true, longs: String, enums: String, defaults: true, oneofs: true };

// clients/service-config.json: round_robin over every address the target
// resolves to (a headless Service's `dns:///name:port`), and retries of the
// idempotent RPCs (Sample, SampleBatch, ListStages, Tokenize, Detokenize,
// GetServerInfo, health Check) on
// UNAVAILABLE and RESOURCE_EXHAUSTED. grpc-js's retry cannot read RetryInfo
// (inside grpc-status-details-bin); it honours the grpc-retry-pushback-ms
// trailer, which samplerd sends with the same delay (and -1, "do not
// retry", on refusals retrying cannot fix). Streams are not retried once
// they have answered: resume them (docs/API.md, "Resuming a stream").
const SERVICE_CONFIG_PATH = process.env.SAMPLERD_SERVICE_CONFIG
  || (BUNDLED ? path.join(__dirname, 'service-config.json') : path.resolve(__dirname, '..', 'service-config.json'));
const SERVICE_CONFIG = JSON.parse(fs.readFileSync(SERVICE_CONFIG_PATH, 'utf8'));

// The server takes messages up to limits.max_message_bytes (64 MiB by
// default); grpc-js would otherwise stop at 4 MiB received.
const CHANNEL_OPTIONS = {
  'grpc.max_send_message_length': 64 << 20,
  'grpc.max_receive_message_length': 64 << 20,
  'grpc.service_config': JSON.stringify(SERVICE_CONFIG),
  'grpc.enable_retries': 1,
};

let samplerPackage;
function samplerV1() {
  if (!samplerPackage) {
    const def = protoLoader.loadSync('samplerd/v1/sampler.proto', { ...LOADER_OPTIONS, includeDirs: [PROTO_DIR] });
    samplerPackage = grpc.loadPackageDefinition(def).samplerd.v1;
  }
  return samplerPackage;
}

/**
 * A Sampler client on a plaintext channel (TLS: pass grpc.credentials.createSsl()).
 * `address` is host:port or any gRPC target (`dns:///samplerd-headless.ns.svc:50051`
 * for a fleet), balanced round-robin with retries (clients/service-config.json);
 * samplerctl's http:// form (its SAMPLERD_ADDR) is taken too.
 */
function connect(address, { credentials = grpc.credentials.createInsecure(), options = {} } = {}) {
  const { Sampler } = samplerV1();
  return new Sampler(address.replace(/^http:\/\//, ''), credentials, { ...CHANNEL_OPTIONS, ...options });
}

/** Resolves once the channel is connected, or rejects after `timeoutMs`. */
function waitForReady(client, timeoutMs = 10000) {
  return new Promise((resolve, reject) => {
    client.waitForReady(Date.now() + timeoutMs, (err) => (err ? reject(err) : resolve()));
  });
}

const LITTLE_ENDIAN = os.endianness() === 'LE';

/**
 * Logits as `logits_f32le` bytes: 4 little-endian bytes per float.
 *
 * A Float32Array must not be put in a `bytes` field as it is: protobufjs
 * treats any array-like as a list of byte values and writes one (truncated)
 * byte per float. A Buffer over the same memory is what it expects.
 */
function f32le(values) {
  const f32 = values instanceof Float32Array ? values : Float32Array.from(values);
  if (LITTLE_ENDIAN) {
    return Buffer.from(f32.buffer, f32.byteOffset, f32.byteLength);
  }
  // Typed arrays use the platform's byte order; the wire format is LE.
  const out = Buffer.alloc(f32.length * 4);
  for (let i = 0; i < f32.length; i++) out.writeFloatLE(f32[i], i * 4);
  return out;
}

/**
 * The top `n` of a row as a `SparseLogits` message (the `sparse` field of
 * SampleRequest, SampleStreamRequest and the batch rows): the ids of the n
 * largest logits, ascending (among equal values at the cut any may be
 * taken), their f32 values, the log-sum-exp of every other logit in double
 * precision (-Infinity when nothing is left, or all of it is -Infinity) and
 * the row's length. The server answers what the whole row would, or
 * refuses with FAILED_PRECONDITION when the chain needs more of it
 * (docs/API.md, "Sparse rows").
 */
function sparseRow(values, n) {
  const f32 = values instanceof Float32Array ? values : Float32Array.from(values);
  if (!Number.isInteger(n) || n < 1 || n > f32.length) {
    throw new RangeError(`n must be an integer in [1, ${f32.length}], got ${n}`);
  }
  const order = Array.from(f32.keys()).sort((a, b) => f32[b] - f32[a] || a - b);
  const ids = order.slice(0, n).sort((a, b) => a - b);
  const rest = order.slice(n).map((i) => f32[i]);
  const top = rest.reduce((m, x) => Math.max(m, x), -Infinity);
  let lse = -Infinity;
  if (top !== -Infinity) {
    lse = top + Math.log(rest.reduce((s, x) => s + Math.exp(x - top), 0));
  }
  return { ids, values: ids.map((i) => f32[i]), rest_logsumexp: lse, vocab_size: f32.length };
}

function deadlineIn(ms) {
  return new Date(Date.now() + ms);
}

/**
 * One stateless step: `logits` (Float32Array or number[]) sent as raw bytes.
 * `params` is a SamplingParams object (`{temperature: 0, seed: '123'}`;
 * give 64-bit seeds as strings). Resolves to a SampleResponse.
 */
function sample(client, logits, params = {}, { step = 0, previous_tokens = [], n_probs = 0, timeoutMs = 10000 } = {}) {
  const req = { logits_f32le: f32le(logits), params, step: String(step), previous_tokens, n_probs };
  return new Promise((resolve, reject) => {
    client.Sample(req, { deadline: deadlineIn(timeoutMs) }, (err, res) => (err ? reject(err) : resolve(res)));
  });
}

/**
 * One sequence over SampleStream, one step at a time. The first message
 * carries the parameters, the initial penalty window and the first step;
 * later ones carry only logits: the server appends each chosen token to the
 * window and counts the steps.
 *
 *   const s = openSampleStream(client, { temperature: 0 }, { previous_tokens: [1, 2] });
 *   const r0 = await s.step(logits0);
 *   const r1 = await s.step(logits1);
 *   s.end();
 */
function openSampleStream(client, params = {}, { previous_tokens = [], first_step = 0, timeoutMs = 60000 } = {}) {
  const call = client.SampleStream({ deadline: deadlineIn(timeoutMs) });
  const waiting = []; // one {resolve, reject} per step sent, in order
  let failure = null;
  call.on('data', (res) => {
    const w = waiting.shift();
    if (w) w.resolve(res);
  });
  call.on('error', (err) => {
    failure = err;
    for (const w of waiting.splice(0)) w.reject(err);
  });
  call.on('end', () => {
    const err = failure || new Error('SampleStream ended before answering');
    for (const w of waiting.splice(0)) w.reject(err);
  });
  let first = true;
  return {
    step(logits, { n_probs = 0 } = {}) {
      if (failure) return Promise.reject(failure);
      const msg = { logits_f32le: f32le(logits), n_probs };
      if (first) {
        Object.assign(msg, { params, previous_tokens, first_step: String(first_step) });
        first = false;
      }
      return new Promise((resolve, reject) => {
        waiting.push({ resolve, reject });
        call.write(msg);
      });
    },
    end() {
      call.end();
    },
    call,
  };
}

/**
 * Streams a Generate request. Calls `onToken(token)` for each Token, and
 * resolves with `{tokens, finished, text}` once the Finished event arrives.
 * `cancelAfter`: cancel the call after that many tokens (the promise then
 * rejects with the CANCELLED error grpc-js raises for a client cancel).
 * `timeoutMs` is the call's deadline: past it, DEADLINE_EXCEEDED.
 */
function generate(client, request, { timeoutMs = 60000, cancelAfter = 0, onToken = () => {} } = {}) {
  return new Promise((resolve, reject) => {
    const call = client.Generate(request, { deadline: deadlineIn(timeoutMs) });
    const tokens = [];
    let finished = null;
    let cancelled = false;
    call.on('data', (msg) => {
      if (cancelled) return; // already-buffered events after our cancel
      if (msg.event === 'token') {
        tokens.push(msg.token);
        onToken(msg.token);
        if (cancelAfter > 0 && tokens.length >= cancelAfter) {
          cancelled = true;
          call.cancel();
        }
      } else if (msg.event === 'finished') {
        finished = msg.finished;
      }
    });
    call.on('error', (err) => {
      err.tokens = tokens; // what arrived before the error
      reject(err);
    });
    call.on('end', () => {
      if (!finished) {
        reject(new Error('Generate ended without a Finished event'));
        return;
      }
      const text = tokens.map((t) => t.text).join('') + finished.text;
      resolve({ tokens, finished, text });
    });
  });
}

/** ListStages: the loaded stages and the default chain. */
function listStages(client, { timeoutMs = 10000 } = {}) {
  return new Promise((resolve, reject) => {
    client.ListStages({}, { deadline: deadlineIn(timeoutMs) }, (err, res) => (err ? reject(err) : resolve(res)));
  });
}

// google.rpc.Status and the error-detail messages, from google-proto-files
// (Google's published protos; google/protobuf/any.proto ships with them).
let statusRoot;
function rpcTypes() {
  if (!statusRoot) {
    const include = path.dirname(googleProtoFiles.getProtoPath());
    const root = new protobuf.Root();
    root.resolvePath = (_origin, target) => path.join(include, target);
    root.loadSync(['google/rpc/status.proto', 'google/rpc/error_details.proto'], { keepCase: true });
    statusRoot = root;
  }
  return statusRoot;
}

const TO_OBJECT = { longs: String, enums: String, defaults: true };

/**
 * The rich error model of a failed call: decodes the `grpc-status-details-bin`
 * trailer (a serialized google.rpc.Status) into
 *   { code, message, details: [{type, ...fields}], errorInfo, badRequest, retryInfo, resourceInfo }
 * (the last four: the first detail of that type, or null). Returns null when
 * the server sent no details.
 */
function richError(err) {
  const raw = err && err.metadata ? err.metadata.get('grpc-status-details-bin') : [];
  if (!raw || raw.length === 0) return null;
  const root = rpcTypes();
  const Status = root.lookupType('google.rpc.Status');
  const status = Status.decode(raw[0]);
  const details = status.details.map((any) => {
    // type_url is "type.googleapis.com/google.rpc.ErrorInfo".
    const typeName = any.type_url.slice(any.type_url.lastIndexOf('/') + 1);
    let type;
    try {
      type = root.lookupType(typeName);
    } catch {
      return { type: typeName, value: Buffer.from(any.value) }; // not a google.rpc type
    }
    return { type: typeName, ...type.toObject(type.decode(any.value), TO_OBJECT) };
  });
  const first = (name) => details.find((d) => d.type === name) || null;
  return {
    code: status.code,
    message: status.message,
    details,
    errorInfo: first('google.rpc.ErrorInfo'),
    badRequest: first('google.rpc.BadRequest'),
    retryInfo: first('google.rpc.RetryInfo'),
    resourceInfo: first('google.rpc.ResourceInfo'),
  };
}

/** A one-paragraph description of a failed call, rich details included. */
function describeError(err) {
  const codeName = Object.keys(grpc.status).find((k) => grpc.status[k] === err.code) || String(err.code);
  const lines = [`${codeName}: ${err.details}`];
  const rich = richError(err);
  if (rich) {
    if (rich.errorInfo) {
      const meta = Object.entries(rich.errorInfo.metadata || {}).map(([k, v]) => `${k}=${v}`).join(' ');
      lines.push(`  reason: ${rich.errorInfo.reason} (domain ${rich.errorInfo.domain})${meta ? ' ' + meta : ''}`);
    }
    for (const v of rich.badRequest ? rich.badRequest.field_violations : []) {
      lines.push(`  field ${v.field}: ${v.description}${v.reason ? ` [${v.reason}]` : ''}`);
    }
    if (rich.retryInfo && rich.retryInfo.retry_delay) {
      const d = rich.retryInfo.retry_delay;
      lines.push(`  retry after ${Number(d.seconds) + d.nanos / 1e9} s`);
    }
    if (rich.resourceInfo) {
      lines.push(`  resource: ${rich.resourceInfo.resource_type} ${rich.resourceInfo.resource_name}`);
    }
  } else {
    lines.push('  (no grpc-status-details-bin trailer)');
  }
  return lines.join('\n');
}

module.exports = {
  LOADER_OPTIONS,
  SERVICE_CONFIG,
  connect,
  waitForReady,
  f32le,
  sparseRow,
  sample,
  openSampleStream,
  generate,
  listStages,
  richError,
  describeError,
  status: grpc.status,
};
