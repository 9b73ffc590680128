#!/usr/bin/env python3
"""Tests of the Python kit against a running samplerd started with a model:

    SAMPLERD_ADDR=127.0.0.1:PORT python test_kit.py -v

(scripts/ci/clients.sh python starts one and runs this).
"""

import os
import socket
import sys
import threading
import unittest

import grpc
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import samplerd_client as sc  # noqa: E402

ADDR = os.environ.get("SAMPLERD_ADDR")

# A vocabulary-sized vector whose maximum (at BEST) is only slightly above
# the rest: the default temperature (0.8) and top_k (40) would almost never
# draw it, so picking it shows temperature 0 reached the server.
N_VOCAB, BEST = 32000, 12345
FLAT = (np.arange(N_VOCAB) * 7919 % 1000 / 1000).astype(np.float32)
FLAT[BEST] = 1.5
CHAT = [("user", "Count from one to ten.")]


class CuttingProxy:
    """A TCP proxy to `upstream` whose open connections the test can cut:
    a replica dying mid-call, as its clients see it."""

    def __init__(self, upstream):
        host, port = upstream.removeprefix("http://").rsplit(":", 1)
        self.upstream = (host, int(port))
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.addr = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.lock = threading.Lock()
        self.open = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            with self.lock:
                self.open += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src, dst):
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self):
        with self.lock:
            cut, self.open = self.open, []
        for s in cut:
            try:
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass

    def close(self):
        self.sock.close()
        self.cut()


class KitTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if not ADDR:
            raise RuntimeError("SAMPLERD_ADDR is not set: point it at a samplerd started with --model (scripts/ci/clients.sh does)")
        cls.channel, cls.stub = sc.connect(ADDR)

    @classmethod
    def tearDownClass(cls):
        cls.channel.close()

    def test_f32le(self):
        self.assertEqual(sc.f32le([1.0, -2.5]), bytes([0, 0, 0x80, 0x3F, 0, 0, 0x20, 0xC0]))
        # A big-endian or float64 array is converted, not reinterpreted.
        self.assertEqual(sc.f32le(np.array([1.0, -2.5], dtype=">f8")), sc.f32le([1.0, -2.5]))

    def test_sample_raw_bytes(self):
        seed = 2**64 - 59
        r = sc.sample_logits(self.stub, FLAT, temperature=0.0, seed=seed, step=5, n_probs=3)
        self.assertEqual(r.token_id, BEST)
        self.assertEqual(r.seed, seed)
        self.assertEqual(r.step, 5)
        self.assertEqual([p.token_id for p in r.probs][:1], [BEST])
        self.assertEqual(len(r.probs), 3)
        self.assertLess(r.logprob, 0.0)

    def test_sparse_row(self):
        row = sc.sparse_row([0.5, 3.0, -np.inf, 2.0, 1.0], 2)
        self.assertEqual(list(row.ids), [1, 3])
        self.assertEqual(list(row.values), [3.0, 2.0])
        self.assertAlmostEqual(row.rest_logsumexp, np.log(np.exp(0.5) + np.exp(1.0)), places=12)
        self.assertEqual(row.vocab_size, 5)
        self.assertEqual(sc.sparse_row([1.0, 2.0], 2).rest_logsumexp, -np.inf)
        self.assertEqual(sc.sparse_row([1.0, -np.inf], 1).rest_logsumexp, -np.inf)
        # The default chain gives the dense row's answer for the top 1,024.
        for step in range(3):
            dense = sc.sample_logits(self.stub, FLAT, seed=11, step=step, n_probs=4)
            sparse = self.stub.Sample(sc.pb.SampleRequest(sparse=sc.sparse_row(FLAT, 1024), params=sc.pb.SamplingParams(seed=11),
                                                          step=step, n_probs=4), timeout=10)
            self.assertEqual(dense.token_id, sparse.token_id)
            self.assertEqual(dense.probability, sparse.probability)
            self.assertAlmostEqual(dense.logprob, sparse.logprob, delta=1e-6)
            self.assertEqual([p.token_id for p in dense.probs], [p.token_id for p in sparse.probs])

    def test_shared_rows_answer_as_inline_rows(self):
        logits = np.random.default_rng(5).standard_normal((3, N_VOCAB)).astype(np.float32)
        with sc.shared_rows(self.stub, rows=3, vocab=N_VOCAB) as shm:
            shm.array[:] = logits
            for i in range(3):
                shared = self.stub.Sample(sc.pb.SampleRequest(shared=shm.row(i), step=i, n_probs=2))
                inline = self.stub.Sample(sc.pb.SampleRequest(logits_f32le=sc.f32le(logits[i]), step=i, n_probs=2))
                self.assertEqual(shared, inline)
            name = shm.name
        with self.assertRaises(grpc.RpcError) as cm:
            self.stub.Sample(sc.pb.SampleRequest(shared=sc.pb.SharedLogits(region=name, count=N_VOCAB)))
        self.assertEqual(cm.exception.code(), grpc.StatusCode.NOT_FOUND)

    def test_bytes_equal_floats(self):
        a = sc.sample_logits(self.stub, FLAT, seed=3, step=2)
        b = self.stub.Sample(sc.pb.SampleRequest(logits=FLAT.tolist(), params=sc.pb.SamplingParams(seed=3), step=2), timeout=10)
        self.assertEqual(a, b)

    def test_sample_stream(self):
        logits = np.array([5.0, 4.9, 1.0, 0.0])
        with sc.SampleStream(self.stub, first_step=10, temperature=0.0, repeat_penalty=2.0, seed=11) as s:
            got = [s.step(logits) for _ in range(3)]
        self.assertEqual([r.step for r in got], [10, 11, 12])
        # 0 wins, then is penalised (5.0 / 2 < 4.9) so 1 wins, then both are
        # (2.5 > 2.45) and 0 wins again: the server kept the window.
        self.assertEqual([r.token_id for r in got], [0, 1, 0])
        self.assertTrue(all(r.seed == 11 for r in got))
        # Step t of the stream is Sample with step t and the window so far.
        again = sc.sample_logits(self.stub, logits, step=12, previous_tokens=[0, 1], temperature=0.0, repeat_penalty=2.0, seed=11)
        self.assertEqual(again, got[2])

    def test_sample_stream_resumes_bit_identically_after_a_cut(self):
        rng = np.random.default_rng(3)
        steps = [rng.standard_normal(64).astype(np.float32) for _ in range(8)]
        params = dict(seed=5, temperature=0.9, repeat_penalty=1.3, repeat_last_n=16)
        proxy = CuttingProxy(ADDR)
        channel, stub = sc.connect(proxy.addr)
        try:
            with sc.SampleStream(stub, previous_tokens=[1, 2, 3], first_step=4, **params) as s:
                got = []
                for i, logits in enumerate(steps):
                    if i in (3, 6):
                        proxy.cut()  # the stream's connection dies between steps
                    got.append(s.step(logits))
            self.assertEqual(s.resumes, 2)
        finally:
            channel.close()
            proxy.close()
        # The same steps on one uninterrupted stream: the same bits.
        with sc.SampleStream(self.stub, previous_tokens=[1, 2, 3], first_step=4, **params) as ref:
            want = [ref.step(logits) for logits in steps]
        self.assertEqual(got, want)
        self.assertEqual([r.step for r in got], list(range(4, 12)))

    def test_sample_stream_closes_quietly_when_its_connection_dies_after_the_last_answer(self):
        # Every step answered, then the replica goes away before the server
        # ends the stream: nothing was lost, so leaving the block raises
        # nothing.
        proxy = CuttingProxy(ADDR)
        channel, stub = sc.connect(proxy.addr)
        try:
            with sc.SampleStream(stub, temperature=0.0) as s:
                got = [s.step(np.array([1.0, 3.0, 2.0])) for _ in range(2)]
                proxy.cut()
            self.assertEqual([r.token_id for r in got], [1, 1])
            self.assertEqual(s.resumes, 0)
        finally:
            channel.close()
            proxy.close()

    def test_generate_resumes_bit_identically_after_a_cut(self):
        proxy = CuttingProxy(ADDR)
        channel, stub = sc.connect(proxy.addr)
        try:
            # No seed: the server's default, learnt from samplerd-seed.
            g = sc.generate(stub, messages=CHAT, max_tokens=16, ignore_eos=True, stop=["seven"], timeout=60.0)
            for _ in g:
                if len(g.tokens) == 5:
                    proxy.cut()
            self.assertEqual(g.resumes, 1)
        finally:
            channel.close()
            proxy.close()
        ref = sc.generate(self.stub, messages=CHAT, max_tokens=16, ignore_eos=True, stop=["seven"], timeout=60.0)
        list(ref)
        self.assertEqual([t.token_id for t in g.tokens], [t.token_id for t in ref.tokens])
        self.assertEqual([t.text for t in g.tokens], [t.text for t in ref.tokens])
        self.assertEqual([t.logprob for t in g.tokens], [t.logprob for t in ref.tokens])
        self.assertEqual(g.text, ref.text)
        self.assertEqual(g.finished.finish_reason, ref.finished.finish_reason)
        self.assertEqual(g.finished.usage.completion_tokens, ref.finished.usage.completion_tokens)
        self.assertGreaterEqual(g.finished.usage.resumed_tokens, 5)
        self.assertEqual(g.seed, ref.finished.seed)

    def test_service_config_names_the_idempotent_rpcs(self):
        cfg = sc.SERVICE_CONFIG
        self.assertEqual(cfg["loadBalancingConfig"], [{"round_robin": {}}])
        (method,) = cfg["methodConfig"]
        names = {(n["service"], n["method"]) for n in method["name"]}
        self.assertEqual(names, {("samplerd.v1.Sampler", "Sample"), ("samplerd.v1.Sampler", "SampleBatch"),
                                 ("samplerd.v1.Sampler", "ListStages"), ("samplerd.v1.Sampler", "Tokenize"),
                                 ("samplerd.v1.Sampler", "Detokenize"), ("samplerd.v1.Sampler", "GetServerInfo"),
                                 ("grpc.health.v1.Health", "Check")})
        self.assertEqual(method["retryPolicy"]["retryableStatusCodes"], ["UNAVAILABLE", "RESOURCE_EXHAUSTED"])

    def test_generate_with_deadline(self):
        g = sc.generate(self.stub, messages=CHAT, max_tokens=6, ignore_eos=True, seed=7, timeout=60.0)
        seen = [t.token_id for t in g]
        self.assertEqual(len(seen), 6)
        self.assertEqual(g.finished.finish_reason, sc.pb.MAX_TOKENS)
        self.assertEqual(g.finished.usage.completion_tokens, 6)
        self.assertGreater(g.finished.usage.prompt_tokens, 0)
        self.assertEqual(g.finished.seed, 7)

    def test_generate_cancel(self):
        g = sc.generate(self.stub, messages=CHAT, max_tokens=500, ignore_eos=True, seed=7, timeout=60.0)
        with self.assertRaises(grpc.RpcError) as cm:
            for _ in g:
                if len(g.tokens) == 3:
                    g.cancel()
        self.assertEqual(cm.exception.code(), grpc.StatusCode.CANCELLED)
        self.assertEqual(len(g.tokens), 3)
        self.assertIsNone(g.finished)
        # The server keeps serving.
        again = sc.generate(self.stub, messages=CHAT, max_tokens=2, ignore_eos=True, seed=7, timeout=60.0)
        self.assertEqual(len(list(again)), 2)
        self.assertEqual(again.finished.finish_reason, sc.pb.MAX_TOKENS)

    def test_generate_past_deadline(self):
        g = sc.generate(self.stub, messages=CHAT, max_tokens=2000, ignore_eos=True, timeout=0.3)
        with self.assertRaises(grpc.RpcError) as cm:
            list(g)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)

    def check_refusal(self, params, field, reason, call=None):
        with self.assertRaises(grpc.RpcError) as cm:
            if call is None:
                sc.sample_logits(self.stub, FLAT, **params)
            else:
                call()
        err = cm.exception
        self.assertEqual(err.code(), grpc.StatusCode.INVALID_ARGUMENT, sc.describe_error(err))
        self.assertIn(field.rsplit(".", 1)[-1], err.details())
        rich = sc.rich_error(err)
        self.assertIsNotNone(rich, "no grpc-status-details-bin trailer")
        self.assertEqual(rich.code, grpc.StatusCode.INVALID_ARGUMENT.value[0])
        self.assertEqual(rich.domain, "samplerd.v1", sc.describe_error(err))
        self.assertEqual(rich.reason, reason, sc.describe_error(err))
        self.assertIn(field, [f for f, _ in rich.field_violations], sc.describe_error(err))
        return rich

    def test_error_details_top_p(self):
        self.check_refusal({"top_p": 1.5}, "params.top_p", "SAMPLERD_PARAM_OUT_OF_RANGE")

    def test_error_details_temperature(self):
        self.check_refusal({"temperature": -1.0}, "params.temperature", "SAMPLERD_PARAM_OUT_OF_RANGE")

    def test_error_details_on_a_stream(self):
        # A streaming call's error carries the same trailer.
        g = sc.generate(self.stub, messages=CHAT, max_tokens=3, top_p=1.5)
        self.check_refusal({}, "params.top_p", "SAMPLERD_PARAM_OUT_OF_RANGE", call=lambda: list(g))

    def test_error_details_unknown_stage(self):
        chain = [sc.pb.StageSpec(name="no_such_stage")]
        rich = self.check_refusal({"chain": chain}, "params.chain", "SAMPLERD_UNKNOWN_STAGE")
        self.assertIsNotNone(rich.resource, rich.details)
        self.assertEqual(rich.resource[1], "no_such_stage")


if __name__ == "__main__":
    unittest.main()
