#!/usr/bin/env python3
"""An inference engine that keeps its forward pass and uses samplerd as its
sampler: llama.cpp (llama-cpp-python's low-level API) decodes N sequences
per forward pass, and every step of every sequence is sampled by samplerd
over a Unix socket, with the logits left in shared memory.

    samplerd serve --listen unix:/run/samplerd/samplerd.sock &
    python llama_cpp_engine.py --model SmolLM2-135M-Instruct.Q4_1.gguf \\
        --address unix:///run/samplerd/samplerd.sock --sequences 8

Per step the engine copies each live sequence's logits row from llama.cpp
(`llama_get_logits_ith`) into its row of one registered region (one row per
sequence, one copy, no serialisation) and sends one SampleBatchStream
message whose rows name those rows (`SharedLogits`): no logits cross the
socket. The stream keeps each sequence's penalty window, seed and step
counter on the server, so after the joining row a row is just its
reference (docs/API.md, "SampleBatch and SampleBatchStream" and
"Shared-memory rows"). A sequence that draws an end-of-generation token
leaves the stream and the batch.

`--sampler llama` samples with llama.cpp's own chain instead (the same
default chain as samplerd's: penalties over the last 64 tokens at 1.1,
top-k 40, top-p 0.95, temperature 0.8, a seeded draw; greedy: penalties,
then the most likely token) on the same forward pass, for comparison.
`--bench ROUNDS` alternates the two samplers and reports tokens/s.

Needs llama-cpp-python, grpcio, grpcio-tools, numpy.
"""

import argparse
import ctypes
import json
import os
import queue
import signal
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import grpc  # noqa: E402
import llama_cpp.llama_cpp as C  # noqa: E402
import samplerd_client as sc  # noqa: E402

pb = sc.pb

# The default chain's parameters, as samplerd.toml's [sampling] defaults
# and llama.cpp's common_params_sampling: both samplers use these.
REPEAT_LAST_N = 64
REPEAT_PENALTY = 1.1
TOP_K = 40
TOP_P = 0.95
TEMPERATURE = 0.8

# Tokens per prefill batch (llama.cpp's n_batch).
PREFILL_BATCH = 512

PROMPTS = [
    "Write a haiku about the sea.",
    "Name three uses of a paperclip.",
    "Explain in one sentence why the sky is blue.",
    "Give a short recipe for pancakes.",
    "What is the capital of France? Answer briefly.",
    "Describe a cat to someone who has never seen one.",
    "List four prime numbers.",
    "Tell a one-line joke about computers.",
]


GGML_LOG_LEVEL_ERROR = 3


@C.llama_log_callback
def _llama_log(level, text, _user):
    # llama.cpp logs every tensor it loads at INFO; only its errors matter here.
    if level == GGML_LOG_LEVEL_ERROR:
        sys.stderr.write(text.decode(errors="replace"))


class EngineError(Exception):
    """A failure the engine reports in one line (and exits 1)."""


