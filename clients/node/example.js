#!/usr/bin/env node
'use strict';
// The Node.js kit end to end against a running samplerd:
//   node example.js [ADDR]      (default $SAMPLERD_ADDR, else 127.0.0.1:50051)
// Generate needs a server started with --model.
const kit = require('./samplerd_client');

async function main() {
  const addr = process.argv[2] || process.env.SAMPLERD_ADDR || '127.0.0.1:50051';
  const client = kit.connect(addr);
  try {
    await kit.waitForReady(client, 10000);

    // 1. Sample with raw little-endian f32 bytes. Token 3 has the largest
    //    logit, so temperature 0 (greedy) picks it. A seed above 2^53 goes
    //    as a string and comes back as the same string.
    const logits = new Float32Array([0.5, 1.0, -2.0, 4.25, 3.0, 0.0]);
    const r = await kit.sample(client, logits, { temperature: 0, seed: '18446744073709551557' }, { n_probs: 2 });
    console.log(`Sample: token ${r.token_id} (p=${r.probability.toFixed(3)}, logprob=${r.logprob.toFixed(3)}), seed ${r.seed}`);

    // 2. SampleStream: three steps of one sequence. With repeat_penalty the
    //    server's window (which it extends with each chosen token) changes
    //    the answer: 0 first, then 1 once 0 is penalised, then 0 again.
    const s = kit.openSampleStream(client, { temperature: 0, repeat_penalty: 2.0 });
    const stepLogits = new Float32Array([5.0, 4.9, 1.0, 0.0]);
    for (let i = 0; i < 3; i++) {
      const res = await s.step(stepLogits);
      console.log(`SampleStream step ${res.step}: token ${res.token_id}`);
    }
    s.end();

    // 3. Generate, streamed, with a deadline; then one cancelled by the
    //    client after 3 tokens.
    const prompt = { messages: [{ role: 'user', content: 'Name three colours.' }], max_tokens: 24, params: { seed: '7' } };
    const out = await kit.generate(client, prompt, {
      timeoutMs: 60000,
      onToken: (t) => process.stdout.write(t.text),
    });
    console.log(`\nGenerate: ${out.finished.finish_reason}, ${out.finished.usage.completion_tokens} tokens, seed ${out.finished.seed}`);
    try {
      await kit.generate(client, { ...prompt, max_tokens: 200, ignore_eos: true }, { cancelAfter: 3 });
    } catch (err) {
      if (err.code !== kit.status.CANCELLED) throw err;
      console.log(`Generate cancelled after ${err.tokens.length} tokens: CANCELLED`);
    }

    // 4. A bad request and its rich error details.
    try {
      await kit.sample(client, logits, { top_p: 1.5 });
    } catch (err) {
      console.log(`Sample top_p=1.5 refused:\n${kit.describeError(err)}`);
    }
  } finally {
    client.close();
  }
}

main().catch((err) => {
  console.error(err.code !== undefined ? kit.describeError(err) : err);
  process.exit(1);
});
