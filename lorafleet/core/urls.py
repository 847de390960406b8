"""The NATS URL grammar: one URL or a comma-separated list of a cluster's servers.

Pure string rules, in the core so that every room that connects (the fleet state, the NATS client, the CLI)
reads a `--nats-url` alike.
"""

from __future__ import annotations

_SCHEMES = ("nats", "tls")


class NatsUrlError(ValueError):
    """A --nats-url (or fleet nats_url) that cannot be used; the message says what to fix."""


def server_urls(value: str | list[str] | tuple[str, ...]) -> list[str]:
    """The servers of `--nats-url` / `nats_url`: one URL or a comma-separated list (a cluster's nodes), each
    `nats://host:port` or `tls://host:port`; a host alone gets nats:// and port 4222. What `nats.connect`
    takes as `servers`."""
    items = value if isinstance(value, list | tuple) else str(value).split(",")
    out: list[str] = []
    for raw in items:
        url = raw.strip()
        if not url:
            continue
        if "://" not in url:
            url = f"nats://{url}"
        scheme, rest = url.split("://", 1)
        if scheme not in _SCHEMES:
            raise NatsUrlError(f"NATS URL {raw.strip()!r}: the scheme must be nats:// or tls://")
        hostport = rest.rsplit("@", 1)[-1].rstrip("/")
        if not hostport or "/" in hostport:
            raise NatsUrlError(f"NATS URL {raw.strip()!r}: expected scheme://host:port")
        if not hostport.rsplit(":", 1)[-1].isdigit():
            url = f"{url.rstrip('/')}:4222"
        if url not in out:
            out.append(url)
    if not out:
        raise NatsUrlError(f"no NATS URL in {value!r}: give nats://host:port, or several separated by commas")
    if len({u.split("://", 1)[0] for u in out}) > 1:
        raise NatsUrlError(f"{value!r} mixes nats:// and tls:// servers: use one scheme for the whole cluster")
    return out


def join_urls(urls: list[str]) -> str:
    """The comma-separated form of several server URLs (what `--nats-url` and `nats_url` accept)."""
    return ",".join(urls)
