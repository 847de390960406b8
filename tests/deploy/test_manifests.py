"""deploy/k8s: rendered by kustomize, core objects schema-checked, the KEDA trigger checked against lorafleet."""

from __future__ import annotations

import base64
import copy
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_kit import (
    DEPLOY,
    MODULE_OF,
    accepted_flags,
    by_kind,
    check_flags,
    copy_tree,
    make_secrets,
    nats_config_ok,
    options,
)

from lorafleet.core.config import FleetConfig, load_yaml_model
from lorafleet.core.wire import consumer_name

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[dev]' (kubernetes-validate)")

# The oldest Kubernetes these manifests promise to work on, and the newest the validator knows.
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
NATS_PODS = 3


@pytest.fixture(scope="module")
def k8s_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = copy_tree(DEPLOY / "k8s", tmp_path_factory.mktemp("deploy") / "k8s")
    make_secrets(root / "secrets", *(f"nats-{i}.nats-headless" for i in range(NATS_PODS)))
    return root


@pytest.fixture(scope="module")
def docs(k8s_dir: Path) -> list[dict[str, Any]]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed: cannot render deploy/k8s with kustomize")
    out = subprocess.run(["kubectl", "kustomize", str(k8s_dir)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in by_kind(docs, kind) if d["metadata"]["name"].startswith(name)]
    assert len(found) == 1, f"expected one {kind} {name}*, got {[d['metadata']['name'] for d in found]}"
    return found[0]


def _fleet(docs: list[dict[str, Any]]) -> FleetConfig:
    cm = _one(docs, "ConfigMap", "fleet-")
    return FleetConfig.model_validate(yaml.safe_load(cm["data"]["fleet.yaml"]))


def _secret_text(docs: list[dict[str, Any]], name: str, key: str) -> str:
    return base64.b64decode(_one(docs, "Secret", name)["data"][key]).decode()


def _container(obj: dict[str, Any]) -> dict[str, Any]:
    (container,) = obj["spec"]["template"]["spec"]["containers"]
    return container


def test_core_objects_validate_against_the_kubernetes_schema(docs: list[dict[str, Any]]) -> None:
    kinds = {d["kind"] for d in docs}
    assert {"Namespace", "StatefulSet", "Deployment", "Service", "Secret", "ConfigMap", "NetworkPolicy",
            "PodDisruptionBudget", "ScaledObject"} <= kinds
    for doc in docs:
        if doc["apiVersion"].startswith("keda.sh/"):
            continue  # a CRD: checked field by field below
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)
    namespaces = {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"}
    assert namespaces == {_one(docs, "Namespace", "")["metadata"]["name"]}


def test_the_validator_refuses_a_broken_object(docs: list[dict[str, Any]]) -> None:
    """The schema check has teeth: a misspelt field and a wrong type are both refused."""
    gateway = copy.deepcopy(_one(docs, "Deployment", "gateway"))
    _container(gateway)["comand"] = ["lorafleet"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(gateway, K8S_VERSIONS[-1], strict=True)
    nats = copy.deepcopy(_one(docs, "StatefulSet", "nats"))
    nats["spec"]["replicas"] = "three"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(nats, K8S_VERSIONS[-1], strict=True)


def test_nats_is_a_three_node_jetstream_cluster_with_auth(docs: list[dict[str, Any]], tmp_path: Path) -> None:
    sts = _one(docs, "StatefulSet", "nats")
    headless = _one(docs, "Service", "nats-headless")
    assert sts["spec"]["replicas"] == NATS_PODS and sts["spec"]["serviceName"] == "nats-headless"
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    # R3 streams on three nodes: the fleet's replicas fit the cluster and survive one node.
    assert _fleet(docs).nats.stream_replicas() == NATS_PODS
    # Every route names one pod through the headless Service.
    routes = yaml.safe_load(_secret_text(docs, "nats-auth", "nats-routes.conf"))["ROUTES"]
    assert sorted(r.rsplit("@", 1)[1] for r in routes) == [f"nats-{i}.nats-headless:6222" for i in range(NATS_PODS)]
    # The real nats-server accepts the config with the rendered includes, as pod nats-0 sees them.
    conf = tmp_path / "nats.conf"
    conf.write_text(_one(docs, "ConfigMap", "nats-config")["data"]["nats.conf"])
    (tmp_path / "secrets").mkdir()
    for key in ("nats-auth.conf", "nats-routes.conf"):
        (tmp_path / "secrets" / key).write_text(_secret_text(docs, "nats-auth", key))
    result = nats_config_ok(conf, "nats-0")
    assert result.returncode == 0, result.stderr
    # Authentication is on: a user per role credential, each by public key.
    assert _secret_text(docs, "nats-auth", "nats-auth.conf").count("nkey:") == 4


def test_gateway_and_workers_connect_to_every_node_with_their_own_credential(docs: list[dict[str, Any]]) -> None:
    urls = ",".join(f"nats://nats-{i}.nats-headless:4222" for i in range(NATS_PODS))
    for name, cred in (("gateway", "gateway.nk"), ("worker-", "worker.nk")):
        for dep in [d for d in by_kind(docs, "Deployment") if d["metadata"]["name"].startswith(name)]:
            _verb, *args = _container(dep)["args"]
            opts = options(args)
            assert opts["--nats-url"] == urls
            creds = Path(opts["--creds"])
            assert creds.name == cred
            mounts = {m["mountPath"]: m["name"] for m in _container(dep)["volumeMounts"]}
            volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
            secret = volumes[mounts[str(creds.parent)]]["secret"]
            assert secret["secretName"].startswith(f"{cred.removesuffix('.nk')}-creds-")
            assert _one(docs, "Secret", f"{cred.removesuffix('.nk')}-creds-")["data"].keys() == {cred}
            assert mounts[opts["--fleet"]] == "fleet"


def test_commands_use_only_flags_lorafleet_accepts(docs: list[dict[str, Any]]) -> None:
    commands = [_container(d)["args"] for d in by_kind(docs, "Deployment")]
    assert {c[0] for c in commands} == {"gateway", "worker", "layout"}
    modules = {**MODULE_OF, "layout": "lorafleet.ops.layout"}
    check_flags(commands, {verb: accepted_flags(mod) for verb, mod in modules.items()})


def test_only_the_layout_keeper_mounts_the_admin_credential(docs: list[dict[str, Any]]) -> None:
    """It creates and heals the streams (no other role may create one: issue 38); no other pod gets admin.nk."""
    layout = _one(docs, "Deployment", "layout")
    opts = options(_container(layout)["args"][1:])
    assert Path(opts["--creds"]).name == "admin.nk"
    assert _one(docs, "Secret", "admin-creds-")["data"].keys() == {"admin.nk"}
    for dep in by_kind(docs, "Deployment"):
        secrets = {v["secret"]["secretName"] for v in dep["spec"]["template"]["spec"]["volumes"] if "secret" in v}
        holds_admin = any(name.startswith("admin-creds-") for name in secrets)
        assert holds_admin == (dep["metadata"]["name"] == "layout"), dep["metadata"]["name"]


def test_keda_scales_each_worker_on_its_base_consumer(docs: list[dict[str, Any]]) -> None:
    """The trigger names the stream and the durable consumer lorafleet really uses (QueueConfig, consumer_name)."""
    fleet = _fleet(docs)
    workers = [d for d in by_kind(docs, "Deployment") if d["metadata"]["name"].startswith("worker-")]
    scaled = {s["spec"]["scaleTargetRef"]["name"]: s for s in by_kind(docs, "ScaledObject")}
    assert workers and {w["metadata"]["name"] for w in workers} == set(scaled)
    namespace = workers[0]["metadata"]["namespace"]
    monitor_port = next(p["containerPort"] for p in _container(_one(docs, "StatefulSet", "nats"))["ports"]
                        if p["name"] == "monitor")
    for worker in workers:
        bases = [v for k, v in (a.partition("=")[::2] for a in _container(worker)["args"][1:]) if k == "--base"]
        assert len(bases) == 1, "one worker Deployment per base"
        base = bases[0]
        fleet.base(base)  # a base the fleet serves (KeyError otherwise)
        so = scaled[worker["metadata"]["name"]]
        assert so["apiVersion"] == "keda.sh/v1alpha1" and so["kind"] == "ScaledObject"
        assert so["metadata"]["namespace"] == namespace
        spec = so["spec"]
        assert 0 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
        (trigger,) = spec["triggers"]
        assert trigger["type"] == "nats-jetstream"
        meta = trigger["metadata"]
        assert meta["stream"] == fleet.queue.stream
        assert meta["consumer"] == consumer_name(base)
        assert meta["account"] == "$G"  # server-config users live in NATS's global account
        assert int(meta["lagThreshold"]) > 0 and int(meta.get("activationLagThreshold", "0")) >= 0
        assert all(isinstance(v, str) for v in meta.values()), "KEDA trigger metadata values are strings"
        # KEDA runs in its own namespace: the endpoint must be fully qualified, on the headless Service (it
        # reaches a consumer's leader as <server name>.<this host>, and server names are the pod names).
        assert meta["natsServerMonitoringEndpoint"] == f"nats-headless.{namespace}.svc.cluster.local:{monitor_port}"
    conf = _one(docs, "ConfigMap", "nats-config")["data"]["nats.conf"]
    assert f'http: "0.0.0.0:{monitor_port}"' in conf and "server_name: $SERVER_NAME" in conf
    env = _container(_one(docs, "StatefulSet", "nats"))["env"]
    assert {"name": "SERVER_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in env


def test_monitoring_is_reachable_only_by_keda(docs: list[dict[str, Any]]) -> None:
    policy = _one(docs, "NetworkPolicy", "nats")
    by_port = {r["ports"][0]["port"]: r["from"] for r in policy["spec"]["ingress"]}
    assert by_port[8222] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "keda"}}}]
    assert set(by_port) == {4222, 6222, 8222}


def test_metrics_are_annotated_for_prometheus(docs: list[dict[str, Any]]) -> None:
    for dep in by_kind(docs, "Deployment"):
        if dep["metadata"]["name"] == "layout":
            continue  # the layout keeper serves nothing, metrics included
        notes = dep["spec"]["template"]["metadata"]["annotations"]
        ports = {p["containerPort"] for p in _container(dep)["ports"]}
        assert notes["prometheus.io/scrape"] == "true" and int(notes["prometheus.io/port"]) in ports


def test_fleet_file_loads_with_lorafleet(k8s_dir: Path) -> None:
    fleet = load_yaml_model(FleetConfig, k8s_dir / "fleet.yaml")
    assert fleet.nats.replicas == NATS_PODS and fleet.queue.storage == "file"
