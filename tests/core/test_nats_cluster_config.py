"""Pure logic of the replicated queue plane: NATS URL lists, cluster node configs, replicas, part names."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from lorafleet.core.config import FleetConfig, QueueConfig
from lorafleet.nats.client import NatsUrlError, join_urls, server_urls
from lorafleet.nats.cluster import NatsCluster, plan_replicas, route_secret
from lorafleet.nats.queue import dlq_stream_config, fleet_work_stream_config, work_stream_config
from lorafleet.nats.server import NatsServerError
from lorafleet.ops.processes import part_name, stop_order


@pytest.mark.parametrize(("value", "want"), [
    ("nats://127.0.0.1:4222", ["nats://127.0.0.1:4222"]),
    ("nats://a:1, nats://b:2 ,nats://c:3", ["nats://a:1", "nats://b:2", "nats://c:3"]),
    ("a:1,b", ["nats://a:1", "nats://b:4222"]),
    ("tls://h1:4222,tls://h2:4222", ["tls://h1:4222", "tls://h2:4222"]),
    ("nats://a:1,nats://a:1,", ["nats://a:1"]),
    (["nats://a:1", "b:2"], ["nats://a:1", "nats://b:2"]),
    ("nats://[::1]:4222", ["nats://[::1]:4222"]),
])
def test_server_urls(value: str | list[str], want: list[str]) -> None:
    assert server_urls(value) == want
    assert server_urls(join_urls(want)) == want


@pytest.mark.parametrize(("value", "says"), [
    ("", "no NATS URL"),
    (" , ", "no NATS URL"),
    ("http://a:1", "nats:// or tls://"),
    ("nats://a:1,tls://b:2", "mixes"),
    ("nats://a:1/path", "scheme://host:port"),
])
def test_server_urls_refuses(value: str, says: str) -> None:
    with pytest.raises(NatsUrlError, match=says):
        server_urls(value)


def test_cluster_configs(tmp_path: Path) -> None:
    """Each node: its own name, client port, store and route port; authenticated routes to the two others."""
    c = NatsCluster(tmp_path / "nats", 3, ports=[4301, 4302, 4303], log_dir=tmp_path / "logs")
    assert list(c.servers) == ["nats-server-1", "nats-server-2", "nats-server-3"]
    assert c.url == "nats://127.0.0.1:4301,nats://127.0.0.1:4302,nats://127.0.0.1:4303"
    secret = route_secret(tmp_path / "nats")
    assert stat.S_IMODE((tmp_path / "nats" / "route.secret").stat().st_mode) == 0o600
    route_ports = {s.routes.port for s in c.servers.values() if s.routes}
    assert len(route_ports) == 3
    for i, server in enumerate(c.servers.values(), 1):
        server.store_dir.mkdir(parents=True)
        server._write_config()  # what start() writes
        text = server.config_file.read_text()
        assert server.config_file == tmp_path / "nats" / f"n{i}" / "nats-server.conf"
        assert server.log_file == tmp_path / "logs" / f"nats-server-{i}.log"
        assert f'server_name: "n{i}"' in text
        assert f'listen: "127.0.0.1:{4300 + i}"' in text
        assert f'store_dir: "{(tmp_path / "nats" / f"n{i}").resolve()}"' in text
        assert 'name: "lorafleet"' in text
        assert f'password: "{secret}"' in text
        assert server.routes is not None
        assert f'listen: "127.0.0.1:{server.routes.port}"' in text
        peers = sorted(route_ports - {server.routes.port})
        for port in peers:
            assert f'"nats-route://route:{secret}@127.0.0.1:{port}"' in text
        assert f"@127.0.0.1:{server.routes.port}" not in text  # no route to itself
        assert "authorization {\n" not in text  # no client credentials given: the open test server
        assert stat.S_IMODE(server.config_file.stat().st_mode) == 0o600
    again = NatsCluster(tmp_path / "nats", 3)
    assert all(s.routes and s.routes.password == secret for s in again.servers.values())  # a restart rejoins


def test_cluster_configs_carry_auth_and_tls(tmp_path: Path) -> None:
    from lorafleet.nats.auth import TlsFiles

    tls = TlsFiles(ca=tmp_path / "ca.pem", cert=tmp_path / "s.pem", key=tmp_path / "s.key")
    c = NatsCluster(tmp_path / "nats", 3, creds=tmp_path / "creds", tls=tls)
    texts = []
    for server in c.servers.values():
        server.store_dir.mkdir(parents=True)
        server._write_config()
        texts.append(server.config_file.read_text())
    for text in texts:
        assert "nkey:" in text and text.count("tls {") == 1  # clients; routes stay on loopback
    users = [t[t.index("authorization {\n"):] for t in texts]
    assert users[0] == users[1] == users[2]  # every node admits the same credentials


def test_replicas() -> None:
    assert plan_replicas(None, 1) is None
    assert plan_replicas(None, 3) == 3 and plan_replicas(None, 5) == 3 and plan_replicas(1, 3) == 1
    with pytest.raises(NatsServerError, match="--nats-nodes 3"):
        plan_replicas(3, 1)
    with pytest.raises(NatsServerError, match="use 3"):
        plan_replicas(None, 2)
    assert work_stream_config(QueueConfig(), ["b"]).num_replicas == 1
    assert dlq_stream_config(QueueConfig(), 3).num_replicas == 3
    fleet = FleetConfig.model_validate({"nats": {"replicas": 3}})
    assert fleet_work_stream_config(fleet).num_replicas == 3
    assert FleetConfig().nats.stream_replicas() == 1


def test_cluster_parts_are_recognised(tmp_path: Path) -> None:
    home = tmp_path
    for i in (1, 2, 3):
        argv = ["/venv/bin/nats-server", "-c", str(home / "nats" / f"n{i}" / "nats-server.conf")]
        assert part_name(argv, home) == f"nats-server-{i}"
    assert part_name(["/venv/bin/nats-server", "-c", str(home / "nats" / "x1" / "nats-server.conf")], home) is None
    assert part_name(["/venv/bin/nats-server", "-c", str(tmp_path / "other" / "nats" / "n1" / "nats-server.conf")],
                     home) is None
    assert stop_order(["nats-server-2", "gateway", "nats-server-1", "worker-1", "supervisor"]) == [
        "supervisor", "worker-1", "gateway", "nats-server-1", "nats-server-2"]