class Model:
    """A llama.cpp model and a context for `n_seq` sequences of at most
    `n_ctx_seq` positions each."""

    def __init__(self, path, n_seq, n_ctx_seq, threads):
        C.llama_log_set(_llama_log, ctypes.c_void_p(0))
        C.llama_backend_init()
        mp = C.llama_model_default_params()
        # llama.cpp's AMX weight repacking (an "extra buffer type") dies
        # with SIGILL on VMs that do not enable AMX tiles for the process;
        # without it llama.cpp runs its ordinary AVX2/AVX-512 kernels.
        mp.use_extra_bufts = False
        self.model = C.llama_model_load_from_file(path.encode(), mp)
        if not self.model:
            raise EngineError(f"llama.cpp could not load the model {path!r}")
        self.vocab = C.llama_model_get_vocab(self.model)
        self.n_vocab = C.llama_vocab_n_tokens(self.vocab)
        cp = C.llama_context_default_params()
        cp.n_seq_max = n_seq
        cp.n_ctx = n_seq * n_ctx_seq
        # The prefill goes in batches of at most this many tokens (llama.cpp
        # sizes its compute buffer by it: ~200 MiB at 1,024 for this model).
        self.n_batch = max(PREFILL_BATCH, n_seq)
        cp.n_batch = cp.n_ubatch = self.n_batch
        cp.n_threads = cp.n_threads_batch = threads
        cp.no_perf = True
        self.n_seq, self.n_ctx_seq = n_seq, n_ctx_seq
        self.ctx = C.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise EngineError(f"llama.cpp could not make a context for {n_seq} sequences of {n_ctx_seq} positions")
        self.batch = C.llama_batch_init(self.n_batch, 0, 1)

    def close(self):
        C.llama_batch_free(self.batch)
        C.llama_free(self.ctx)
        C.llama_model_free(self.model)

    def tokenize(self, text):
        buf = (C.llama_token * (len(text) + 16))()
        n = C.llama_tokenize(self.vocab, text, len(text), buf, len(buf), True, True)
        if n < 0:
            raise EngineError(f"prompt of {len(text)} bytes has more than {len(buf)} tokens")
        return list(buf[:n])

    def chat_prompt(self, user):
        """`user` as a one-message chat in the model's template (raw when the
        model has none)."""
        tmpl = C.llama_model_chat_template(self.model, None)
        if not tmpl:
            return user.encode()
        msgs = (C.llama_chat_message * 1)(C.llama_chat_message(b"user", user.encode()))
        n = C.llama_chat_apply_template(tmpl, msgs, 1, True, None, 0)
        if n < 0:  # a template llama.cpp does not know
            return user.encode()
        buf = ctypes.create_string_buffer(n)
        C.llama_chat_apply_template(tmpl, msgs, 1, True, buf, n)
        return buf.raw[:n]

    def piece(self, token):
        buf = ctypes.create_string_buffer(64)
        n = C.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
        return buf.raw[:max(n, 0)]

    def is_eog(self, token):
        return bool(C.llama_vocab_is_eog(self.vocab, token))

    def reset(self):
        C.llama_memory_clear(C.llama_get_memory(self.ctx), True)

    def decode(self, entries):
        """One forward pass over `entries` = [(seq, pos, token, wants_logits)];
        the logits of entry i are then `logits_row(i)` when it wanted them."""
        b = self.batch
        for i, (seq, pos, tok, out) in enumerate(entries):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = out
        b.n_tokens = len(entries)
        rc = C.llama_decode(self.ctx, b)
        if rc != 0:
            raise EngineError(f"llama_decode failed with {rc} on a batch of {len(entries)} tokens")

    def logits_row(self, i):
        """A numpy view (no copy) of the logits of the last decode's entry i
        (llama_get_logits_ith takes the batch index), valid until the next
        decode."""
        return np.ctypeslib.as_array(C.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))


class SamplerdSampler:
    """Samples every live sequence's step in one SampleBatchStream message,
    the logits in a registered shared-memory region of one row per
    sequence."""

    name = "samplerd"

    def __init__(self, stub, model, prompts, seeds, params, timeout, stream_timeout):
        self.stub, self.params = stub, params
        self.region = sc.shared_rows(stub, rows=len(prompts), vocab=model.n_vocab, timeout=timeout)
        self.refs = [self.region.row(s) for s in range(len(prompts))]
        self.prompts, self.seeds = prompts, seeds
        self.joined = [False] * len(prompts)
        self.leaving = []
        self.requests = queue.Queue()
        try:
            # grpcio sends what the iterator yields from its own thread; None
            # (from close) ends it and so half-closes the stream.
            self.call = stub.SampleBatchStream(iter(self.requests.get, None), timeout=stream_timeout)
        except BaseException:
            self.region.close()
            raise
        self.last = {}

    def sample(self, model, live):
        """`live` = [(seq, batch index of its logits)]: the tokens chosen,
        in that order."""
        rows = []
        for seq, i in live:
            # One copy from llama.cpp's output buffer into the sequence's row.
            np.copyto(self.region.array[seq], model.logits_row(i))
            row = pb.BatchStreamRow(sequence_id=seq, shared=self.refs[seq])
            if not self.joined[seq]:
                # The joining row: the stream keeps the window, seed and step
                # from here. The window is the prompt's tail the chain reads
                # (repeat_last_n tokens).
                p = pb.SamplingParams()
                p.CopyFrom(self.params)
                p.seed = self.seeds[seq]
                row.params.CopyFrom(p)
                row.previous_tokens.extend(self.prompts[seq][-REPEAT_LAST_N:])
                self.joined[seq] = True
            rows.append(row)
        self.requests.put(pb.SampleBatchStreamRequest(rows=rows, leave=self.leaving))
        self.leaving = []
        resp = next(self.call)
        self.last = {int(s): r for s, r in zip(resp.sequence_ids, resp.rows)}
        return [self.last[seq].token_id for seq, _ in live]

    def probability(self, seq):
        return self.last[seq].probability

    def finish(self, seq):
        self.leaving.append(seq)

    def close(self, cancel=False):
        try:
            if cancel:
                self.call.cancel()
            self.requests.put(None)
            if not cancel:
                for _ in self.call:  # the server ends the stream after our half-close
                    pass
        finally:
            self.region.close()  # unregisters and unlinks the region


