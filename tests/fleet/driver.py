#!/usr/bin/env python3
"""The fleet test's driver: run by scripts/fleet-test.sh inside the client
network namespace, which has set up the namespaces r1..r4 (replicas on
10.77.0.11..14), HAProxy on 10.77.0.2:50051 and this namespace's own
/etc/hosts ($FLEET_HOSTS), where the name `samplerd-fleet` lists the
replicas as a headless Service's DNS answer does.

It starts the replicas (`ip netns exec`), checks that every replica gives
the same bytes for the same request and seed, then keeps a mixed load
running — Sample, SampleStream, SampleBatchStream and Generate, through
the balancer and through client-side round_robin over `samplerd-fleet`,
with clients/service-config.json's retry policy and the Python kit's
stream resumption — through these scenarios:

  steady        nothing happens (the baseline)
  kill          SIGKILL one replica, restart it
  rolling       SIGTERM (drain) and restart each replica in turn
  join          a fourth replica starts and is added to the name: the
                round-robin clients reach it within the connection age
                (the balancer has it disabled meanwhile), then the
                balancer sends it calls too
  link-down     one replica's link goes down: clients detect the dead
                peer (keepalive) and fail over within their deadlines

Every call's result is checked against the reference (the same request on
one replica, undisturbed): a unary call must succeed (retries allowed), a
stream must deliver exactly the reference's responses (resumes allowed).
Prints a table (requests, failures, retries, resumes, p50/p99 per scenario
and RPC) and exits 1 if anything was lost.
"""

import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "clients", "python"))
import samplerd_client as sc  # noqa: E402

pb = sc.pb
PREFIX = os.environ["FLEET_PREFIX"]
WORK = os.environ["FLEET_WORK"]
HOSTS = os.environ["FLEET_HOSTS"]
HAPROXY_SOCK = os.environ["FLEET_HAPROXY_SOCK"]

NAME = "samplerd-fleet"
PORT = 50051
IPS = {"r1": "10.77.0.11", "r2": "10.77.0.12", "r3": "10.77.0.13", "r4": "10.77.0.14"}
LB = f"10.77.0.2:{PORT}"
# The replicas' maximum connection age and grace, short so that the join
# is seen within seconds (a deployment uses a minute or more).
AGE_S, GRACE_S = 3, 4
# Round-robin clients see a new replica once a connection has aged (its
# GOAWAY makes the channel resolve the name again): within the age plus
# its jitter, a re-resolution's minimum interval and a connect.
JOIN_BOUND_S = AGE_S * 1.1 + 0.5 + 3.0

