'use strict';
// Tests of the Node.js kit against a running samplerd started with a model:
//   SAMPLERD_ADDR=127.0.0.1:PORT node --test test/kit.test.js
// (scripts/ci/clients.sh node starts one and runs this).
const { test, before, after } = require('node:test');
const assert = require('node:assert/strict');
const kit = require('../samplerd_client');

const ADDR = process.env.SAMPLERD_ADDR;
if (!ADDR) {
  throw new Error('SAMPLERD_ADDR is not set: point it at a samplerd started with --model (scripts/ci/clients.sh does)');
}

let client;
before(async () => {
  client = kit.connect(ADDR);
  await kit.waitForReady(client, 10000);
});
after(() => client.close());

// A vocabulary-sized vector whose maximum (at BEST) is only slightly above
// the rest: at the default temperature (0.8) and top_k (40) the draw would
// almost never land on it, so picking it shows temperature 0 was sent.
const N_VOCAB = 32000;
const BEST = 12345;
function flatLogits() {
  const x = new Float32Array(N_VOCAB);
  for (let i = 0; i < N_VOCAB; i++) x[i] = ((i * 7919) % 1000) / 1000;
  x[BEST] = 1.5;
  return x;
}

test('the channel runs the shared service config: round_robin, retries of the idempotent RPCs', () => {
  const cfg = kit.SERVICE_CONFIG;
  assert.deepEqual(cfg.loadBalancingConfig, [{ round_robin: {} }]);
  const [method] = cfg.methodConfig;
  assert.deepEqual(method.name.map((n) => `${n.service}/${n.method}`), [
    'samplerd.v1.Sampler/Sample', 'samplerd.v1.Sampler/SampleBatch',
    'samplerd.v1.Sampler/ListStages', 'samplerd.v1.Sampler/Tokenize',
    'samplerd.v1.Sampler/Detokenize', 'samplerd.v1.Sampler/GetServerInfo',
    'grpc.health.v1.Health/Check',
  ]);
  assert.deepEqual(method.retryPolicy.retryableStatusCodes, ['UNAVAILABLE', 'RESOURCE_EXHAUSTED']);
  // Every call in this file goes through a channel with it (grpc-js
  // refuses to create one with an invalid config).
  assert.equal(client.getChannel().getTarget().length > 0, true);
});

test('f32le: 4 little-endian bytes per float over the same memory', () => {
  const f = new Float32Array([1.0, -2.5]);
  const b = kit.f32le(f);
  assert.equal(b.length, 8);
  assert.deepEqual([...b], [0x00, 0x00, 0x80, 0x3f, 0x00, 0x00, 0x20, 0xc0]);
  // A subarray view starts at its own offset, not at the buffer's start.
  assert.deepEqual([...kit.f32le(f.subarray(1))], [0x00, 0x00, 0x20, 0xc0]);
});

test('Sample with raw bytes: greedy picks the argmax, 64-bit seed echoed exactly', async () => {
  const seed = '18446744073709551557'; // > 2^53: a JS number would round it
  const r = await kit.sample(client, flatLogits(), { temperature: 0, seed }, { step: 5, n_probs: 3 });
  assert.equal(r.token_id, BEST);
  assert.equal(r.seed, seed);
  assert.equal(r.step, '5');
  assert.equal(r.probs.length, 3);
  assert.equal(r.probs[0].token_id, BEST);
  assert.ok(r.logprob < 0);
});

test('sparseRow: the top n ascending, the rest as a log-sum-exp; Sample answers as the dense row', async () => {
  const row = kit.sparseRow([0.5, 3.0, -Infinity, 2.0, 1.0], 2);
  assert.deepEqual(row.ids, [1, 3]);
  assert.deepEqual(row.values, [3.0, 2.0]);
  assert.ok(Math.abs(row.rest_logsumexp - Math.log(Math.exp(0.5) + Math.exp(1.0))) < 1e-12);
  assert.equal(row.vocab_size, 5);
  assert.equal(kit.sparseRow([1.0, 2.0], 2).rest_logsumexp, -Infinity);
  assert.equal(kit.sparseRow([1.0, -Infinity], 1).rest_logsumexp, -Infinity);
  const x = flatLogits();
  const dense = await kit.sample(client, x, { seed: '11' }, { step: 1, n_probs: 4 });
  const sparse = await new Promise((resolve, reject) =>
    client.Sample({ sparse: kit.sparseRow(x, 1024), params: { seed: '11' }, step: '1', n_probs: 4 }, (e, r) =>
      e ? reject(e) : resolve(r),
    ),
  );
  assert.equal(sparse.token_id, dense.token_id);
  assert.equal(sparse.probability, dense.probability);
  assert.ok(Math.abs(sparse.logprob - dense.logprob) < 1e-6);
  assert.deepEqual(
    sparse.probs.map((p) => p.token_id),
    dense.probs.map((p) => p.token_id),
  );
});

test('Sample: the raw bytes and the repeated float field are the same request', async () => {
  const x = flatLogits();
  const viaBytes = await kit.sample(client, x, { seed: '3' }, { step: 2 });
  const viaFloats = await new Promise((resolve, reject) =>
    client.Sample({ logits: Array.from(x), params: { seed: '3' }, step: '2' }, (e, r) => (e ? reject(e) : resolve(r))),
  );
  assert.deepEqual(viaBytes, viaFloats);
});

