"""deploy/: Kubernetes manifests against the offline schemas, systemd units with
systemd-analyze, and the daemon's systemd notify protocol with a drain in flight."""

from __future__ import annotations

import contextlib
import copy
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvxfer.client import RemoteBlocks
from kvxfer.config import load_config
from kvxfer.testing.engine import SyntheticEngine, make_layout
from kvxfer.testing.procs import SidecarFactory, free_port
from tests.test_sidecar import wait_for

K8S = Path("deploy/k8s")
K8S_VERSION = "1.37.0"
K8S_MIN_VERSION = "1.34.0"  # README: native sidecars (1.33) and DRA resource.k8s.io/v1 (1.34)


def _apply_json6902(doc: dict[str, Any], ops: list[dict[str, Any]]) -> None:
    for op in ops:
        assert op["op"] in ("replace", "add"), op
        *parents, last = op["path"].strip("/").split("/")
        node: Any = doc
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if isinstance(node, list):
            idx = len(node) if last == "-" else int(last)
            if op["op"] == "replace":
                node[idx] = op["value"]
            else:
                node.insert(idx, op["value"])
        else:
            assert op["op"] == "add" or last in node, f"{op['path']} does not exist"
            node[last] = op["value"]


def render(directory: Path) -> list[dict[str, Any]]:
    """The subset of kustomize these manifests use: resources, labels, JSON6902 patches."""
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    docs: list[dict[str, Any]] = []
    for res in k["resources"]:
        path = directory / res
        docs += render(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    for entry in k.get("labels", []):
        for d in docs:
            d["metadata"].setdefault("labels", {}).update(entry["pairs"])
            if entry.get("includeSelectors") and d["kind"] == "Deployment":
                d["spec"]["selector"]["matchLabels"].update(entry["pairs"])
                d["spec"]["template"]["metadata"]["labels"].update(entry["pairs"])
            if entry.get("includeSelectors") and d["kind"] == "Service":
                d["spec"]["selector"].update(entry["pairs"])
    for patch in k.get("patches", []):
        ops = yaml.safe_load((directory / patch["path"]).read_text())
        targets = [d for d in docs if d["kind"] == patch["target"]["kind"]
                   and d["metadata"]["name"] == patch["target"]["name"]]
        assert targets, patch
        for d in targets:
            _apply_json6902(d, ops)
    return copy.deepcopy(docs)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_overlays_render_and_validate(role: str) -> None:
    docs = render(K8S / "overlays" / role)
    shared = render(K8S / "shared")
    for d in docs + shared:
        for version in (K8S_MIN_VERSION, K8S_VERSION):
            kubernetes_validate.validate(d, version, strict=True)
    # shared resources stay out of the role overlays (a role label would flip between roles,
    # and deleting one role would delete the other's)
    assert {d["kind"] for d in docs} == {"Deployment", "Service"}
    assert all("kvxfer.io/role" not in d["metadata"].get("labels", {}) for d in shared)
    by_kind = {d["kind"]: d for d in docs + shared}
    dep, svc = by_kind["Deployment"], by_kind["Service"]
    assert dep["metadata"]["name"] == svc["metadata"]["name"] == f"{role}-vllm"
    pod = dep["spec"]["template"]
    assert dep["spec"]["selector"]["matchLabels"]["kvxfer.io/role"] == role
    assert svc["spec"]["selector"] == pod["metadata"]["labels"]
    (kvx,) = pod["spec"]["initContainers"]
    (vllm,) = pod["spec"]["containers"]
    assert kvx["restartPolicy"] == "Always"  # native sidecar
    env = {e["name"]: e.get("value") for e in kvx["env"]}
    assert env["KVXFER_ROLE"] == role
    # Control: unix socket first (in-pod CLI), the pod IP with mutual TLS; probes on the
    # plaintext health-only port (kubelet cannot do TLS). Every setting parses.
    assert env["KVXFER_CONTROL_TARGET"].split(",") == ["unix:///run/kvxfer/sidecar/control.sock",
                                                       "0.0.0.0:5701"]
    cfg = load_config(env={k: v for k, v in env.items() if v is not None and k != "KVXFER_CONFIG"})
    assert cfg.control_mutating == "local"
    assert cfg.health_target == "0.0.0.0:5702"
    tls = next(v for v in pod["spec"]["volumes"] if v["name"] == "control-tls")
    assert tls["secret"]["secretName"] == "kvxfer-control-tls"
    mount = next(m for m in kvx["volumeMounts"] if m["name"] == "control-tls")
    for path in (cfg.control_tls_cert, cfg.control_tls_key, cfg.control_tls_client_ca):
        assert os.path.dirname(path) == mount["mountPath"]
    assert int(env["KVXFER_DRAIN_TIMEOUT_S"]) < pod["spec"]["terminationGracePeriodSeconds"]
    ports = {p["name"]: p["containerPort"] for p in kvx["ports"]}
    assert ports["control"] == 5701
    assert ports["health"] == 5702
    assert kvx["readinessProbe"]["grpc"] == {"port": 5702, "service": "readiness"}
    assert kvx["livenessProbe"]["grpc"] == {"port": 5702, "service": "liveness"}
    live = kvx["livenessProbe"]  # (#37: a frozen sidecar is replaced within a few seconds)
    assert live["periodSeconds"] * live["failureThreshold"] + live["terminationGracePeriodSeconds"] <= 4
    assert kvx["startupProbe"]["grpc"] == {"port": 5702, "service": "readiness"}
    sec = kvx["securityContext"]
    assert sec["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert sec["runAsNonRoot"] is True
    assert sec["allowPrivilegeEscalation"] is False
    assert sec["readOnlyRootFilesystem"] is True
    assert sec["seccompProfile"] == {"type": "RuntimeDefault"}
    # a read-only root: everything it writes is an emptyDir, and HOME (NIXL's .nixl.cfg) is one
    writable = {m["mountPath"] for m in kvx["volumeMounts"] if not m.get("readOnly")}
    assert {"/run/kvxfer", "/tmp"} <= writable
    assert env["HOME"] == "/run/kvxfer"
    # Same socket dir, same /dev/shm, same GPU claim for engine and sidecar.
    for c in (kvx, vllm):
        assert {"kvxfer-run", "dshm"} <= {m["name"] for m in c["volumeMounts"]}
        assert c["resources"]["claims"] == [{"name": "gpu"}]
    # (a directory the sidecar makes 0700 inside the emptyDir, which is world-writable)
    assert "ipc:///run/kvxfer/sidecar/engine.sock" in " ".join(vllm["args"])
    assert env["KVXFER_ENGINE_SOCKET"] == "ipc:///run/kvxfer/sidecar/engine.sock"
    # Every name the pod refers to exists in the rendered output.
    claim = pod["spec"]["resourceClaims"][0]["resourceClaimTemplateName"]
    assert by_kind["ResourceClaimTemplate"]["metadata"]["name"] == claim
    # The handshake secret is required and never shipped: no usable secret in any manifest.
    secret = next(e for e in kvx["env"] if e["name"] == "KVXFER_SECRET")["valueFrom"]["secretKeyRef"]
    assert secret == {"name": "kvxfer-handshake", "key": "secret", "optional": False}
    assert "Secret" not in by_kind
    for doc in (K8S / "base").rglob("*.yaml"):
        assert "stringData" not in doc.read_text(), doc
        assert "kind: Secret" not in doc.read_text(), doc
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "5703"


def test_image_recipes_choose_one_variant_and_keep_the_engine_thin() -> None:
    """No container builder runs here: the recipes are checked. The sidecar image installs
    torch from the PyTorch index of its variant, then kvxfer[variant] (never a mixed resolve);
    the vLLM layer installs the connector with --no-deps."""
    side = Path("deploy/docker/Dockerfile").read_text()
    for variant, index in (("cpu", "cpu"), ("cu12", "cu128"), ("cu13", "cu130")):
        assert f"{variant})" in side
        assert f"index={index}" in side
    assert '"/src[${VARIANT}]"' in side
    assert side.index("download.pytorch.org") < side.index('"/src[${VARIANT}]"')  # torch first
    assert "USER 10001" in side
    assert "HOME=/run/kvxfer" in side
    engine = Path("deploy/docker/Dockerfile.vllm").read_text()
    assert "pip install --no-cache-dir --no-deps" in engine
    assert 'import kvxfer.connector' in engine
    import tomllib

    extras = tomllib.loads(Path("pyproject.toml").read_text())["project"]
    assert not any(d.startswith(("nixl", "torch")) for d in extras["dependencies"])
    opt = extras["optional-dependencies"]
    assert [d for d in opt["cu12"] if d.startswith("nixl")] == ["nixl-cu12>=1.5,<2"]
    assert [d for d in opt["cu13"] if d.startswith("nixl")] == ["nixl-cu13>=1.5,<2"]


def test_the_connector_imports_without_the_sidecars_packages() -> None:
    """What `pip install --no-deps kvxfer` into vLLM's image relies on: the connector (and
    vLLM) import without NIXL and gRPC, which only the sidecar uses."""
    pytest.importorskip("vllm")  # (`make test` installs it; the venv `make demo` builds has none)
    code = (
        "import sys, importlib.abc\n"
        "BLOCK = {'grpc', 'grpc_health', 'grpc_reflection', 'nixl', 'nixl_cu12', 'nixl_cu13'}\n"
        "class B(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in BLOCK:\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, B())\n"
        "import kvxfer.connector\n"
        "from kvxfer.connector import KvxferConnector\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


def test_validator_catches_a_broken_manifest() -> None:
    dep = next(d for d in render(K8S / "overlays" / "prefill") if d["kind"] == "Deployment")
    dep["spec"]["template"]["spec"]["initContainers"][0]["restartPolicy"] = 42
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSION, strict=True)


def _verify(path: Path) -> list[str]:
    """systemd-analyze's complaints about a unit file (it exits 0 on unknown keys)."""
    out = subprocess.run(["systemd-analyze", "verify", "--man=no", str(path)],
                         capture_output=True, text=True, timeout=60, check=False)
    return [line for line in (out.stdout + out.stderr).splitlines() if path.name in line] + (
        [f"exit {out.returncode}"] if out.returncode else [])


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_units_verify(tmp_path: Path) -> None:
    true = shutil.which("true") or "/bin/true"
    for unit in ("kvxfer@.service", "vllm@.service"):
        text = (Path("deploy/systemd") / unit).read_text()
        # verify checks that ExecStart binaries exist; point them at one that does.
        text = text.replace("/opt/kvxfer/bin/kvxfer", true).replace("/opt/vllm/bin/vllm", true)
        path = tmp_path / unit.replace("@", "@test")
        path.write_text(text)
        assert _verify(path) == [], unit
    bad = tmp_path / "bad@test.service"
    bad.write_text(f"[Service]\nType=notifyy\nExecStart={true}\n")
    assert _verify(bad)  # the check can fail


def test_systemd_unit_hardening_leaves_nixl_and_restarts_sane() -> None:
    """Under ProtectHome=yes the unit user's home is unreadable and NIXL aborts reading
    $HOME/.nixl.cfg when its agent starts: HOME must point inside the unit's runtime
    directory. A configuration error or a listener that cannot bind exits 2: never restarted."""
    unit = {}
    for line in (Path("deploy/systemd") / "kvxfer@.service").read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and not line.startswith("#"):
            unit.setdefault(key.strip(), []).append(value.strip())
    env = dict(v.split("=", 1) for v in unit["Environment"])
    assert unit["ProtectHome"] == ["yes"]
    runtime = "/run/" + unit["RuntimeDirectory"][0]
    assert env["HOME"] == runtime, env
    assert "2" in unit["RestartPreventExitStatus"][0].split()
    # a frozen sidecar is killed within a few seconds (#37): watchdog, then SIGKILL
    assert float(unit["WatchdogSec"][0]) + float(unit["TimeoutAbortSec"][0]) <= 3
    # and the daemon does exit 2 on a configuration error (what RestartPreventExitStatus sees)
    bad = subprocess.run([sys.executable, "-m", "kvxfer", "serve", "--engine-socket", "nope"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 2, bad.stderr


def test_systemd_notify_ready_watchdog_and_drain_on_sigterm(sidecars: SidecarFactory, tmp_path: Path) -> None:
    addr = str(tmp_path / "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(addr)
    sock.settimeout(0.2)
    got: list[str] = []

    def read_until(pred: Any, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end and not pred():
            with contextlib.suppress(TimeoutError):
                got.extend(sock.recv(4096).decode().splitlines())
        assert pred(), got

    ps = sidecars.start("sd-p")
    ds = sidecars.start("sd-d", "--chunk-mib", "1", "--max-inflight-chunks", "1", "--drain-timeout-s", "30",
                        env={"NOTIFY_SOCKET": addr, "WATCHDOG_USEC": "200000"})
    lay = make_layout(layers=32, num_blocks=160, heads=8, head_dim=128)  # 2 MiB blocks
    p, d = SyntheticEngine(lay, ps.endpoint, seed=1), SyntheticEngine(lay, ds.endpoint, seed=2)
    try:
        read_until(lambda: "READY=1" in got, 60)
        assert any(line.startswith("STATUS=serving") for line in got)
        read_until(lambda: got.count("WATCHDOG=1") >= 3, 5)
        p.start()
        d.start()
        reg = p.registered
        assert reg is not None
        pb, db = p.allocate(150), d.allocate(150)  # 300 MiB, 1 MiB at a time
        p.fill("drained", pb)
        p.client.hold("drained", pb)
        d.client.recv("drained", db, RemoteBlocks(reg.engine_id, reg.handshake_host, reg.handshake_port, pb))
        time.sleep(0.1)  # the read is under way
        ds.proc.send_signal(signal.SIGTERM)
        read_until(lambda: "STOPPING=1" in got, 10)
        done = wait_for(d.client, lambda a: bool(a.done or a.failed), timeout=60)
        assert not done.failed, done.failed  # the drain let the read finish
        assert d.verify("drained", db)
        assert ds.proc.wait(30) == 0
        assert "drained in" in ds.log()
    finally:
        p.close()
        d.close()
        sock.close()
        os.unlink(addr)


RULES = Path("deploy/prometheus/kvxfer-rules.yaml")
_SELECTOR = re.compile(r"\b(kvxfer_[a-z0-9_]+)(\{[^}]*\})?")
_MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*\"")
_COUNTED = re.compile(r"\b(?:rate|increase|irate)\(\s*(kvxfer_[a-z0-9_]+)")
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
_DURATION = re.compile(r"^\d+[smhd]$")
_TARGET_LABELS = {"instance", "job"}  # (added by the scrape, not by the sidecar)


def _families(text: str) -> tuple[dict[str, str], dict[str, set[str]]]:
    """A /metrics page's ``# TYPE`` of each family, and every series name with the label names
    seen on it."""
    types: dict[str, str] = {}
    series: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            types[name] = kind
        elif line.startswith("kvxfer"):
            name, _, rest = line.partition("{")
            labels = {kv.split("=")[0] for kv in rest.rpartition("}")[0].split(",") if "=" in kv}
            series.setdefault(name.split()[0], set()).update(labels)
    return types, series


def test_the_alerting_rules_name_only_metrics_and_labels_a_sidecar_exports(sidecars: SidecarFactory) -> None:
    """deploy/prometheus/kvxfer-rules.yaml: every rule is complete (alert, expr, severity,
    summary; ``for`` a duration); every ``kvxfer_*`` metric its expressions select is a series
    or a counter a real sidecar's /metrics has (never a histogram's bare name), counted with
    ``rate``/``increase`` only if it is a counter, matched and grouped on labels it has; and the
    labels its annotations print survive its grouping (a renamed metric or label leaves an
    alert that never fires, or says nothing)."""
    from kvxfer.observe import Observer

    port = free_port()
    sc = sidecars.start("rules", metrics_port=port)
    end = time.monotonic() + 20
    while True:  # (until it serves: ready, its heap settled)
        with contextlib.suppress(OSError):
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            if "\nkvxfer_ready 1.0" in text and "heap settled" in sc.log():
                break
        assert time.monotonic() < end, sc.log()
        time.sleep(0.2)
    types, series = _families(text)
    declared = {name: set(getattr(c, "_labelnames", ())) for name, c in
                Observer().registry._names_to_collectors.items()}  # (labels of counters not counted yet)
    groups = yaml.safe_load(RULES.read_text())["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) >= 10
    assert len({r["alert"] for r in rules}) == len(rules), "alert names repeat"
    for rule in rules:
        name_of = rule["alert"]
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
        assert rule["labels"]["severity"] in ("warning", "critical"), rule
        assert rule["annotations"]["summary"], rule
        assert _DURATION.match(rule.get("for", "0s")), rule
        expr = rule["expr"]
        assert expr.count("(") == expr.count(")"), rule
        assert expr.count("[") == expr.count("]"), rule
        selected = _SELECTOR.findall(expr)
        assert selected or expr.startswith("up{"), rule
        labels_of: set[str] = set(_TARGET_LABELS)
        for name, selector in selected:
            kind = types.get(name)
            assert name in series or kind == "counter", f"{name_of}: {name} is not a series on /metrics"
            known = (series.get(name, set()) | declared.get(name, set())
                     | declared.get(name.removesuffix("_total"), set()) | _TARGET_LABELS)
            matched = set(_MATCHER.findall(selector))
            assert matched <= known, f"{name_of}: {name} has no label {matched - known}"
            labels_of |= known
        for name in _COUNTED.findall(expr):
            assert types.get(name) == "counter", f"{name_of}: rate/increase of {name}, a {types.get(name)}"
        grouped = [{x.strip() for x in g.split(",") if x.strip()} for g in _GROUPING.findall(expr)]
        for g in grouped:
            assert g <= labels_of, f"{name_of}: grouped by {g - labels_of}"
        kept = set.intersection(*grouped) if grouped and " by " in f" {expr} " else labels_of
        printed = set(re.findall(r"\$labels\.([a-zA-Z_]+)", " ".join(rule["annotations"].values())))
        assert printed <= kept, f"{name_of}: prints {printed - kept}, gone after its grouping"
