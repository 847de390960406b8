"""Served name → (base model, adapter id, adapter uri).

Base models serve themselves under their own name; each ServedModel adds a name that runs its
base with a LoRA adapter. A promoted name (fleet state) is also served pinned, NAME@N for its champion
and each retained former champion (issue 25); its routes carry the version, which responses name.
A name under a canary (`promote --canary P`) sends P % of its plain-name requests, by a sticky hash of each
client's route key (lorafleet.core.fleet_state.route_bucket), to the canary version, also served pinned as NAME@N.
`set_models` swaps the adapter routes atomically at runtime (the
registry feeds it from the fleet KV bucket), so a lookup never sees a half-updated table.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from lorafleet.core.config import ConfigError, FleetConfig, ServedModel, check_served_models
from lorafleet.core.fleet_state import FleetEntry, route_bucket
from lorafleet.core.refs import PinnedNameError, parse_pinned, pinned_name
from lorafleet.serve.errors import ApiError, clip


@dataclass(frozen=True, slots=True)
class Specialist:
    """What a generative bundle brings besides its adapter (from its fleet-state entry)."""

    system_prompt: str | None = None
    chat_template: str | None = None
    defaults: Mapping[str, Any] | None = None  # max_tokens, temperature, top_p when a request leaves them out


@dataclass(frozen=True, slots=True)
class Route:
    name: str  # the served name (NAME for both NAME and NAME@N: bounded metric labels)
    base: str
    adapter: str | None = None  # adapter id (workers' cache key); None for the bare base
    adapter_uri: str | None = None
    specialist: Specialist | None = None
    version: str | None = None  # the registry version behind a promoted name; None: a base or a fleet-file model

    @property
    def model(self) -> str:
        """What a response names: the exact version that computed it (NAME@N), or the plain name without one."""
        return pinned_name(self.name, self.version) if self.version is not None else self.name


@dataclass(frozen=True, slots=True)
class Pinned:
    """The pinned versions of one promoted name: the champion and the retained former champions."""

    current: str
    routes: Mapping[str, Route]  # version → route (the champion's included)
    until: Mapping[str, float | None]  # version → end of its retention window (None: none, or the champion)
    retired: frozenset[str] = frozenset()
    canary: str | None = None  # the version under a canary (live while the canary lasts)

    def live(self, now: float) -> list[str]:
        return [v for v in sorted(self.routes, key=int, reverse=True)
                if (t := self.until.get(v)) is None or t > now]


def pinned_routes(entry: FleetEntry, base_route: Route, bases: Iterable[str]) -> Pinned:
    """Routes by version for `entry`: its champion (= the plain name's route) and each retained version (on a base
    this fleet serves)."""
    routes = {entry.version: base_route}
    until: dict[str, float | None] = {entry.version: None}
    for kept in entry.retained:
        if kept.base not in bases:
            continue
        old = entry.retained_as_entry(kept)
        routes[kept.version] = Route(name=entry.name, base=kept.base, adapter=kept.adapter_id,
                                     adapter_uri=kept.adapter_uri, specialist=_specialist(old), version=kept.version)
        until[kept.version] = kept.until
    canary = entry.canary_as_entry()
    if canary is not None and canary.base in bases:
        routes[canary.version] = Route(name=entry.name, base=canary.base, adapter=canary.adapter_id,
                                       adapter_uri=canary.adapter_uri, specialist=_specialist(canary),
                                       version=canary.version)
        until[canary.version] = None
    return Pinned(entry.version, routes, until, frozenset(entry.retired) - set(routes),
                  canary.version if canary is not None and canary.version in routes else None)


@dataclass(frozen=True, slots=True)
class Split:
    """A canary's share of one name: `percent` of the route keys (by route_bucket) go to `route`."""

    percent: float
    route: Route


ROUTE_KEY_HEADER = "x-lorafleet-route-key"


def route_key(header: str | None, authorization: str | None, address: str | None) -> str:
    """Who a request comes from, for a canary's sticky split: the route-key header as given, else the API key's id,
    else the client address (both as digests: neither ends up in logs or labels). Prefixed by kind so a header
    value never collides with a key's id."""
    if header:
        return f"h:{header}"
    _, _, token = (authorization or "").partition(" ")
    if token.strip():
        return "k:" + hashlib.sha256(token.strip().encode()).hexdigest()[:16]
    return "a:" + hashlib.sha256((address or "").encode()).hexdigest()[:16]


def _specialist(entry: FleetEntry) -> Specialist | None:
    if entry.system_prompt or entry.chat_template or entry.generation:
        return Specialist(entry.system_prompt, entry.chat_template, entry.generation)
    return None


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


