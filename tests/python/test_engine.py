#!/usr/bin/env python3
"""The example engine (clients/python/examples/llama_cpp_engine.py) against
a real samplerd on a Unix socket: llama.cpp decodes 2 sequences × 16 tokens
and samplerd samples every step from shared-memory rows.

Checks that (a) a fixed seed gives the same tokens and probabilities twice;
(b) a step sampled from the shared rows equals `Sample` with the same
logits sent inline, token and probability bit for bit; (c) greedy output
equals llama.cpp's own sampler chain (penalties → greedy) on the same
forward pass, and a sequence that draws an end-of-generation token stops
while the other goes on; (d) every region is unregistered and its
/dev/shm file removed, also after a run interrupted midway; and that an
unreachable server is a clear error. Prints "N passed, M failed".

    python3 tests/python/test_engine.py --server-bin target/release/samplerd

Needs the venv from scripts/setup-python.sh (llama-cpp-python, grpcio,
grpcio-tools, numpy) and the model (scripts/fetch-model.sh).
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from harness import HEALTH_TIMEOUT_S, ROOT, Checks  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "clients", "python", "examples"))

MAX_TOKENS = 16
SEEDS = [7, 8]
# The second answers in a few tokens (greedy: "Yes." and <|im_end|>), so one
# sequence leaves the batch while the other goes on.
PROMPTS = ["Write a haiku about the sea.", "Reply with one word: yes or no?"]
DUMP_STEP = 2
RPC_TIMEOUT_S = 10.0
STREAM_TIMEOUT_S = 120.0


def default_server_bin():
    if os.environ.get("SAMPLERD_BIN"):
        return os.environ["SAMPLERD_BIN"]
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    return os.path.join(target, "release", "samplerd")


def wait_serving(address, proc):
    """Bounded: the standard health Check answers SERVING (b"\\x08\\x01")."""
    import grpc

    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    last = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"samplerd exited with {proc.returncode}")
        channel = grpc.insecure_channel(address, options=[("grpc.default_authority", "localhost")])
        try:
            check = channel.unary_unary("/grpc.health.v1.Health/Check")
            r = check(b"", timeout=1.0)
            if r == b"\x08\x01":
                return
            last = r
        except grpc.RpcError as e:  # not listening yet
            last = e.code()
        finally:
            channel.close()
        time.sleep(0.05)
    raise RuntimeError(f"samplerd not SERVING within {HEALTH_TIMEOUT_S}s (last: {last})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server-bin", default=default_server_bin())
    ap.add_argument("--model", default=os.environ.get("SAMPLERD_MODEL", os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")))
    args = ap.parse_args()
    if not os.path.isfile(args.model):
        print(f"test_engine: model {args.model} missing (scripts/fetch-model.sh)")
        return 1

    import grpc
    import llama_cpp_engine as eng

    sc, pb = eng.sc, eng.pb
    tmp = tempfile.TemporaryDirectory(prefix="samplerd-engine-")
    address = f"unix://{tmp.name}/samplerd.sock"
    env = dict(os.environ)
    env.pop("SAMPLERD_CONFIG", None)
    env.pop("SAMPLERD_LISTEN", None)
    proc = subprocess.Popen(
        [os.path.abspath(args.server_bin), "serve", "--listen", f"unix:{tmp.name}/samplerd.sock"],
        cwd=tmp.name,  # no samplerd.toml here: built-in defaults only
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    checks = Checks()
    model = channel = None
    try:
        wait_serving(address, proc)
        channel, stub = sc.connect(address, ready_timeout=RPC_TIMEOUT_S)
        model = eng.Model(args.model, len(PROMPTS), 256, threads=2)
        prompts = [model.tokenize(model.chat_prompt(p)) for p in PROMPTS]
        made = []  # every SamplerdSampler, for the region checks

        def samplerd(greedy, dump_step=None, sampler=eng.SamplerdSampler):
            def make():
                made.append(sampler(stub, model, prompts, SEEDS, eng.sampling_params(greedy), RPC_TIMEOUT_S, STREAM_TIMEOUT_S))
                return made[-1]
            return eng.run(model, make, prompts, MAX_TOKENS, dump_step=dump_step)

        sampled = samplerd(False, dump_step=DUMP_STEP)

        def t_fixed_seed_repeats():
            again = samplerd(False)
            assert again["tokens"] == sampled["tokens"], (again["tokens"], sampled["tokens"])
            assert again["probabilities"] == sampled["probabilities"]
            assert sampled["tokens"][0] != sampled["tokens"][1]
            assert all(p is not None and 0.0 < p <= 1.0 for ps in sampled["probabilities"] for p in ps)

        def t_shared_equals_inline():
            assert sampled["dumped"], "no sequence was live at the dumped step"
            for seq, row in sampled["dumped"].items():
                window = prompts[seq][-eng.REPEAT_LAST_N:] + sampled["tokens"][seq][:DUMP_STEP]
                params = eng.sampling_params(False)
                params.seed = SEEDS[seq]
                r = stub.Sample(pb.SampleRequest(logits_f32le=sc.f32le(row), previous_tokens=window, params=params,
                                                 step=DUMP_STEP), timeout=RPC_TIMEOUT_S)
                shared_tok = sampled["tokens"][seq][DUMP_STEP]
                shared_p = np.float32(sampled["probabilities"][seq][DUMP_STEP])
                assert r.token_id == shared_tok, (seq, r.token_id, shared_tok)
                assert np.float32(r.probability).view(np.uint32) == shared_p.view(np.uint32), (seq, r.probability, shared_p)

        def t_greedy_equals_llama_cpp():
            ours = samplerd(True)
            theirs = eng.run(model, lambda: eng.LlamaSampler(model, prompts, SEEDS, greedy=True), prompts, MAX_TOKENS)
            assert ours["tokens"] == theirs["tokens"], (ours["tokens"], theirs["tokens"])
            # Each sequence stops on its own: "Reply with one word" ends
            # with an end-of-generation token, the haiku runs to MAX_TOKENS.
            short, long_ = ours["tokens"][1], ours["tokens"][0]
            assert len(short) < MAX_TOKENS and model.is_eog(short[-1]), short
            assert not any(model.is_eog(t) for t in short[:-1]), short
            assert len(long_) == MAX_TOKENS and not any(model.is_eog(t) for t in long_), long_

        class Interrupted(eng.SamplerdSampler):
            """Ctrl-C in the middle of a run (its third step)."""
            def sample(self, model, live):
                self.steps = getattr(self, "steps", 0) + 1
                if self.steps == 3:
                    raise KeyboardInterrupt
                return super().sample(model, live)

        def t_interrupted_run_cleans_up():
            try:
                samplerd(False, sampler=Interrupted)
            except KeyboardInterrupt:
                return
            raise AssertionError("the interrupted run did not raise")

        def t_not_reachable():
            try:
                eng.connect(f"unix://{tmp.name}/nobody.sock", 0.5)
            except eng.EngineError as e:
                assert "not reachable" in str(e) and "nobody.sock" in str(e), e
                return
            raise AssertionError("connect to a missing socket succeeded")

        for name, fn in list(locals().items()):
            if name.startswith("t_"):
                checks.run(name[2:], fn)

        def t_regions_released():
            assert len(made) >= 4, len(made)
            for s in made:
                assert not os.path.exists(f"/dev/shm/{s.region.name}"), s.region.name
                try:
                    stub.UnregisterSharedMemory(pb.UnregisterSharedMemoryRequest(name=s.region.name), timeout=RPC_TIMEOUT_S)
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.NOT_FOUND, (s.region.name, e.code())
                    continue
                raise AssertionError(f"region {s.region.name} was still registered")

        checks.run("regions_released", t_regions_released)
    except Exception:
        checks.fail()
    finally:
        if model is not None:
            model.close()
        if channel is not None:
            channel.close()
        proc.kill()
        _, err = proc.communicate(timeout=10)
        if checks.failed:
            sys.stderr.write(err.decode(errors="replace")[-4000:])
        tmp.cleanup()
    return checks.exit_code()


if __name__ == "__main__":
    sys.exit(main())