class LlamaSampler:
    """llama.cpp's own sampler chain per sequence (its penalties keep their
    own history), for comparison."""

    name = "llama"

    def __init__(self, model, prompts, seeds, greedy):
        self.chains = []
        for prompt, seed in zip(prompts, seeds):
            c = C.llama_sampler_chain_init(C.llama_sampler_chain_default_params())
            # The bundled libllama takes (n_vocab, last_n, repeat, freq, present).
            C.llama_sampler_chain_add(c, C.llama_sampler_init_penalties(model.n_vocab, REPEAT_LAST_N, REPEAT_PENALTY, 0.0, 0.0))
            if greedy:
                C.llama_sampler_chain_add(c, C.llama_sampler_init_greedy())
            else:
                C.llama_sampler_chain_add(c, C.llama_sampler_init_top_k(TOP_K))
                C.llama_sampler_chain_add(c, C.llama_sampler_init_top_p(TOP_P, 1))
                C.llama_sampler_chain_add(c, C.llama_sampler_init_temp(TEMPERATURE))
                C.llama_sampler_chain_add(c, C.llama_sampler_init_dist(seed))
            # The prompt is the penalties' initial window, as samplerd's
            # previous_tokens.
            for t in prompt[-REPEAT_LAST_N:]:
                C.llama_sampler_accept(c, t)
            self.chains.append(c)

    def sample(self, model, live):
        # llama_sampler_sample accepts the token into the chain itself.
        return [C.llama_sampler_sample(self.chains[seq], model.ctx, i) for seq, i in live]

    def probability(self, seq):
        return None

    def finish(self, seq):
        pass

    def close(self, cancel=False):
        for c in self.chains:
            C.llama_sampler_free(c)


def run(model, make_sampler, prompts, max_tokens, dump_step=None, ignore_eog=False, forward=True):
    """Prefills every prompt, then decodes all live sequences one token per
    forward pass until each has drawn an end-of-generation token (unless
    `ignore_eog`) or `max_tokens`. Returns the per-sequence tokens and
    probabilities, the timings and (at `dump_step`) a copy of that step's
    logits rows. `forward=False` skips the forward passes after the
    prefill and samples the same rows at every step: the sampler's cost
    alone, back to back."""
    model.reset()
    n = len(prompts)
    entries = []
    for seq, p in enumerate(prompts):
        if not p:
            raise EngineError(f"prompt {seq} has no tokens")
        if len(p) + max_tokens > model.n_ctx_seq:
            raise EngineError(f"prompt {seq} ({len(p)} tokens) + --max-tokens {max_tokens} exceed --ctx {model.n_ctx_seq}")
        entries += [(seq, pos, t, False) for pos, t in enumerate(p[:-1])]
    t0 = time.perf_counter()
    for i in range(0, len(entries), model.n_batch):
        model.decode(entries[i:i + model.n_batch])
    # Every prompt's last token in one batch, with logits: entry s is
    # sequence s, as in every step after.
    model.decode([(seq, len(p) - 1, p[-1], True) for seq, p in enumerate(prompts)])
    t_prefill = time.perf_counter() - t0
    sampler = make_sampler()
    tokens = [[] for _ in range(n)]
    probs = [[] for _ in range(n)]
    dumped = None
    live = [(s, s) for s in range(n)]
    ok = False
    # Per step: the sampler's time (copy into the region, the RPC, or
    # llama.cpp's chain) and the forward pass's. Their medians hold up on a
    # loaded machine where whole-run tokens/s swing several-fold.
    sample_s, forward_s = [], []
    t1 = time.perf_counter()
    try:
        step = 0
        while live:
            ts = time.perf_counter()
            chosen = sampler.sample(model, live)
            sample_s.append(time.perf_counter() - ts)
            if step == dump_step:
                dumped = {seq: model.logits_row(i).copy() for seq, i in live}
            nxt = []
            for (seq, _), tok in zip(live, chosen):
                tokens[seq].append(tok)
                probs[seq].append(sampler.probability(seq))
                if (model.is_eog(tok) and not ignore_eog) or len(tokens[seq]) >= max_tokens:
                    sampler.finish(seq)
                else:
                    nxt.append(seq)
            if not nxt:
                break
            if not forward:
                live = [(seq, i) for seq, i in live if seq in nxt]
                step += 1
                continue
            tf = time.perf_counter()
            model.decode([(seq, len(prompts[seq]) + len(tokens[seq]) - 1, tokens[seq][-1], True) for seq in nxt])
            forward_s.append(time.perf_counter() - tf)
            live = [(seq, i) for i, seq in enumerate(nxt)]
            step += 1
        ok = True
    finally:
        t_decode = time.perf_counter() - t1
        sampler.close(cancel=not ok)
    return {"tokens": tokens, "probabilities": probs, "prefill_s": t_prefill, "decode_s": t_decode,
            "generated": sum(len(t) for t in tokens), "dumped": dumped,
            "sample_ms_p50": 1e3 * statistics.median(sample_s) if sample_s else None,
            "forward_ms_p50": 1e3 * statistics.median(forward_s) if forward_s else None}