test('SampleStream: steps count up and the server keeps the penalty window', async () => {
  const s = kit.openSampleStream(client, { temperature: 0, repeat_penalty: 2.0, seed: '11' }, { first_step: 10 });
  const logits = new Float32Array([5.0, 4.9, 1.0, 0.0]);
  const got = [];
  for (let i = 0; i < 3; i++) got.push(await s.step(logits));
  s.end();
  assert.deepEqual(got.map((r) => r.step), ['10', '11', '12']);
  // 0 wins, then is penalised (5.0 / 2 < 4.9) so 1 wins, then both are
  // penalised (2.5 > 2.45) and 0 wins again.
  assert.deepEqual(got.map((r) => r.token_id), [0, 1, 0]);
  assert.ok(got.every((r) => r.seed === '11'));
});

const PROMPT = { messages: [{ role: 'user', content: 'Count from one to ten.' }], params: { seed: '7' } };

test('Generate with a deadline: tokens, then a Finished event', async () => {
  const seen = [];
  const out = await kit.generate(client, { ...PROMPT, max_tokens: 6, ignore_eos: true }, {
    timeoutMs: 60000,
    onToken: (t) => seen.push(t.token_id),
  });
  assert.equal(out.tokens.length, 6);
  assert.deepEqual(seen, out.tokens.map((t) => t.token_id));
  assert.equal(out.finished.finish_reason, 'MAX_TOKENS');
  assert.equal(out.finished.usage.completion_tokens, 6);
  assert.ok(out.finished.usage.prompt_tokens > 0);
  assert.equal(out.finished.seed, '7');
});

test('Generate cancelled by the client after 3 tokens: CANCELLED, and the server keeps serving', async () => {
  await assert.rejects(
    kit.generate(client, { ...PROMPT, max_tokens: 500, ignore_eos: true }, { timeoutMs: 60000, cancelAfter: 3 }),
    (err) => {
      assert.equal(err.code, kit.status.CANCELLED, kit.describeError(err));
      assert.equal(err.tokens.length, 3);
      return true;
    },
  );
  const again = await kit.generate(client, { ...PROMPT, max_tokens: 2, ignore_eos: true }, { timeoutMs: 60000 });
  assert.equal(again.tokens.length, 2);
  assert.equal(again.finished.finish_reason, 'MAX_TOKENS');
});

test('Generate past its deadline: DEADLINE_EXCEEDED', async () => {
  await assert.rejects(
    kit.generate(client, { ...PROMPT, max_tokens: 2000, ignore_eos: true }, { timeoutMs: 300 }),
    (err) => {
      assert.equal(err.code, kit.status.DEADLINE_EXCEEDED, kit.describeError(err));
      return true;
    },
  );
});

// The rich error model: the google.rpc.Status of grpc-status-details-bin.
function checkRefusal(err, field, reason) {
  assert.equal(err.code, kit.status.INVALID_ARGUMENT, kit.describeError(err));
  assert.match(err.details, new RegExp(field.split('.').pop()));
  const rich = kit.richError(err);
  assert.ok(rich, 'no grpc-status-details-bin trailer');
  assert.equal(rich.code, kit.status.INVALID_ARGUMENT);
  assert.ok(rich.errorInfo, `no ErrorInfo in ${JSON.stringify(rich.details)}`);
  assert.equal(rich.errorInfo.domain, 'samplerd.v1');
  assert.equal(rich.errorInfo.reason, reason);
  assert.ok(rich.badRequest, `no BadRequest in ${JSON.stringify(rich.details)}`);
  assert.ok(
    rich.badRequest.field_violations.some((v) => v.field === field),
    JSON.stringify(rich.badRequest.field_violations),
  );
  return rich;
}

test('rich error details: top_p = 1.5 is SAMPLERD_PARAM_OUT_OF_RANGE on params.top_p', async () => {
  await assert.rejects(kit.sample(client, flatLogits(), { top_p: 1.5 }), (err) => {
    checkRefusal(err, 'params.top_p', 'SAMPLERD_PARAM_OUT_OF_RANGE');
    return true;
  });
});

test('rich error details: temperature = -1 is SAMPLERD_PARAM_OUT_OF_RANGE on params.temperature', async () => {
  await assert.rejects(kit.sample(client, flatLogits(), { temperature: -1 }), (err) => {
    checkRefusal(err, 'params.temperature', 'SAMPLERD_PARAM_OUT_OF_RANGE');
    return true;
  });
});

test('rich error details on a stream: Generate with top_p = 1.5', async () => {
  // A streaming call's error carries the same trailer.
  await assert.rejects(kit.generate(client, { ...PROMPT, max_tokens: 3, params: { top_p: 1.5 } }), (err) => {
    checkRefusal(err, 'params.top_p', 'SAMPLERD_PARAM_OUT_OF_RANGE');
    return true;
  });
});

test('rich error details: an unknown stage is SAMPLERD_UNKNOWN_STAGE with a ResourceInfo', async () => {
  const chain = [{ name: 'no_such_stage', params: {} }];
  await assert.rejects(kit.sample(client, flatLogits(), { chain }), (err) => {
    const rich = checkRefusal(err, 'params.chain', 'SAMPLERD_UNKNOWN_STAGE');
    assert.ok(rich.resourceInfo, JSON.stringify(rich.details));
    assert.equal(rich.resourceInfo.resource_name, 'no_such_stage');
    return true;
  });
});