class Resolver:
    def __init__(self, bases: Iterable[str], models: Iterable[ServedModel] = ()) -> None:
        self._bases = tuple(dict.fromkeys(bases))
        if not self._bases:
            raise ConfigError("a fleet needs at least one base model")
        self._table: tuple[dict[str, Route], dict[str, Pinned], dict[str, Split]] = ({}, {}, {})
        self.set_models(models)

    @classmethod
    def from_fleet(cls, fleet: FleetConfig) -> Resolver:
        return cls([b.name for b in fleet.bases], fleet.models)

    @property
    def bases(self) -> tuple[str, ...]:
        return self._bases

    def set_models(self, models: Iterable[ServedModel], specialists: Mapping[str, Specialist] | None = None,
                   entries: Iterable[FleetEntry] = ()) -> None:
        """Replace every adapter route; base names always stay. `entries`: the fleet state's, whose versions are
        also served pinned (NAME@N) and named in responses. Raises ConfigError, changing nothing."""
        models = list(models)
        check_served_models(self._bases, models)
        versions = {e.name: e for e in entries}
        routes = {b: Route(name=b, base=b) for b in self._bases}
        pins: dict[str, Pinned] = {}
        splits: dict[str, Split] = {}
        for m in models:
            entry = versions.get(m.name)
            # Only when the route is the entry's (a fleet-file model of that name is not a version of it).
            if entry is not None and entry.adapter_id != m.resolved_adapter_id:
                entry = None
            routes[m.name] = Route(name=m.name, base=m.base, adapter=m.resolved_adapter_id, adapter_uri=m.adapter,
                                   specialist=(specialists or {}).get(m.name),
                                   version=entry.version if entry is not None else None)
            if entry is not None:
                pins[m.name] = pinned = pinned_routes(entry, routes[m.name], self._bases)
                if pinned.canary is not None and entry.canary is not None:
                    splits[m.name] = Split(entry.canary.percent, pinned.routes[pinned.canary])
        self._table = (routes, pins, splits)  # one assignment: readers see the old table or the new one

    @property
    def _routes(self) -> dict[str, Route]:
        return self._table[0]

    def resolve(self, name: str, key: str | None = None) -> Route | None:
        """The route of a served name; under a canary, the canary's for the route keys in its share (a request
        without a key stays on the champion)."""
        route = self._routes.get(name)
        split = self._table[2].get(name) if key is not None else None
        if split is not None and key is not None and route_bucket(name, key) < split.percent:
            return split.route
        return route

    @property
    def has_splits(self) -> bool:
        return bool(self._table[2])

    def splits(self) -> dict[str, Split]:
        return dict(self._table[2])

    def split_of(self, name: str) -> Split | None:
        """The canary split of a served name (None: none; a pinned NAME@N is never split)."""
        return self._table[2].get(name)

    def pinned(self) -> dict[str, Pinned]:
        return dict(self._table[1])

    def resolve_pinned(self, name: str, now: float | None = None) -> Route | None:
        """The route of a pinned name NAME@N; None when `name` has no @. ApiError: 400 for a malformed one, 410
        `version_retired` past its retention window, 404 naming the live versions for one never served."""
        try:
            parsed = parse_pinned(name)
        except PinnedNameError as exc:
            raise ApiError(400, "invalid_model_name", clip(str(exc), 300)) from None
        if parsed is None:
            return None
        alias, version = parsed
        now = time.time() if now is None else now
        pins = self._table[1].get(alias)
        if pins is None:
            raise ApiError(404, "model_not_found", f"model {clip(name)!r} is not served here: {clip(alias)!r} has no "
                           "promoted versions (GET /v1/models lists the served names)")
        live = [pinned_name(alias, v) for v in pins.live(now)]
        current = pinned_name(alias, pins.current)
        until = pins.until.get(version)
        if version in pins.routes and (until is None or until > now):
            return pins.routes[version]
        if version in pins.retired or version in pins.routes:
            when = f" at {_when(until)}" if until is not None else ""
            raise ApiError(410, "version_retired",
                           f"{pinned_name(alias, version)} was retired{when}; the current version is {current}: "
                           f"re-embed your corpus with {current} (live versions: {', '.join(live)})")
        raise ApiError(404, "model_not_found", f"{pinned_name(alias, version)} is not served here; the live versions "
                       f"of {alias} are: {', '.join(live)}")

    def served_names(self) -> list[str]:
        return sorted(self._routes)

    def routes(self) -> list[Route]:
        return [self._routes[n] for n in self.served_names()]
