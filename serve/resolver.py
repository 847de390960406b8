"""Served name → (base model, adapter id, adapter uri).

Base models serve themselves under their own name; each ServedModel adds a name that runs its
base with a LoRA adapter. `set_models` swaps the adapter routes atomically at runtime (the
registry feeds it from the fleet KV bucket), so a lookup never sees a half-updated table.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from lorafleet.config import ConfigError, FleetConfig, ServedModel, check_served_models


@dataclass(frozen=True, slots=True)
class Specialist:
    """What a generative bundle brings besides its adapter (from its fleet-state entry)."""

    system_prompt: str | None = None
    chat_template: str | None = None
    defaults: Mapping[str, Any] | None = None  # max_tokens, temperature, top_p when a request leaves them out


@dataclass(frozen=True, slots=True)
class Route:
    name: str  # the served name the client asked for
    base: str
    adapter: str | None = None  # adapter id (workers' cache key); None for the bare base
    adapter_uri: str | None = None
    specialist: Specialist | None = None


class Resolver:
    def __init__(self, bases: Iterable[str], models: Iterable[ServedModel] = ()) -> None:
        self._bases = tuple(dict.fromkeys(bases))
        if not self._bases:
            raise ConfigError("a fleet needs at least one base model")
        self._routes: dict[str, Route] = {}
        self.set_models(models)

    @classmethod
    def from_fleet(cls, fleet: FleetConfig) -> Resolver:
        return cls([b.name for b in fleet.bases], fleet.models)

    @property
    def bases(self) -> tuple[str, ...]:
        return self._bases

    def set_models(self, models: Iterable[ServedModel], specialists: Mapping[str, Specialist] | None = None) -> None:
        """Replace every adapter route; base names always stay. Raises ConfigError, changing nothing."""
        models = list(models)
        check_served_models(self._bases, models)
        routes = {b: Route(name=b, base=b) for b in self._bases}
        for m in models:
            routes[m.name] = Route(name=m.name, base=m.base, adapter=m.resolved_adapter_id, adapter_uri=m.adapter,
                                   specialist=(specialists or {}).get(m.name))
        self._routes = routes  # one assignment: readers see the old table or the new one

    def resolve(self, name: str) -> Route | None:
        return self._routes.get(name)

    def served_names(self) -> list[str]:
        return sorted(self._routes)

    def routes(self) -> list[Route]:
        return [self._routes[n] for n in self.served_names()]
