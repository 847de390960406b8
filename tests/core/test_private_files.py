"""Secret-bearing files (the nats-server config with the route password, TLS keys) are created 0600 from the
start: never written with the default umask and chmod'ed afterwards (issue 23, item 11)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from lorafleet.nats.server import ClusterRoutes, NatsServer
from lorafleet.nats.tls import issue_certificate, make_self_signed_ca


@pytest.fixture
def permissive_umask(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """umask 000 (what a careless shell or container gives), and no chmod after the fact: whatever mode a
    file has is the mode it was created with."""
    old = os.umask(0)
    monkeypatch.setattr(os, "chmod", lambda *a, **k: None)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_server_config_with_the_route_password_is_created_0600(tmp_path: Path, permissive_umask: None) -> None:
    routes = ClusterRoutes("c", "n1", "127.0.0.1", 6222, ("127.0.0.1:6223",), "route", "s3cret")
    server = NatsServer(tmp_path / "n1", port=4222, routes=routes)
    server.store_dir.mkdir(parents=True)
    server._write_config()
    assert "s3cret" in server.config_file.read_text()
    assert _mode(server.config_file) == 0o600


def test_a_rewritten_key_file_is_never_readable_by_others(tmp_path: Path, permissive_umask: None) -> None:
    ca = make_self_signed_ca(tmp_path / "ca")
    assert _mode(ca.key) == 0o600
    stale = tmp_path / "tls" / "server-key.pem"  # left behind world-readable (its certificate was deleted)
    stale.parent.mkdir()
    stale.write_bytes(b"old")
    stale_mode = _mode(stale)
    assert stale_mode == 0o666
    files = issue_certificate(ca, tmp_path / "tls", "server")
    assert files.key == stale and _mode(stale) == 0o600
    assert b"PRIVATE KEY" in stale.read_bytes()


def test_write_private_creates_the_file_0600_before_any_byte_is_written(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from lorafleet.nats import conf as nats_conf

    seen: list[int] = []
    real_write = os.write

    def spy(fd: int, data: bytes) -> int:
        seen.append(stat.S_IMODE(os.fstat(fd).st_mode))
        return real_write(fd, data)

    old = os.umask(0)
    monkeypatch.setattr(os, "write", spy)
    try:
        path = tmp_path / "secret.conf"
        path.write_bytes(b"x")  # an existing 0666 file is replaced, not truncated in place
        nats_conf.write_private(path, b"password: hunter2\n")
    finally:
        os.umask(old)
    assert seen and set(seen) == {0o600}
    assert _mode(path) == 0o600 and path.read_bytes() == b"password: hunter2\n"
    assert not list(tmp_path.glob("*.tmp*"))


@pytest.mark.parametrize(("raw", "quoted"), [("a", '"a"'), ('x"y', '"x\\"y"'), ("c:\\d", '"c:\\\\d"'),
                                              ("$JS.API.>", '"$JS.API.>"')])
def test_one_quoting_helper_for_every_config_string(raw: str, quoted: str) -> None:
    from lorafleet.nats import auth as nats_auth
    from lorafleet.nats import conf as nats_conf
    from lorafleet.nats import server as nats_server

    assert nats_conf.conf_quote(raw) == quoted
    assert nats_auth._q is nats_conf.conf_quote and nats_server._q is nats_conf.conf_quote