# Clients find a dead peer by keepalive (1 s pings, 1 s to answer) rather
# than by their deadline, reconnect quickly, and resolve the name again at
# most every 500 ms. gRPC's defaults (no keepalive, 1 s to 120 s reconnect
# backoff, 30 s between resolutions) suit long-lived production clients;
# here they would only stretch the test.
CLIENT_OPTIONS = [
    ("grpc.keepalive_time_ms", 1000),
    ("grpc.keepalive_timeout_ms", 1000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.dns_min_time_between_resolutions_ms", 500),
]
UNARY_TIMEOUT_S = 15.0
STREAM_TIMEOUT_S = 60.0

VOCAB = 2048
STREAM_STEPS = 10
BATCH_STEPS = 8
VARIANTS = 4


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- the replicas ------------------------------------------------------------

class Replica:
    def __init__(self, name):
        self.name, self.ip = name, IPS[name]
        self.ns = f"{PREFIX}-{name}"
        self.addr = f"{self.ip}:{PORT}"
        self.proc = None
        self.config = os.path.join(WORK, f"{name}.toml")
        with open(self.config, "w") as f:
            f.write(f"""listen = "{self.addr}"
[tls]
# Plaintext between namespaces: samplerd refuses it off loopback unless told.
allow_insecure = true
[plugins]
files = ['{os.environ["FLEET_PLUGIN"]}']
[model]
path = '{os.environ["FLEET_MODEL"]}'
[metrics]
listen = "{self.ip}:9090"
[limits]
max_connection_age_secs = {AGE_S}
max_connection_age_grace_secs = {GRACE_S}
sampling_threads = 2
[limits.parallel_logprob]
enabled = false
[generate]
n_threads = 1
[shutdown]
grace_period_secs = 10
""")

    def start(self):
        out = open(os.path.join(WORK, f"{self.name}.log"), "ab")
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", self.ns, os.environ["FLEET_BIN"], "serve", "--config", self.config],
            stdout=out, stderr=subprocess.STDOUT)

    def wait_serving(self, timeout=90.0):
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.addr) as ch:
            check = ch.unary_unary("/grpc.health.v1.Health/Check")
            while True:
                try:
                    # HealthCheckRequest{service: ""} is empty; SERVING = field 1 = 1.
                    if check(b"", timeout=1.0) == b"\x08\x01":
                        return
                except grpc.RpcError:
                    pass
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited ({self.proc.returncode}) before serving")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name} not SERVING within {timeout} s")
                time.sleep(0.1)

    def kill(self):
        self.proc.kill()
        self.proc.wait(timeout=10)

    def drain(self):
        """SIGTERM, then wait for the drain to end (bounded)."""
        self.proc.terminate()
        rc = self.proc.wait(timeout=30)
        if rc != 0:
            raise RuntimeError(f"{self.name} exited {rc} after SIGTERM (a drain exits 0)")

    def metric(self, name):
        """This process's `name` series: {rpc label: value}."""
        with urllib.request.urlopen(f"http://{self.ip}:9090/metrics", timeout=2) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line.startswith(name + "{") and 'rpc="samplerd.v1.Sampler/' in line:
                rpc = line.split('rpc="samplerd.v1.Sampler/', 1)[1].split('"', 1)[0]
                out[rpc] = out.get(rpc, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    def requests(self):
        """Sampler calls this process has answered."""
        return sum(self.metric("samplerd_requests_total").values())

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def write_hosts(names):
    # In place (the same inode): ip netns exec bind-mounted this file.
    with open(HOSTS, "w") as f:
        f.write("127.0.0.1 localhost\n" + "".join(f"{IPS[n]} {NAME}\n" for n in names))


def haproxy(command):
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(HAPROXY_SOCK)
        s.sendall(command.encode() + b"\n")
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out.decode()


def haproxy_sessions(server):
    """Total sessions HAProxy sent to `server` (`show stat`'s stot)."""
    lines = haproxy("show stat").splitlines()
    header = lines[0].lstrip("# ").split(",")
    for line in lines[1:]:
        row = dict(zip(header, line.split(",")))
        if row.get("pxname") == "replicas" and row.get("svname") == server:
            return int(row["stot"] or 0)
    raise RuntimeError(f"HAProxy has no server {server}")


# --- the workload: fixed requests with known answers -------------------------

def logits(*key):
    rng = np.random.default_rng(list(key))
    return (rng.standard_normal(VOCAB) * 3).astype(np.float32)


def sample_request(v):
    return pb.SampleRequest(
        logits_f32le=sc.f32le(logits(1, v)), previous_tokens=[v, 7, 9], step=3 + v,
        params=pb.SamplingParams(seed=100 + v, temperature=0.8, top_k=40, repeat_penalty=1.2), n_probs=2)


def stream_params(v):
    return dict(seed=200 + v, temperature=0.9, repeat_penalty=1.3, repeat_last_n=8, top_k=50)


def batch_params(v):
    return pb.SamplingParams(seed=300 + v, temperature=0.7, repeat_penalty=1.2, repeat_last_n=8)


GENERATE_STOP = ["seven"]


def generate_messages(v):
    return [("user", ["Count from one to ten.", "Name five colours.", "Say hello.", "List three fruits."][v])]


def run_sample(stub, v):
    return stub.Sample(sample_request(v), timeout=UNARY_TIMEOUT_S).SerializeToString(), 0, 0


def run_stream(stub, v):
    with sc.SampleStream(stub, previous_tokens=[v, 1, 2], first_step=v, timeout=STREAM_TIMEOUT_S,
                         **stream_params(v)) as s:
        out = [s.step(logits(2, v, i)).SerializeToString() for i in range(STREAM_STEPS)]
    return out, 0, s.resumes


def run_batch_stream(stub, v):
    """Two sequences over one SampleBatchStream, resumed like the kit's
    SampleStream: on UNAVAILABLE a new stream whose joining rows carry
    each sequence's window and next step."""
    ids = (11, 12)
    tokens = {i: [] for i in ids}
    out, resumes, attempt, call, step = [], 0, 0, None, 0
    while step < BATCH_STEPS:
        if call is None:
            requests = queue.Queue()
            call = stub.SampleBatchStream(iter(requests.get, None), timeout=STREAM_TIMEOUT_S)
            joining = True
        msg = pb.SampleBatchStreamRequest(params=batch_params(v) if joining else None)
        for i in ids:
            row = pb.BatchStreamRow(sequence_id=i, logits=sc.f32le(logits(3, v, i, step)))
            if joining:
                row.previous_tokens[:] = [i, 4] + tokens[i]
                row.first_step = step
            msg.rows.append(row)
        requests.put(msg)
        try:
            resp = next(call)
        except grpc.RpcError as err:
            delay = sc.retry_delay(err, attempt)
            if delay is None:
                raise
            attempt, resumes, call = attempt + 1, resumes + 1, None
            requests.put(None)
            time.sleep(delay)
            continue
        joining, attempt = False, 0
        for i, r in zip(resp.sequence_ids, resp.rows):
            tokens[i].append(r.token_id)
        out.append(resp.SerializeToString())
        step += 1
    requests.put(None)
    try:
        for _ in call:  # the server ends the stream after our half-close
            pass
    except grpc.RpcError as err:
        # Every step has its answer: a connection lost before the server
        # ended the stream loses nothing (as the kit's SampleStream.close).
        if err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
            raise
    return out, 0, resumes


def run_generate(stub, v):
    g = sc.generate(stub, messages=generate_messages(v), max_tokens=12, ignore_eos=True, stop=GENERATE_STOP,
                    seed=400 + v, timeout=STREAM_TIMEOUT_S)
    tokens = [t.SerializeToString() for t in g]
    f = g.finished
    return (tokens, f.text, f.finish_reason, f.usage.completion_tokens, f.seed), 0, g.resumes


KINDS = {
    "Sample": run_sample,
    "SampleStream": run_stream,
    "SampleBatchStream": run_batch_stream,
    "Generate": run_generate,
}


# --- load and bookkeeping ----------------------------------------------------

class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.rows = {}  # (scenario, kind) -> dict
        self.failures = []
        self.scenario = "setup"
        self.retried = {}  # replica -> {rpc: samplerd_retried_requests_total} at the last look

    def row(self, scenario, kind):
        return self.rows.setdefault((scenario, kind), {"n": 0, "failed": 0, "retries": 0, "resumes": 0, "ms": []})

    def count_retries(self, replica, scenario):
        """Adds the retried attempts `replica` received since the last look
        to `scenario`. gRPC's retries are invisible to the caller; the
        replica that took the retry counts it (grpc-previous-rpc-attempts)."""
        try:
            now = replica.metric("samplerd_retried_requests_total")
        except OSError:
            return  # unreachable (its link is down): its retries are not counted
        before = self.retried.get(replica.name, {})
        with self.lock:
            for rpc, v in now.items():
                if rpc in KINDS and v > before.get(rpc, 0):
                    self.row(scenario, rpc)["retries"] += int(v - before.get(rpc, 0))
        self.retried[replica.name] = now

    def restarted(self, replica):
        self.retried[replica.name] = {}

    def record(self, scenario, kind, ms, ok, retries, resumes, why=None):
        with self.lock:
            r = self.row(scenario, kind)
            r["n"] += 1
            r["retries"] += retries
            r["resumes"] += resumes
            r["ms"].append(ms)
            if not ok:
                r["failed"] += 1
                self.failures.append(f"{scenario} {kind}: {why}")


def worker(name, stub, reference, stats, stop, seed, kinds=tuple(KINDS)):
    rng = np.random.default_rng(seed)
    n = 0
    while not stop.is_set():
        kind = kinds[n % len(kinds)]
        n += 1
        v = int(rng.integers(VARIANTS))
        t0 = time.monotonic()
        try:
            result, retries, resumes = KINDS[kind](stub, v)
            ok = result == reference[kind][v]
            why = None if ok else f"{name}: variant {v} differs from the reference"
        except Exception as e:  # noqa: BLE001 - every failure is counted and reported
            ok, retries, resumes = False, 0, 0
            try:
                why = f"{name}: variant {v}: {describe(e)}"
            except Exception as d:  # noqa: BLE001 - a failure to describe is still a failure
                why = f"{name}: variant {v}: {e!r} ({d!r})"
        # Counted in the scenario it ended in: what it met there decided it.
        stats.record(stats.scenario, kind, (time.monotonic() - t0) * 1e3, ok, retries, resumes, why)


def describe(e):
    if isinstance(e, grpc.RpcError):
        return sc.describe_error(e).replace("\n", " |")
    return f"{type(e).__name__}: {e}"


def percentile(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else 0.0


def table(stats, scenarios):
    head = f"{'scenario':<10} {'rpc':<18} {'requests':>8} {'failures':>8} {'retries':>7} {'resumes':>7} {'p50 ms':>8} {'p99 ms':>8}"
    lines = [head, "-" * len(head)]
    total = {"n": 0, "failed": 0, "retries": 0, "resumes": 0, "ms": []}
    for sc_name in scenarios:
        for kind in KINDS:
            r = stats.rows.get((sc_name, kind))
            if r is None:
                continue
            for k in ("n", "failed", "retries", "resumes"):
                total[k] += r[k]
            total["ms"] += r["ms"]
            lines.append(f"{sc_name:<10} {kind:<18} {r['n']:>8} {r['failed']:>8} {r['retries']:>7} {r['resumes']:>7} "
                         f"{percentile(r['ms'], 50):>8.1f} {percentile(r['ms'], 99):>8.1f}")
    lines.append("-" * len(head))
    lines.append(f"{'all':<10} {'':<18} {total['n']:>8} {total['failed']:>8} {total['retries']:>7} {total['resumes']:>7} "
                 f"{percentile(total['ms'], 50):>8.1f} {percentile(total['ms'], 99):>8.1f}")
    return "\n".join(lines), total


# --- the run -------------------------------------------------------------------

def main():
    replicas = {n: Replica(n) for n in IPS}
    problems = []
    try:
        for n in ("r1", "r2", "r3"):
            replicas[n].start()
        for n in ("r1", "r2", "r3"):
            replicas[n].wait_serving()
        write_hosts(["r1", "r2", "r3"])
        log("r1, r2, r3 serving")

        # Every replica answers every request with the same bytes.
        reference = {}
        for kind, run in KINDS.items():
            answers = {}
            for n in ("r1", "r2", "r3"):
                ch, stub = sc.connect(replicas[n].addr)
                with ch:
                    answers[n] = [run(stub, v)[0] for v in range(VARIANTS)]
            if not answers["r1"] == answers["r2"] == answers["r3"]:
                problems.append(f"{kind}: the replicas answer the same requests differently")
            reference[kind] = answers["r1"]
        log("the same request and seed give the same bytes on r1, r2 and r3"
            if not problems else "; ".join(problems))

        lb_channel, lb_stub = sc.connect(LB, options=CLIENT_OPTIONS)
        rr_channel, rr_stub = sc.connect(f"dns:///{NAME}:{PORT}", options=CLIENT_OPTIONS)
        stats, stop = Stats(), threading.Event()
        # Per kind of client: two workers cycling through the four RPCs, and
        # one sending only Samples back to back (so that unary calls are in
        # flight whenever a replica dies).
        plan = [("lb", lb_stub, tuple(KINDS)), ("rr", rr_stub, tuple(KINDS))] * 2 + \
               [("lb", lb_stub, ("Sample",)), ("rr", rr_stub, ("Sample",))]
        workers = [threading.Thread(target=worker, args=(f"{kind}-{i}", stub, reference, stats, stop, i, kinds),
                                    daemon=True)
                   for i, (kind, stub, kinds) in enumerate(plan)]
        scenarios = []

        def running():
            return [r for r in replicas.values() if r.proc is not None and r.proc.poll() is None]

        def scenario(name):
            for r in running():
                stats.count_retries(r, stats.scenario)
            stats.scenario = name
            scenarios.append(name)
            log(f"scenario {name}")

        def restart(r):
            r.start()
            stats.restarted(r)
            r.wait_serving()

        scenario("steady")
        for w in workers:
            w.start()
        time.sleep(6)

        scenario("kill")
        stats.count_retries(replicas["r2"], "kill")
        replicas["r2"].kill()
        log("r2 SIGKILLed")
        time.sleep(4)
        restart(replicas["r2"])
        log("r2 back")
        time.sleep(3)

        scenario("rolling")
        for n in ("r1", "r2", "r3"):
            stats.count_retries(replicas[n], "rolling")
            replicas[n].drain()
            restart(replicas[n])
            log(f"{n} drained and restarted")
            time.sleep(1)

        scenario("join")
        r4 = replicas["r4"]
        r4.start()
        r4.wait_serving()
        write_hosts(["r1", "r2", "r3", "r4"])
        t0 = time.monotonic()
        while r4.requests() == 0:
            if time.monotonic() - t0 > JOIN_BOUND_S:
                problems.append(f"join: no round-robin client reached r4 within {JOIN_BOUND_S:.1f} s")
                break
            time.sleep(0.1)
        else:
            log(f"r4 served round-robin clients {time.monotonic() - t0:.1f} s after joining the name "
                f"(bound {JOIN_BOUND_S:.1f} s: connection age {AGE_S} s ±10 %)")
        haproxy("enable server replicas/r4")
        t0 = time.monotonic()
        while haproxy_sessions("r4") == 0:
            if time.monotonic() - t0 > 5:
                problems.append("join: HAProxy sent r4 nothing within 5 s of enabling it")
                break
            time.sleep(0.1)
        time.sleep(2)

        scenario("link-down")
        subprocess.run(["ip", "-n", replicas["r1"].ns, "link", "set", "eth0", "down"], check=True)
        log("r1's link is down")
        time.sleep(8)

        stop.set()
        for w in workers:
            w.join(timeout=STREAM_TIMEOUT_S + 10)
        for r in running():
            stats.count_retries(r, stats.scenario)
        if any(w.is_alive() for w in workers):
            problems.append("a worker did not finish its last call")
        lb_channel.close()
        rr_channel.close()

        text, total = table(stats, scenarios)
        print("\n" + text)
        for f in stats.failures[:20]:
            print("FAILED " + f)
        if total["failed"]:
            problems.append(f"{total['failed']} of {total['n']} calls lost")
        for kind in KINDS:
            if not any(stats.rows.get((s, kind), {}).get("n") for s in scenarios):
                problems.append(f"no {kind} call ran")
        if not any(stats.rows.get((s, k), {}).get("resumes") for s in ("kill", "rolling", "link-down") for k in KINDS):
            problems.append("no stream was resumed: the scenarios did not cut any")
    finally:
        for r in replicas.values():
            r.stop()
    if problems:
        for p in problems:
            print("PROBLEM " + p)
        return 1
    print("\nnothing lost: every call answered, every stream equal to its reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
