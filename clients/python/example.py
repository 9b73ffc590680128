#!/usr/bin/env python3
"""The Python kit end to end against a running samplerd:

    python example.py [ADDR]      (default $SAMPLERD_ADDR, else 127.0.0.1:50051)

Generate needs a server started with --model.
"""

import os
import sys

import grpc
import numpy as np

import samplerd_client as sc


def main():
    addr = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("SAMPLERD_ADDR", "127.0.0.1:50051")
    channel, stub = sc.connect(addr)
    with channel:
        # 1. Sample with raw little-endian f32 bytes: greedy picks token 3.
        logits = np.array([0.5, 1.0, -2.0, 4.25, 3.0, 0.0], dtype=np.float32)
        r = sc.sample_logits(stub, logits, temperature=0.0, seed=2**64 - 59, n_probs=2)
        print(f"Sample: token {r.token_id} (p={r.probability:.3f}, logprob={r.logprob:.3f}), seed {r.seed}")

        # 2. SampleStream: three steps of one sequence; the server keeps the
        #    penalty window, so repeat_penalty turns the answer 0, 1, 0.
        with sc.SampleStream(stub, temperature=0.0, repeat_penalty=2.0) as s:
            for _ in range(3):
                r = s.step(np.array([5.0, 4.9, 1.0, 0.0]))
                print(f"SampleStream step {r.step}: token {r.token_id}")

        # 3. Generate with a deadline, printed as it streams; then one the
        #    client cancels after 3 tokens.
        chat = [("user", "Name three colours.")]
        g = sc.generate(stub, messages=chat, max_tokens=24, seed=7, timeout=60.0)
        for tok in g:
            print(tok.text, end="", flush=True)
        f = g.finished
        print(f"{f.text}\nGenerate: {sc.pb.FinishReason.Name(f.finish_reason)}, "
              f"{f.usage.completion_tokens} tokens, seed {f.seed}")
        g = sc.generate(stub, messages=chat, max_tokens=200, ignore_eos=True, seed=7)
        try:
            for tok in g:
                if len(g.tokens) == 3:
                    g.cancel()
        except grpc.RpcError as e:
            print(f"Generate cancelled after {len(g.tokens)} tokens: {e.code().name}")

        # 4. A bad request and its rich error details.
        try:
            sc.sample_logits(stub, logits, top_p=1.5)
        except grpc.RpcError as e:
            print("Sample top_p=1.5 refused:\n" + sc.describe_error(e))


if __name__ == "__main__":
    main()