def sampling_params(greedy):
    """The default chain's parameters, spelled out (so that a server
    configured otherwise still compares with LlamaSampler)."""
    p = pb.SamplingParams(repeat_penalty=REPEAT_PENALTY, repeat_last_n=REPEAT_LAST_N)
    if greedy:
        p.temperature = 0.0
    else:
        p.top_k, p.top_p, p.temperature = TOP_K, TOP_P, TEMPERATURE
    return p


def connect(address, timeout):
    try:
        return sc.connect(address, ready_timeout=timeout)
    except grpc.FutureTimeoutError:
        raise EngineError(f"samplerd is not reachable at {address} (no connection within {timeout:g} s): "
                          "start it with `samplerd serve --listen unix:/PATH.sock` and pass "
                          "--address unix:///PATH.sock") from None


def make_sampler_factory(args, model, prompts, seeds, stub):
    if args.sampler == "llama":
        return lambda: LlamaSampler(model, prompts, seeds, args.greedy)
    params = sampling_params(args.greedy)
    return lambda: SamplerdSampler(stub, model, prompts, seeds, params, args.timeout, args.stream_timeout)


def bench(args, model, prompts, seeds, stub):
    """Alternates the two samplers `args.bench` rounds per sequence count:
    medians and spread (min-max) of decode tokens/s and their ratio, and
    the median per-step sampling and forward times with the ratio they
    imply, (forward + llama's sampling) / (forward + samplerd's); and the
    sampling per step with no forward pass between steps (`run(forward=
    False)`: the server's threads stay busy instead of waking). Every
    sequence runs to --max-tokens (end-of-generation tokens ignored), so
    both samplers decode the same number of tokens at the same batch sizes
    whatever they draw."""
    results = {}
    for n in args.bench_sequences:
        ps, ss = [prompts[i % len(prompts)] for i in range(n)], [seeds[0] + i for i in range(n)]
        for rnd in range(args.bench):
            for kind in ("samplerd", "llama"):
                a = argparse.Namespace(**{**vars(args), "sampler": kind})
                r = run(model, make_sampler_factory(a, model, ps, ss, stub), ps, args.max_tokens, ignore_eog=True)
                tps = r["generated"] / r["decode_s"]
                results.setdefault((n, kind), []).append((tps, r["sample_ms_p50"], r["forward_ms_p50"]))
                hot = run(model, make_sampler_factory(a, model, ps, ss, stub), ps, args.max_tokens, ignore_eog=True,
                          forward=False)["sample_ms_p50"]
                results.setdefault((n, kind, "hot"), []).append(hot)
                print(f"  round {rnd + 1} sequences {n} {kind:>8}: {tps:8.1f} tok/s ({r['generated']} tokens), "
                      f"per step: sampling {r['sample_ms_p50']:.3f} ms, forward {r['forward_ms_p50']:.2f} ms; "
                      f"sampling without forward passes {hot:.3f} ms", file=sys.stderr)
    report = []
    for n in args.bench_sequences:
        a, b = results[(n, "samplerd")], results[(n, "llama")]
        ta, tb = [x[0] for x in a], [x[0] for x in b]
        sa, sb = statistics.median(x[1] for x in a), statistics.median(x[1] for x in b)
        fwd = statistics.median(x[2] for x in a + b)
        report.append({"sequences": n, "samplerd_tok_s": statistics.median(ta), "samplerd_min": min(ta),
                       "samplerd_max": max(ta), "llama_tok_s": statistics.median(tb), "llama_min": min(tb),
                       "llama_max": max(tb), "ratio": statistics.median(ta) / statistics.median(tb),
                       "samplerd_sample_ms": sa, "llama_sample_ms": sb, "forward_ms": fwd,
                       "step_ratio": (fwd + sb) / (fwd + sa),
                       "samplerd_hot_sample_ms": statistics.median(results[(n, "samplerd", "hot")]),
                       "llama_hot_sample_ms": statistics.median(results[(n, "llama", "hot")])})
    return report


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.environ.get("SAMPLERD_MODEL", "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--address", default=os.environ.get("SAMPLERD_ADDR", "unix:///run/samplerd/samplerd.sock"),
                    help="samplerd's Unix socket as a gRPC target, unix:///PATH.sock (env SAMPLERD_ADDR)")
    ap.add_argument("--sampler", choices=("samplerd", "llama"), default="samplerd")
    ap.add_argument("--sequences", type=int, default=1)
    ap.add_argument("--prompt", action="append", help="a user message (repeatable; cycled over the sequences)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=42, help="sequence i draws with seed SEED + i")
    ap.add_argument("--greedy", action="store_true", help="temperature 0: penalties, then the most likely token")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=512, help="positions per sequence")
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds to connect and to register the region")
    ap.add_argument("--stream-timeout", type=float, default=600.0, help="deadline of one run's SampleBatchStream, seconds")
    ap.add_argument("--json", action="store_true", help="print one JSON object (tokens, probabilities, timings)")
    ap.add_argument("--dump-step", type=int, help="with --dump-logits: save this step's logits rows")
    ap.add_argument("--dump-logits", help=".npy file for --dump-step's rows (sequence order; NaN for a finished one)")
    ap.add_argument("--bench", type=int, metavar="ROUNDS", help="alternate both samplers ROUNDS times; print tok/s")
    ap.add_argument("--bench-sequences", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    args = ap.parse_args()
    if args.sequences < 1 or args.max_tokens < 1:
        ap.error("--sequences and --max-tokens must be >= 1")

    # SIGTERM ends the run like Ctrl-C: the finally blocks release the region.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    n_seq = max([args.sequences] + (args.bench_sequences if args.bench else []))
    channel = stub = None
    if args.sampler == "samplerd" or args.bench:
        channel, stub = connect(args.address, args.timeout)
    model = Model(args.model, n_seq, args.ctx, args.threads)
    try:
        users = args.prompt or PROMPTS
        prompts = [model.tokenize(model.chat_prompt(users[i % len(users)])) for i in range(n_seq)]
        seeds = [args.seed + i for i in range(n_seq)]
        if args.bench:
            report = bench(args, model, prompts, seeds, stub)
            print(json.dumps({"load": open("/proc/loadavg").read().split()[:3], "max_tokens": args.max_tokens,
                              "rounds": args.bench, "results": report}))
            return 0
        prompts, seeds = prompts[:args.sequences], seeds[:args.sequences]
        r = run(model, make_sampler_factory(args, model, prompts, seeds, stub), prompts, args.max_tokens,
                dump_step=args.dump_step if args.dump_logits else None)
        if args.dump_logits:
            rows = np.full((len(prompts), model.n_vocab), np.nan, dtype=np.float32)
            for seq, row in (r["dumped"] or {}).items():
                rows[seq] = row
            np.save(args.dump_logits, rows)
        tps = r["generated"] / r["decode_s"]
        if args.json:
            print(json.dumps({"sampler": args.sampler, "prompt_tokens": prompts, "tokens": r["tokens"],
                              "probabilities": r["probabilities"], "params": str(sampling_params(args.greedy)),
                              "seeds": seeds, "generated": r["generated"], "decode_tok_s": tps,
                              "prefill_s": r["prefill_s"]}))
        else:
            for seq, toks in enumerate(r["tokens"]):
                text = b"".join(model.piece(t) for t in toks).decode(errors="replace")
                print(f"--- sequence {seq} ({len(toks)} tokens)\n{text}")
            print(f"{args.sampler}: {r['generated']} tokens, {tps:.1f} tok/s decode "
                  f"({len(prompts)} sequences; prefill {r['prefill_s'] * 1e3:.0f} ms)")
        return 0
    finally:
        model.close()
        if channel is not None:
            channel.close()


if __name__ == "__main__":
    try:
        sys.exit(main())
    except EngineError as e:
        print(f"llama_cpp_engine: {e}", file=sys.stderr)
        sys.exit(1)
    except grpc.RpcError as e:
        print(f"llama_cpp_engine: samplerd refused the call:\n{sc.describe_error(e)}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
