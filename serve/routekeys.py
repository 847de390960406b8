"""Which route key split a canary's traffic (issue 38): a response header, and a tally `lorafleet status` reads.

A canary sends P % of its name's route keys to the candidate (serve/resolver.py). The key is the client's
X-Lorafleet-Route-Key header, else its API key's id, else its address; behind a proxy that uvicorn does not trust
(`--forwarded-allow-ips`), every client has the proxy's address, one key, and the split takes 0 % or 100 %. So
a response to a request that a split decided names the key's source in `X-Lorafleet-Route-Key-Source` (header,
api-key or address; never the key), and the gateway counts those requests per key (a digest) for its stats
message (`heartbeats.RouteKeys`, published with its per-version counters), where `status` finds a key that
carries most of a canary's traffic.
"""

from __future__ import annotations

import hashlib
import threading

from lorafleet.core.heartbeats import RouteKeys
from lorafleet.serve.resolver import Resolver

ROUTE_KEY_SOURCE_HEADER = "X-Lorafleet-Route-Key-Source"
SOURCES = {"h": "header", "k": "api-key", "a": "address"}  # serve/resolver.route_key's prefixes
KEPT_KEYS = 1024  # distinct keys counted per canary: a busy key shows up among the first ones it sends
TOP = 3  # keys published per canary


def key_source(key: str) -> str:
    """header | api-key | address: where a route key (serve/resolver.route_key) came from."""
    return SOURCES.get(key[:1], "address")


def key_digest(key: str) -> str:
    """What leaves the gateway of a key: a digest (a header's key is the client's own string)."""
    return hashlib.sha256(key.encode()).hexdigest()[:12]


class RouteKeyTally:
    """Requests that a canary split decided, per (name, canary version) and route key; safe from any thread (the
    gateway's event loop counts, its presence beacon reads)."""

    def __init__(self, kept: int = KEPT_KEYS) -> None:
        self.kept = kept
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], dict[str, list[int | str]]] = {}  # → digest → [count, source]
        self._requests: dict[tuple[str, str], int] = {}

    def add(self, name: str, version: str, key: str) -> None:
        digest, source = key_digest(key), key_source(key)
        with self._lock:
            group = (name, version)
            self._requests[group] = self._requests.get(group, 0) + 1
            counts = self._counts.setdefault(group, {})
            row = counts.get(digest)
            if row is not None:
                row[0] = int(row[0]) + 1
            elif len(counts) < self.kept:  # past the bound a new key counts in the total only
                counts[digest] = [1, source]

    def snapshot(self) -> dict[tuple[str, str], RouteKeys]:
        with self._lock:
            out: dict[tuple[str, str], RouteKeys] = {}
            for group, counts in self._counts.items():
                top = sorted(((d, str(r[1]), int(r[0])) for d, r in counts.items()), key=lambda t: -t[2])[:TOP]
                out[group] = RouteKeys(self._requests[group], len(counts), tuple(top))
            return out


def routed_by(resolver: Resolver, tally: RouteKeyTally, name: str, key: str | None) -> dict[str, str]:
    """The response header naming the key's source when a canary split decided `name`'s route by `key` (counted in
    `tally`); {} when no split did (no canary on `name`, a pinned NAME@N, no key)."""
    split = resolver.split_of(name) if key is not None else None
    if split is None or key is None or split.route.version is None:
        return {}
    tally.add(name, split.route.version, key)
    return {ROUTE_KEY_SOURCE_HEADER: key_source(key)}


def busiest_share(tallies: list[RouteKeys]) -> tuple[float, str, int] | None:
    """Over every gateway's tally of one canary: the busiest key's share of the requests, its source and the
    requests in all; None without requests. A key's counts add up across gateways (its digest is the same)."""
    requests = sum(t.requests for t in tallies)
    if requests <= 0:
        return None
    merged: dict[str, list[int | str]] = {}
    for t in tallies:
        for digest, source, count in t.top:
            row = merged.setdefault(digest, [0, source])
            row[0] = int(row[0]) + count
    if not merged:
        return None
    count, source = max(((int(r[0]), str(r[1])) for r in merged.values()), key=lambda r: r[0])
    return count / requests, source, requests
