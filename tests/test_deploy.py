"""Deployment as code, checked where it cannot run (no cluster, no fleet here).

- Kubernetes (deploy/k8s): every manifest, as written and as kustomize renders the example
  overlay (with and without the coordinator), validates strictly against the schemas of
  pinned Kubernetes versions (kubernetes-validate, offline). ServiceMonitor is a CRD the core
  schemas lack: it is checked against the fields of the Prometheus operator's CRD that a
  schema below spells out. Then what a schema cannot see: every reference resolves, the
  settings files load in powerd and name paths the pods mount, the probes hit real
  endpoints, the control plane meets the "restricted" Pod Security profile and the agent
  holds only what it needs.
- Bare metal (deploy/ansible): ansible-lint's production profile passes, and the playbook
  runs against this machine (connection local) in the mode for a host without systemd as
  PID 1: it installs a wheel built here, writes the settings and units, starts nothing; the
  result is checked file by file, and a second run changes nothing.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from powerd.agent.settings import AgentSettings
from powerd.controller.settings import ControllerSettings
from powerd.coordinator.main import CoordinatorSettings
from powerd.policy import load_policy, load_policy_text

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "deploy" / "k8s"
ANSIBLE = REPO / "deploy" / "ansible"
EXAMPLE = K8S / "overlays" / "example"

# The oldest Kubernetes a site may still run, and the newest whose schemas the pinned
# kubernetes-validate holds (constraints.txt).
KUBERNETES_VERSIONS = ("1.30", "1.37")

CONTROL_PLANE_NS = "powerd"
NODE_NS = "powerd-node"

# What the operator creates by hand (docs/operations.md, "Kubernetes"): never rendered.
OPERATOR_SECRETS = {
    "powerd-controller",
    "powerd-coordinator",
    "powerd-api-tokens",
    "powerd-mosquitto-passwd",
    "powerd-mosquitto-tls",
    "powerd-prometheus",
}
OPERATOR_CONFIGMAPS = {"powerd-broker-ca"}

_DURATION = (
    r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
)
_SECRET_KEY = {
    "type": "object",
    "required": ["key"],
    "additionalProperties": False,
    "properties": {
        "key": {"type": "string"},
        "name": {"type": "string"},
        "optional": {"type": "boolean"},
    },
}
_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
        "matchExpressions": {"type": "array", "items": {"type": "object"}},
    },
}
# ServiceMonitor (monitoring.coreos.com/v1), as the Prometheus operator's CRD defines it
# (example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml, operator
# 0.84): the spec's fields, and in full the parts of an endpoint these manifests use.
# Unknown fields are refused, as the API server's structural schema prunes or refuses them.
SERVICE_MONITOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object",
            "required": ["name", "namespace"],
            "properties": {"name": {"type": "string"}, "namespace": {"type": "string"}},
        },
        "spec": {
            "type": "object",
            "required": ["endpoints", "selector"],
            "additionalProperties": False,
            "properties": {
                "selector": _SELECTOR,
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "any": {"type": "boolean"},
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                    },
                },
                "jobLabel": {"type": "string"},
                "targetLabels": {"type": "array", "items": {"type": "string"}},
                "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                "sampleLimit": {"type": "integer"},
                "targetLimit": {"type": "integer"},
                "attachMetadata": {"type": "object"},
                "scrapeClass": {"type": "string", "minLength": 1},
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "targetPort": {"type": ["integer", "string"]},
                            "path": {"type": "string"},
                            "scheme": {"enum": ["http", "https"]},
                            "params": {"type": "object"},
                            "interval": {"type": "string", "pattern": _DURATION},
                            "scrapeTimeout": {"type": "string", "pattern": _DURATION},
                            "honorLabels": {"type": "boolean"},
                            "honorTimestamps": {"type": "boolean"},
                            "authorization": {
                                "type": "object",
                                "additionalProperties": False,
                                "properties": {
                                    "type": {"type": "string"},
                                    "credentials": _SECRET_KEY,
                                },
                            },
                            "tlsConfig": {"type": "object"},
                            "relabelings": {"type": "array", "items": {"type": "object"}},
                            "metricRelabelings": {"type": "array", "items": {"type": "object"}},
                        },
                    },
                },
            },
        },
    },
}


# ---- helpers ----


def _yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _generator_inputs(kustomization: Path) -> list[Path]:
    k = yaml.safe_load(kustomization.read_text())
    names = []
    for gen in k.get("configMapGenerator", []):
        names += [f.split("=")[-1] for f in gen.get("files", [])] + gen.get("envs", [])
    return [kustomization.parent / n for n in names]


def _manifest_files() -> list[Path]:
    """Every manifest as written: not the kustomizations, nor the files they turn into
    ConfigMaps (a policy, settings)."""
    inputs = {p for k in K8S.rglob("kustomization.yaml") for p in _generator_inputs(k)}
    return sorted(
        p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml" and p not in inputs
    )


def _validate(doc: dict[str, Any]) -> None:
    """Strict validation against each pinned version; a CRD against its own schema."""
    if doc["kind"] == "ServiceMonitor":
        jsonschema.validate(doc, SERVICE_MONITOR_SCHEMA)
        return
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


def _kustomize(folder: Path) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip(
            "kubectl (with its kustomize) is not installed: the plain manifests are checked"
        )
    proc = subprocess.run(
        [kubectl, "kustomize", str(folder)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


@pytest.fixture(scope="module", params=["example", "with-coordinator"])
def rendered(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, Any]]:
    """The example overlay as kustomize renders it; and a site that adds the coordinator
    (the example's images and policy, every component)."""
    if request.param == "example":
        return _kustomize(EXAMPLE)
    site = tmp_path_factory.mktemp("site")
    example = yaml.safe_load((EXAMPLE / "kustomization.yaml").read_text())
    shutil.copy(EXAMPLE / "policy.yaml", site / "policy.yaml")
    k8s = os.path.relpath(K8S, site)
    kustomization = {
        "resources": [f"{k8s}/base"],
        "components": [f"{k8s}/components/monitoring", f"{k8s}/components/coordinator"],
        "images": example["images"],
        "configMapGenerator": example["configMapGenerator"],
    }
    (site / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return _kustomize(site)


def _by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def _one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in _by_kind(docs, kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
    return found[0]


def _configmap(docs: list[dict[str, Any]], stem: str) -> dict[str, Any]:
    """A generated ConfigMap by its name before kustomize added the hash."""
    found = [
        d
        for d in _by_kind(docs, "ConfigMap")
        if re.fullmatch(re.escape(stem) + r"(-[a-z0-9]{10})?", d["metadata"]["name"])
    ]
    assert len(found) == 1, stem
    return found[0]


WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet")


def _workloads(docs: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    return (d for d in docs if d["kind"] in WORKLOADS)


def _containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    pod = workload["spec"]["template"]["spec"]
    return [*pod.get("initContainers", []), *pod["containers"]]


def _mounted(container: dict[str, Any], path: str | Path) -> bool:
    """Whether `path` is a mount point of the container or lies under one."""
    target = Path(path)
    for mount in container.get("volumeMounts", []):
        m = Path(mount["mountPath"])
        if target == m or m in target.parents:
            return True
    return False


def _settings_file(workload: dict[str, Any], docs: list[dict[str, Any]], tmp: Path) -> Path:
    """The settings file the container's --config names, written out from its ConfigMap."""
    container = _containers(workload)[0]
    args = container["args"]
    config = Path(args[args.index("--config") + 1])
    assert _mounted(container, config), f"{config} is not mounted"
    pod = workload["spec"]["template"]["spec"]
    mount = next(m for m in container["volumeMounts"] if Path(m["mountPath"]) == config.parent)
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    cm = _one(docs, "ConfigMap", volume["configMap"]["name"])
    out = tmp / config.name
    out.write_text(cm["data"][config.name])
    return out


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No POWERD_* of this machine in the settings the manifests are checked with."""
    for key in list(os.environ):
        if key.startswith("POWERD_"):
            monkeypatch.delenv(key)


# ---- Kubernetes: the manifests as written ----


@pytest.mark.parametrize("path", _manifest_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_each_manifest_validates_strictly(path: Path) -> None:
    docs = _yaml_docs(path)
    assert docs, f"{path} holds no manifest"
    for doc in docs:
        _validate(doc)


def test_strict_validation_refuses_a_misspelt_field() -> None:
    """The validator is no formality: a typo in a security context fails, as does a
    ServiceMonitor field the CRD does not have."""
    (controller,) = _yaml_docs(K8S / "base" / "controller" / "statefulset.yaml")
    context = controller["spec"]["template"]["spec"]["securityContext"]
    context["runAsNonRot"] = context.pop("runAsNonRoot")
    with pytest.raises(kubernetes_validate.ValidationError, match="runAsNonRot"):
        _validate(controller)
    monitor = _yaml_docs(K8S / "components" / "monitoring" / "servicemonitors.yaml")[0]
    monitor["spec"]["endpoints"][0]["bearerTokenSecrett"] = {"name": "x", "key": "y"}
    with pytest.raises(jsonschema.ValidationError, match="bearerTokenSecrett"):
        _validate(monitor)


def test_kustomizations_name_files_that_exist() -> None:
    """Every file and folder a kustomization names is there (checked without kustomize)."""
    kustomizations = [*K8S.rglob("kustomization.yaml")]
    kustomizations += [REPO / "systemd/mosquitto/kustomization.yaml"]
    kustomizations += [REPO / "docs/grafana/kustomization.yaml"]
    for path in kustomizations:
        k = yaml.safe_load(path.read_text())
        assert k["apiVersion"].startswith("kustomize.config.k8s.io/"), path
        named = [path.parent / e for e in [*k.get("resources", []), *k.get("components", [])]]
        for entry in [*named, *_generator_inputs(path)]:
            assert entry.exists(), f"{path}: {entry} does not exist"


def test_example_policy_is_valid() -> None:
    policy = load_policy(EXAMPLE / "policy.yaml")
    assert policy.site == "example"


# ---- Kubernetes: as rendered ----


@pytest.mark.process
def test_rendered_manifests_validate_strictly(rendered: list[dict[str, Any]]) -> None:
    for doc in rendered:
        _validate(doc)
    kinds = {d["kind"] for d in rendered}
    assert kinds >= {
        "Namespace",
        "StatefulSet",
        "Deployment",
        "DaemonSet",
        "Service",
        "PodDisruptionBudget",
        "ServiceMonitor",
        "ConfigMap",
        "PriorityClass",
    }
    _one(rendered, "StatefulSet", "powerd-controller")
    _one(rendered, "DaemonSet", "powerd-agent")
    _one(rendered, "Deployment", "powerd-mosquitto")


@pytest.mark.process
def test_every_image_is_set_by_the_overlay(rendered: list[dict[str, Any]]) -> None:
    """The base names placeholders; the overlay's `images:` must give each its registry
    and version, or a cluster would pull `powerd-agent:latest` from Docker Hub."""
    for workload in _workloads(rendered):
        for c in _containers(workload):
            name, _, tag = c["image"].rpartition(":")
            assert name and "/" not in tag and tag != "latest", c["image"]
            assert c["image"].startswith(("registry.example.com/", "eclipse-mosquitto:")), c[
                "image"
            ]


@pytest.mark.process
def test_every_reference_resolves(rendered: list[dict[str, Any]]) -> None:
    """ConfigMaps and Secrets the pods use are rendered or made by the operator (and the
    install guide says so); Services, PodDisruptionBudgets and ServiceMonitors select
    what exists, by ports that exist."""
    configmaps = {
        (d["metadata"]["namespace"], d["metadata"]["name"]) for d in _by_kind(rendered, "ConfigMap")
    }
    guide = (REPO / "docs" / "operations.md").read_text()
    for name in OPERATOR_SECRETS | OPERATOR_CONFIGMAPS:
        assert name in guide, f"docs/operations.md does not say how to make {name}"
    for w in _workloads(rendered):
        ns = w["metadata"]["namespace"]
        pod = w["spec"]["template"]["spec"]
        refs: list[tuple[str, str]] = []
        for v in pod.get("volumes", []):
            if "configMap" in v:
                refs.append(("configmap", v["configMap"]["name"]))
            if "secret" in v:
                refs.append(("secret", v["secret"]["secretName"]))
        for c in _containers(w):
            refs += [("configmap", e["configMapRef"]["name"]) for e in c.get("envFrom", [])]
            for e in c.get("env", []):
                source = e.get("valueFrom", {})
                if "secretKeyRef" in source:
                    refs.append(("secret", source["secretKeyRef"]["name"]))
        for kind, name in refs:
            if kind == "secret":
                assert name in OPERATOR_SECRETS, f"{w['metadata']['name']}: secret {name}"
            else:
                assert (ns, name) in configmaps or name in OPERATOR_CONFIGMAPS, (
                    f"{w['metadata']['name']}: configmap {name} in {ns}"
                )

    def selects(selector: dict[str, str], ns: str) -> list[dict[str, Any]]:
        return [
            w
            for w in _workloads(rendered)
            if w["metadata"]["namespace"] == ns
            and selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]

    for svc in _by_kind(rendered, "Service"):
        ns = svc["metadata"]["namespace"]
        (workload,) = selects(svc["spec"]["selector"], ns)
        ports = {p["name"] for c in _containers(workload) for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in ports, (svc["metadata"]["name"], port)
    for pdb in _by_kind(rendered, "PodDisruptionBudget"):
        ns = pdb["metadata"]["namespace"]
        (workload,) = selects(pdb["spec"]["selector"]["matchLabels"], ns)
        assert workload["kind"] == "StatefulSet" and workload["spec"]["replicas"] == 2
    for monitor in _by_kind(rendered, "ServiceMonitor"):
        ns = monitor["metadata"]["namespace"]
        wanted = monitor["spec"]["selector"]["matchLabels"]
        services = [
            s
            for s in _by_kind(rendered, "Service")
            if s["metadata"]["namespace"] == ns
            and wanted.items() <= s["metadata"]["labels"].items()
        ]
        assert services, monitor["metadata"]["name"]
        for s in services:
            names = {p["name"] for p in s["spec"]["ports"]}
            assert {e["port"] for e in monitor["spec"]["endpoints"]} <= names


@pytest.mark.process
def test_every_container_has_requests_limits_and_probes(rendered: list[dict[str, Any]]) -> None:
    for w in _workloads(rendered):
        for c in _containers(w):
            res = c["resources"]
            assert {"cpu", "memory"} <= res["requests"].keys(), c["name"]
            assert "memory" in res["limits"], c["name"]
            assert "cpu" not in res["limits"], f"{c['name']}: a CPU limit throttles the tick"
            assert "livenessProbe" in c and "readinessProbe" in c, c["name"]


def _probe_paths(container: dict[str, Any]) -> set[str]:
    probes = [
        container[k] for k in ("startupProbe", "livenessProbe", "readinessProbe") if k in container
    ]
    return {p["httpGet"]["path"] for p in probes if "httpGet" in p}


@pytest.mark.process
def test_probes_hit_the_real_health_endpoints(rendered: list[dict[str, Any]]) -> None:
    """Controllers and the coordinator: /healthz as their API routers serve it (readiness
    too: /readyz is the leader's only). The agent has no health endpoint: its metrics server,
    on the port its settings give it."""
    from powerd.api.routers import coordinator, health

    controller = _containers(_one(rendered, "StatefulSet", "powerd-controller"))[0]
    assert _probe_paths(controller) == {"/healthz"}
    assert "/healthz" in {r.path for r in health.router.routes}
    coordinators = [
        w
        for w in _by_kind(rendered, "StatefulSet")
        if w["metadata"]["name"] == "powerd-coordinator"
    ]
    for w in coordinators:
        assert _probe_paths(_containers(w)[0]) == {"/healthz"}
        assert "/healthz" in {r.path for r in coordinator.router.routes}
    agent = _containers(_one(rendered, "DaemonSet", "powerd-agent"))[0]
    assert _probe_paths(agent) == {"/metrics"}
    env = _configmap(rendered, "powerd-agent")["data"]
    port = next(p for p in agent["ports"] if p["name"] == "metrics")["containerPort"]
    assert int(env["POWERD_METRICS_PORT"]) == port
    assert env["POWERD_METRICS_HOST"] == "0.0.0.0"  # the kubelet probes the pod's address


@pytest.mark.process
def test_controller_settings_load_and_name_mounted_paths(
    rendered: list[dict[str, Any]], tmp_path: Path, clean_env: None
) -> None:
    sts = _one(rendered, "StatefulSet", "powerd-controller")
    container = _containers(sts)[0]
    env_names = {e["name"] for e in container["env"]}
    assert {"POWERD_DB", "POWERD_PASSWORD", "POWERD_CONTROLLER_ID"} <= env_names
    settings = ControllerSettings.load(
        _settings_file(sts, rendered, tmp_path),
        db="postgresql://powerd@db/powerd",
        controller_id="powerd-controller-0",
    )
    assert settings.leadership_mode() == "lease"  # a pair: the lease decides
    assert settings.mqtt_config().tls
    for path in (
        settings.policy,
        settings.tokens_file,
        settings.tls_ca_file,
        settings.state_path(),
    ):
        assert path is not None and _mounted(container, path), path
    claims = {t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]}
    state = next(m for m in container["volumeMounts"] if m["mountPath"] == "/var/lib/powerd")
    assert state["name"] in claims  # each member's own state file, on its own volume
    assert sts["spec"]["replicas"] == 2
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    anti = sts["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert (
        anti["requiredDuringSchedulingIgnoredDuringExecution"][0]["topologyKey"]
        == "kubernetes.io/hostname"
    )
    policy = _one(rendered, "ConfigMap", "powerd-policy")["data"]["policy.yaml"]
    assert load_policy_text(policy, "powerd-policy").site == "example"


@pytest.mark.process
def test_coordinator_settings_load_and_name_mounted_paths(
    rendered: list[dict[str, Any]], tmp_path: Path, clean_env: None
) -> None:
    found = [
        w
        for w in _by_kind(rendered, "StatefulSet")
        if w["metadata"]["name"] == "powerd-coordinator"
    ]
    if not found:
        pytest.skip("this site runs no coordinator")
    (sts,) = found
    container = _containers(sts)[0]
    settings = CoordinatorSettings.load(_settings_file(sts, rendered, tmp_path))
    assert settings.username == "powerd-coordinator"  # the ACL's user for it
    for path in (settings.policy, settings.tokens_file, settings.tls_ca_file, settings.state_file):
        assert path is not None and _mounted(container, path), path


@pytest.mark.process
def test_agent_settings_load_and_name_mounted_paths(
    rendered: list[dict[str, Any]], tmp_path: Path, clean_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds = _one(rendered, "DaemonSet", "powerd-agent")
    container = _containers(ds)[0]
    for key, value in _configmap(rendered, "powerd-agent")["data"].items():
        monkeypatch.setenv(key, value)
    # The node's own file: its password (the DaemonSet takes the node id from the node).
    node_file = tmp_path / "agent.toml"
    node_file.write_text('password = "this-node-s-own-password"\n')
    monkeypatch.setenv("POWERD_NODE_ID", "gpu-rack-1-01")
    monkeypatch.setenv("POWERD_USERNAME", "gpu-rack-1-01")
    settings = AgentSettings.load(node_file)
    assert settings.backend == "nvml" and settings.mqtt_config().tls
    assert settings.username == settings.node_id  # the ACL's %u
    for path in (settings.tls_ca_file, settings.state_dir):
        assert path is not None and _mounted(container, path), path
    args = container["args"]
    assert _mounted(container, args[args.index("--config") + 1])
    by_name = {e["name"]: e for e in container["env"]}
    for key in ("POWERD_NODE_ID", "POWERD_USERNAME"):
        assert by_name[key]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"


@pytest.mark.process
def test_control_plane_meets_the_restricted_profile(rendered: list[dict[str, Any]]) -> None:
    """Pod Security "restricted", which the namespace enforces: non-root, no escalation,
    every capability dropped, the runtime's seccomp profile, no host paths; and read-only
    root file systems besides."""
    namespaces = {d["metadata"]["name"]: d for d in _by_kind(rendered, "Namespace")}
    labels = namespaces[CONTROL_PLANE_NS]["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    for w in _workloads(rendered):
        if w["metadata"]["namespace"] != CONTROL_PLANE_NS:
            continue
        pod = w["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] > 0
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        assert pod["automountServiceAccountToken"] is False
        assert not any("hostPath" in v for v in pod.get("volumes", []))
        assert not pod.get("hostNetwork") and not pod.get("hostPID")
        for c in _containers(w):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"] == {"drop": ["ALL"]}


@pytest.mark.process
def test_agent_gets_the_gpus_and_nothing_more(rendered: list[dict[str, Any]]) -> None:
    ds = _one(rendered, "DaemonSet", "powerd-agent")
    assert ds["metadata"]["namespace"] == NODE_NS
    namespaces = {d["metadata"]["name"]: d for d in _by_kind(rendered, "Namespace")}
    assert (
        namespaces[NODE_NS]["metadata"]["labels"]["pod-security.kubernetes.io/enforce"]
        == "privileged"
    )
    pod = ds["spec"]["template"]["spec"]
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["nodeSelector"] and pod["tolerations"]
    assert not pod.get("hostNetwork") and not pod.get("hostPID")
    (c,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert "utility" in env["NVIDIA_DRIVER_CAPABILITIES"].split(",")  # NVML
    sc = c["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["SYS_ADMIN"]}
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    # It sees the GPUs without allocating any: workloads keep them all.
    assert not any(
        "nvidia.com" in k for k in [*c["resources"]["requests"], *c["resources"]["limits"]]
    )
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    sock = mounts["/var/lib/kubelet/pod-resources"]
    assert sock["readOnly"] is True
    assert volumes[sock["name"]]["hostPath"]["path"] == "/var/lib/kubelet/pod-resources"
    for path, mount in mounts.items():
        host = volumes[mount["name"]].get("hostPath")
        if host is not None and path != "/var/lib/powerd/agent":
            assert mount.get("readOnly") is True, path  # only its state is written on the node
    assert volumes[mounts["/etc/powerd/node/agent.toml"]["name"]]["hostPath"]["type"] == "File"


@pytest.mark.process
def test_broker_mounts_what_its_configuration_names(rendered: list[dict[str, Any]]) -> None:
    """The bare-metal broker's own files, unchanged, and every path they name mounted."""
    site = _configmap(rendered, "powerd-mosquitto")["data"]
    mosquitto = REPO / "systemd" / "mosquitto"
    assert site["powerd.conf"] == (mosquitto / "powerd.conf").read_text()
    assert site["acl"] == (mosquitto / "acl").read_text()
    main = _configmap(rendered, "powerd-mosquitto-main")["data"]["mosquitto.conf"]
    (broker,) = _containers(_one(rendered, "Deployment", "powerd-mosquitto"))
    config = broker["command"][broker["command"].index("-c") + 1]
    assert _mounted(broker, config)
    (include_dir,) = re.findall(r"^include_dir (\S+)$", main, re.M)
    named = re.findall(
        r"^(?:password_file|acl_file|certfile|keyfile|cafile) (\S+)$", site["powerd.conf"], re.M
    )
    assert len(named) == 5
    for path in [f"{include_dir}/powerd.conf", *named]:
        assert _mounted(broker, path), path
    (tls_port,) = re.findall(r"^listener (\d+)$", site["powerd.conf"], re.M)
    assert [p["containerPort"] for p in broker["ports"]] == [int(tls_port)]


@pytest.mark.process
def test_dashboard_configmap_is_the_dashboard(rendered: list[dict[str, Any]]) -> None:
    cm = _one(rendered, "ConfigMap", "powerd-grafana-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["data"]["powerd.json"] == (REPO / "docs" / "grafana" / "powerd.json").read_text()


# ---- bare metal: Ansible ----


def _venv_bin(tool: str) -> str:
    path = Path(sys.executable).parent / tool
    if not path.exists():
        pytest.skip(f"{tool} is not installed (the test extra installs it)")
    return str(path)


def _ansible_env(tmp: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "ANSIBLE_HOME": str(tmp / "ansible-home"),
        "ANSIBLE_NOCOLOR": "1",
        "NO_COLOR": "1",
    }


@pytest.mark.process
@pytest.mark.slow
def test_ansible_lint_production_profile_passes(tmp_path: Path) -> None:
    proc = subprocess.run(
        [_venv_bin("ansible-lint"), "--nocolor"],
        cwd=ANSIBLE,
        capture_output=True,
        text=True,
        env=_ansible_env(tmp_path),
        timeout=300,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "Profile 'production' was required, and it passed" in out, out[-2000:]


def _inventory(tmp: Path, wheel: Path, root: Path) -> dict[str, Any]:
    """This machine as one host that is both a controller and a GPU node, installing under
    `root` as the current user, with systemd left alone (powerd_systemd: false)."""
    policy = tmp / "policy.yaml"
    shutil.copy(EXAMPLE / "policy.yaml", policy)
    tokens = tmp / "tokens.toml"
    shutil.copy(REPO / "systemd" / "etc-powerd" / "tokens.toml", tokens)
    ca = tmp / "ca.crt"
    ca.write_text(
        "-----BEGIN CERTIFICATE-----\nnot checked by the install\n-----END CERTIFICATE-----\n"
    )
    user = os.getuid()
    import grp
    import pwd

    host = "gpu-rack-1-01"
    return {
        "all": {
            "hosts": {
                host: {
                    "ansible_connection": "local",
                    "ansible_python_interpreter": sys.executable,
                    "ansible_become": False,
                }
            },
            "vars": {
                "powerd_systemd": False,
                "powerd_wheel": str(wheel),
                "powerd_python": getattr(sys, "_base_executable", sys.executable),
                "powerd_venv": str(root / "opt/powerd"),
                "powerd_bin_link": str(root / "usr/bin/powerd"),
                "powerd_etc_dir": str(root / "etc/powerd"),
                "powerd_unit_dir": str(root / "etc/systemd/system"),
                "powerd_broker_url": "mqtts://broker.test:8883",
                "powerd_broker_ca": str(ca),
                "powerd_controller_user": pwd.getpwuid(user).pw_name,
                "powerd_controller_group": grp.getgrgid(os.getgid()).gr_name,
                "powerd_controller_manage_user": False,
                "powerd_controller_db_url": "postgresql://powerd:db-password@db.test/powerd",
                "powerd_controller_broker_password": "controller-password-0123456789",
                "powerd_controller_policy": str(policy),
                "powerd_controller_tokens": str(tokens),
                "powerd_agent_broker_password": "node-password-0123456789",
                "powerd_agent_site": "example",
                "powerd_bmc_agent_broker_password": "bmc-agent-password-0123456789",
                "powerd_bmc_agent_nodes": [
                    {
                        "node_id": "bmc-node-1",
                        "url": "https://10.9.0.1",
                        "username": "powerd",
                        "limits": "controls",
                    }
                ],
                "powerd_bmc_agent_bmc_passwords": {"bmc-node-1": "bmc-secret-1"},
            },
            "children": {
                "powerd_controllers": {"hosts": {host: {}}},
                "powerd_agents": {"hosts": {host: {}}},
                "powerd_bmc_agents": {"hosts": {host: {}}},
            },
        }
    }


def _play(tmp: Path, inventory: Path) -> tuple[str, dict[str, int]]:
    proc = subprocess.run(
        [_venv_bin("ansible-playbook"), "-i", str(inventory), "site.yml"],
        cwd=ANSIBLE,
        capture_output=True,
        text=True,
        env=_ansible_env(tmp),
        timeout=600,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    (recap,) = re.findall(r"^gpu-rack-1-01\s*:\s*(.*)$", out, re.M)
    return out, {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", recap)}


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.process
@pytest.mark.slow
def test_playbook_installs_a_controller_and_an_agent_here(tmp_path: Path) -> None:
    """The roles' CI mode: a wheel built here, installed into a venv with the release's
    constraints, settings and units written and checked, nothing started."""
    if os.geteuid() != 0:
        pytest.skip("the roles install files owned by root: run as root (CI does)")
    dist = tmp_path / "dist"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(REPO)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = dist.glob("powerd-*.whl")
    root = tmp_path / "root"
    inventory = tmp_path / "inventory.yml"
    inventory.write_text(yaml.safe_dump(_inventory(tmp_path, wheel, root)))

    out, recap = _play(tmp_path, inventory)
    assert recap["failed"] == 0 and recap["changed"] > 0

    # The command, from the venv, is the wheel's version.
    version = wheel.name.split("-")[1]
    proc = subprocess.run(
        [str(root / "usr/bin/powerd"), "--version"], capture_output=True, text=True, check=True
    )
    assert proc.stdout.strip() == f"powerd {version}"
    assert (root / "opt/powerd/bin/powerd").resolve() == (root / "usr/bin/powerd").resolve()

    etc = root / "etc/powerd"
    assert _mode(etc) == 0o750
    assert _mode(etc / "agent.toml") == 0o600  # this node's broker password
    assert _mode(etc / "controller.env") == 0o600
    assert _mode(etc / "controller.toml") == 0o640
    assert (etc / "policy.yaml").read_text() == (EXAMPLE / "policy.yaml").read_text()

    agent = tomllib.loads((etc / "agent.toml").read_text())
    assert agent["node_id"] == agent["username"] == "gpu-rack-1-01"
    assert agent["password"] == "node-password-0123456789"
    assert agent["site"] == "example" and agent["tls_ca_file"] == str(etc / "ca.crt")
    bmc = tomllib.loads((etc / "bmc-agent.toml").read_text())
    assert (
        bmc["password"] == "bmc-agent-password-0123456789"
        and _mode(etc / "bmc-agent.toml") == 0o600
    )
    credential = "/run/credentials/powerd-bmc-agent.service/bmc_bmc-node-1"
    assert bmc["nodes"] == [
        {
            "node_id": "bmc-node-1",
            "url": "https://10.9.0.1",
            "username": "powerd",
            "limits": "controls",
            "password_file": credential,
        }
    ]
    assert (etc / "bmc" / "bmc-node-1").read_text() == "bmc-secret-1\n"
    # The service's dynamic user reads nothing in /etc/powerd but its credentials.
    assert bmc["tls_ca_file"] == "/run/credentials/powerd-bmc-agent.service/bmc_broker-ca.crt"
    assert (etc / "bmc" / "broker-ca.crt").read_text() == (etc / "ca.crt").read_text()
    assert _mode(etc / "bmc") == 0o700 and _mode(etc / "bmc" / "bmc-node-1") == 0o600
    controller = tomllib.loads((etc / "controller.toml").read_text())
    assert controller["leadership"] == "lease" and controller["controller_id"] == "gpu-rack-1-01"
    env = dict(
        line.split("=", 1)
        for line in (etc / "controller.env").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert env == {
        "POWERD_DB": "postgresql://powerd:db-password@db.test/powerd",
        "POWERD_PASSWORD": "controller-password-0123456789",
    }

    # The units are the release's, with only the paths (and the user) put in.
    units = root / "etc/systemd/system"
    for unit in ("powerd-agent.service", "powerd-controller.service", "powerd-bmc-agent.service"):
        shipped = (REPO / "systemd" / unit).read_text()
        expected = shipped.replace("/usr/bin/powerd", str(root / "usr/bin/powerd")).replace(
            "/etc/powerd/", f"{etc}/"
        )
        installed = (units / unit).read_text()
        if unit == "powerd-controller.service":
            inv = yaml.safe_load(inventory.read_text())["all"]["vars"]
            expected = expected.replace("User=powerd\n", f"User={inv['powerd_controller_user']}\n")
            expected = expected.replace(
                "Group=powerd\n", f"Group={inv['powerd_controller_group']}\n"
            )
        assert installed == expected, unit
        analyze = shutil.which("systemd-analyze")
        if analyze is not None:
            verify = subprocess.run(
                [analyze, "verify", "--man=no", str(units / unit)],
                capture_output=True,
                text=True,
                check=False,
                env={**os.environ, "SYSTEMD_LOG_LEVEL": "notice"},
            )
            ours = [line for line in verify.stderr.splitlines() if unit in line]
            assert ours == [] and verify.returncode == 0, verify.stderr

    # Nothing was started: every task that starts or restarts a unit skipped.
    starts = re.findall(
        r"^(?:TASK|RUNNING HANDLER) \[[^]]*(?:start|Restart)[^]]*\][^\n]*\n(\w+)", out, re.M
    )
    assert starts and set(starts) == {"skipping"}, starts

    # A second run changes nothing (so it never restarts a controller or an agent for nothing).
    _, again = _play(tmp_path, inventory)
    assert again["changed"] == 0 and again["failed"] == 0
