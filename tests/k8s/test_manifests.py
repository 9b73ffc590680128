#!/usr/bin/env python3
"""Checks the rendered Kubernetes manifests (every overlay under k8s/overlays)
against what samplerd actually does:

- the startup/readiness/liveness probes are native gRPC probes on the
  container port named `grpc`, which is the port the ConfigMap's
  samplerd.toml listens on; readiness/startup ask for the overall status
  (""), liveness for `samplerd.liveness` (SERVING while draining);
- the ConfigMap's samplerd.toml passes `samplerd check-config` (with the
  image's plugin directory replaced by a local copy of the core plugin, the
  only path that must exist on this machine), and a broken copy fails it;
- terminationGracePeriodSeconds exceeds shutdown.grace_period_secs plus the
  1 s close; connections age within about a minute (limits.max_connection_
  age_secs, for scale-ups) without cutting calls; the Services target the
  named ports; the pod is locked down;
- the Dockerfile puts the plugin and the model where the config says.

Run by scripts/ci/k8s.sh with the venv's python (needs PyYAML, shipped with
kubernetes-validate); SAMPLERD_BIN names the samplerd binary and
SAMPLERD_PLUGIN the core plugin library.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
import unittest

import yaml

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
OVERLAYS = os.path.join(ROOT, "k8s", "overlays")
KUBECTL = os.environ.get("KUBECTL", "kubectl")
TIMEOUT_S = 60
# shutdown::CLOSE_TIMEOUT: connections get this long after the drain.
CLOSE_TIMEOUT_S = 1
LIVENESS_SERVICE = "samplerd.liveness"


def render(overlay):
    out = subprocess.run(
        [KUBECTL, "kustomize", os.path.join(OVERLAYS, overlay)],
        check=True, capture_output=True, text=True, timeout=TIMEOUT_S,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def one(docs, kind, name=None):
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {len(found)}"
    return found[0]


def samplerd_container(deploy):
    (c,) = [c for c in deploy["spec"]["template"]["spec"]["containers"] if c["name"] == "samplerd"]
    return c


def config_toml(docs):
    cm = one(docs, "ConfigMap")
    return cm["data"]["samplerd.toml"]


def check_config(toml_text, extra_args=()):
    """Runs `samplerd check-config` on toml_text; returns the process."""
    bin_ = os.path.abspath(
        os.environ.get("SAMPLERD_BIN", os.path.join(ROOT, "target", "release", "samplerd")))
    plugin = os.path.abspath(os.environ.get(
        "SAMPLERD_PLUGIN", os.path.join(ROOT, "target", "release", "libsamplerd_core_stages.so")))
    # check-config opens the model's GGUF header, as serve would: the local
    # copy stands in for the image's, as the plugin directory does.
    model = os.path.abspath(os.environ.get(
        "SAMPLERD_MODEL", os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")))
    with tempfile.TemporaryDirectory(prefix="samplerd-k8s-") as tmp:
        plugins = os.path.join(tmp, "plugins")
        os.mkdir(plugins, 0o755)
        shutil.copy(plugin, os.path.join(plugins, os.path.basename(plugin)))
        cfg = os.path.join(tmp, "samplerd.toml")
        with open(cfg, "w") as f:
            f.write(toml_text)
        env = {k: v for k, v in os.environ.items() if not k.startswith("SAMPLERD_") and k != "RUST_LOG"}
        return subprocess.run(
            [bin_, "check-config", "--config", cfg, "--plugin-dir", plugins, "--model", model,
             *extra_args],
            capture_output=True, text=True, timeout=TIMEOUT_S, env=env, cwd=tmp,
        )


class Manifests(unittest.TestCase):
    overlays = sorted(d for d in os.listdir(OVERLAYS) if os.path.isdir(os.path.join(OVERLAYS, d)))

    def test_overlays_exist(self):
        for want in ("cpu", "cuda"):
            self.assertIn(want, self.overlays)

    def test_probes_are_grpc_on_the_listen_port(self):
        for overlay in self.overlays:
            with self.subTest(overlay=overlay):
                docs = render(overlay)
                c = samplerd_container(one(docs, "Deployment", "samplerd"))
                ports = {p["name"]: p["containerPort"] for p in c["ports"]}
                listen = tomllib.loads(config_toml(docs))["listen"]
                # One address or a list: the probes use the TCP one.
                tcp = [a for a in ([listen] if isinstance(listen, str) else listen) if not a.startswith("unix:")]
                self.assertEqual(len(tcp), 1, listen)
                self.assertEqual(int(tcp[0].rsplit(":", 1)[1]), ports["grpc"])
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    p = c[probe]
                    self.assertIn("grpc", p, f"{probe} is not a gRPC probe: {p}")
                    self.assertEqual(p["grpc"]["port"], ports["grpc"], probe)
                    for other in ("httpGet", "tcpSocket", "exec"):
                        self.assertNotIn(other, p)
                self.assertEqual(c["readinessProbe"]["grpc"].get("service", ""), "")
                self.assertEqual(c["startupProbe"]["grpc"].get("service", ""), "")
                self.assertEqual(c["livenessProbe"]["grpc"]["service"], LIVENESS_SERVICE)

    def test_metrics_port_matches_config(self):
        for overlay in self.overlays:
            with self.subTest(overlay=overlay):
                docs = render(overlay)
                c = samplerd_container(one(docs, "Deployment", "samplerd"))
                ports = {p["name"]: p["containerPort"] for p in c["ports"]}
                cfg = tomllib.loads(config_toml(docs))
                host, port = cfg["metrics"]["listen"].rsplit(":", 1)
                self.assertEqual(host, "0.0.0.0")
                self.assertEqual(int(port), ports["metrics"])
                ann = one(docs, "Deployment")["spec"]["template"]["metadata"]["annotations"]
                self.assertEqual(ann["prometheus.io/port"], str(ports["metrics"]))

    def test_termination_grace_exceeds_server_grace(self):
        for overlay in self.overlays:
            with self.subTest(overlay=overlay):
                docs = render(overlay)
                spec = one(docs, "Deployment")["spec"]["template"]["spec"]
                grace = tomllib.loads(config_toml(docs))["shutdown"]["grace_period_secs"]
                self.assertGreater(spec["terminationGracePeriodSeconds"], grace + CLOSE_TIMEOUT_S)

    def test_connections_age_within_about_a_minute(self):
        # A scale-up reaches clients balancing over the headless Service
        # once their connections age (GOAWAY, then the name is resolved
        # again): at most the age plus its 10 % jitter; and running calls
        # are never cut by it (grace >= the request duration cap).
        for overlay in self.overlays:
            with self.subTest(overlay=overlay):
                limits = tomllib.loads(config_toml(render(overlay)))["limits"]
                age = limits["max_connection_age_secs"]
                self.assertTrue(0 < age * 1.1 <= 66, age)
                self.assertGreaterEqual(limits["max_connection_age_grace_secs"],
                                        limits.get("max_request_duration_secs", 600))

    def test_pod_is_locked_down(self):
        for overlay in self.overlays:
            with self.subTest(overlay=overlay):
                docs = render(overlay)
                spec = one(docs, "Deployment")["spec"]["template"]["spec"]
                self.assertIs(spec["automountServiceAccountToken"], False)
                self.assertIs(one(docs, "ServiceAccount")["automountServiceAccountToken"], False)
                self.assertIs(spec["securityContext"]["runAsNonRoot"], True)
                for c in spec["containers"] + spec.get("initContainers", []):
                    sc = c["securityContext"]
                    self.assertIs(sc["allowPrivilegeEscalation"], False, c["name"])
                    self.assertIs(sc["readOnlyRootFilesystem"], True, c["name"])
                    self.assertEqual(sc["capabilities"]["drop"], ["ALL"], c["name"])
                    self.assertIn("limits", c["resources"], c["name"])

    def test_services_target_named_ports_and_headless_exists(self):
        docs = render("cpu")
        svc = one(docs, "Service", "samplerd")
        self.assertEqual({p["targetPort"] for p in svc["spec"]["ports"]}, {"grpc", "metrics"})
        headless = one(docs, "Service", "samplerd-headless")
        self.assertEqual(headless["spec"]["clusterIP"], "None")
        self.assertEqual([p["targetPort"] for p in headless["spec"]["ports"]], ["grpc"])
        for kind in ("PodDisruptionBudget", "HorizontalPodAutoscaler"):
            one(docs, kind)

    def test_cuda_overlay_requests_a_gpu(self):
        docs = render("cuda")
        spec = one(docs, "Deployment")["spec"]["template"]["spec"]
        c = samplerd_container(one(docs, "Deployment"))
        self.assertEqual(str(c["resources"]["limits"]["nvidia.com/gpu"]), "1")
        self.assertTrue(spec["tolerations"])
        self.assertTrue(spec["nodeSelector"])
        self.assertIn({"name": "SAMPLERD_MODEL__DEVICE", "value": "cuda"}, c["env"])
        self.assertTrue(c["image"].endswith("-cuda"), c["image"])

    def test_sidecar_shares_the_socket_and_memory_with_the_engine(self):
        docs = render("sidecar")
        spec = one(docs, "Deployment")["spec"]["template"]["spec"]
        cfg = tomllib.loads(config_toml(docs))
        sock = next(a for a in cfg["listen"] if a.startswith("unix:")).removeprefix("unix:")
        volumes = {v["name"]: v for v in spec["volumes"]}
        containers = {c["name"]: c for c in spec["containers"]}
        self.assertEqual(set(containers), {"samplerd", "engine"})
        mounts = {n: {m["mountPath"]: m["name"] for m in c["volumeMounts"]} for n, c in containers.items()}
        sock_dir = os.path.dirname(sock)
        for name in ("samplerd", "engine"):
            with self.subTest(container=name):
                # The socket's directory and every shared-memory directory
                # are the same Memory emptyDirs in both containers.
                self.assertIn(sock_dir, mounts[name])
                for d in cfg["transport"]["shared_memory_dirs"]:
                    self.assertIn(d, mounts[name])
                    self.assertEqual(mounts[name][d], mounts["samplerd"][d])
                    self.assertEqual(volumes[mounts[name][d]]["emptyDir"]["medium"], "Memory")
                self.assertEqual(mounts[name][sock_dir], mounts["samplerd"][sock_dir])
        env = {e["name"]: e["value"] for e in containers["engine"]["env"]}
        self.assertEqual(env["SAMPLERD_ADDR"], f"unix://{sock}")

    def test_configmap_passes_check_config(self):
        for overlay in self.overlays:
            with self.subTest(overlay=overlay):
                toml_text = config_toml(render(overlay))
                r = check_config(toml_text)
                self.assertEqual(r.returncode, 0, r.stderr)
                effective = tomllib.loads(r.stdout)
                self.assertEqual(effective["listen"], tomllib.loads(toml_text)["listen"])
                self.assertEqual(effective["metrics"]["listen"], "0.0.0.0:9090")
                self.assertIn("# default chain", r.stdout)

    @unittest.skipUnless(shutil.which("cc"), "no C compiler for the example plugin")
    def test_custom_plugin_overlay_loads_the_plugin_with_its_args(self):
        # What the pod does, with local paths: the init container's command
        # fills <volume>/lib, samplerd runs with the Deployment's args.
        docs = render("custom-plugin")
        spec = one(docs, "Deployment")["spec"]["template"]["spec"]
        (init,) = spec["initContainers"]
        c = samplerd_container(one(docs, "Deployment"))
        init_mount = init["volumeMounts"][0]
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == init_mount["name"]]
        self.assertIs(mount.get("readOnly"), True)
        with tempfile.TemporaryDirectory(prefix="samplerd-k8s-plugin-") as tmp:
            os.chmod(tmp, 0o755)
            image_plugins = os.path.join(tmp, "image")
            os.mkdir(image_plugins, 0o755)
            subprocess.run(
                ["cc", "-std=c11", "-O2", "-shared", "-fPIC",
                 "-I", os.path.join(ROOT, "plugins", "sdk", "include"),
                 os.path.join(ROOT, "plugins", "examples", "ban_tokens.c"),
                 "-o", os.path.join(image_plugins, "libban_tokens.so")],
                check=True, timeout=TIMEOUT_S)
            volume = os.path.join(tmp, "volume")
            os.mkdir(volume, 0o777)
            os.chmod(volume, 0o777)  # an emptyDir is world-writable
            script = init["command"][-1]
            script = script.replace(init_mount["mountPath"], volume).replace("/plugins/", image_plugins + "/")
            subprocess.run(["sh", "-c", script], check=True, timeout=TIMEOUT_S)
            args = c["args"]
            self.assertEqual(args[0], "serve")
            dirs = [args[i + 1] for i, a in enumerate(args) if a == "--plugin-dir"]
            self.assertIn("/opt/samplerd/plugins", dirs)
            extra = [d for d in dirs if d.startswith(mount["mountPath"])]
            self.assertEqual(len(extra), 1, dirs)
            # The container mounts only the volume's `subPath` (the
            # world-writable emptyDir root stays out of its view, where the
            # plugin trust check would refuse it): here, that directory is
            # moved beside the volume, as the bind mount would show it.
            mounted = os.path.join(tmp, "mounted")
            os.rename(os.path.join(volume, mount.get("subPath", "")), mounted)
            local_extra = extra[0].replace(mount["mountPath"], mounted)
            r = check_config(config_toml(docs), ["--plugin-dir", local_extra])
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertRegex(r.stdout, r"ban_tokens\s+ban_tokens_example")

    def test_check_config_rejects_a_broken_configmap(self):
        # Control: the check above can fail.
        text = config_toml(render("cpu")).replace("grace_period_secs = 25", "grace_period_secs = 99999")
        self.assertIn("99999", text)
        r = check_config(text)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("shutdown.grace_period_secs", r.stderr)

    def test_dockerfile_matches_config_paths(self):
        with open(os.path.join(ROOT, "Dockerfile")) as f:
            dockerfile = f.read()
        cfg = tomllib.loads(config_toml(render("cpu")))
        self.assertIn("COPY k8s/base/samplerd.toml /etc/samplerd/samplerd.toml", dockerfile)
        for d in cfg["plugins"]["dirs"]:
            self.assertIn(f"/out/plugins/ {d}/", dockerfile)
        model_dir, model_file = cfg["model"]["path"].rsplit("/", 1)
        self.assertIn(f"/models/{model_file} {model_dir}/", dockerfile)
        self.assertIn("USER 10001:10001", dockerfile)
        self.assertIn("--target cuda", dockerfile)


if __name__ == "__main__":
    sys.exit(0 if unittest.main(verbosity=2, exit=False).result.wasSuccessful() else 1)
