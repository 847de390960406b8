"""What the fleet is handed for a version: its live entry, staged and preloaded on the workers of its base.

Preload (registry/preload.py): before the alias moves, the new version is staged and every live worker of
its base loads it; the fleet switches only once all have confirmed. A worker that does not confirm within
the timeout fails a promotion (nothing changed: the fleet would otherwise switch to a version some workers
could not load, and its first requests there would wait for the download); a rollback, which is urgent,
goes ahead and says which workers did not confirm.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

from lorafleet.core.config import ServingProfile
from lorafleet.core.fleet_state import FleetEntry, FleetStateError, adapter_id_for, delete_staged, put_staged
from lorafleet.core.refs import version_uri
from lorafleet.registry import store
from lorafleet.registry.bundle import BundleSpec
from lorafleet.registry.fleet_target import FleetTarget
from lorafleet.registry.gate import PromotionError
from lorafleet.registry.precision_notice import judged_profile
from lorafleet.registry.preload import DEFAULT_PRELOAD_TIMEOUT_S, PreloadResult, wait_preloaded
from lorafleet.registry.store import VersionInfo
from lorafleet.registry.writes import in_thread

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Preload:
    """Whether and how long a promotion waits for the workers of the base to load the new version first."""

    enabled: bool = True
    timeout_s: float = DEFAULT_PRELOAD_TIMEOUT_S
    progress: Callable[[str], None] | None = None  # progress lines (the CLI prints them); default: the log


def version_entry(info: VersionInfo, base: str, profile: ServingProfile | None,
                  action: Literal["promote", "rollback", "set"], spec: BundleSpec | None = None) -> FleetEntry:
    details = spec.details if spec is not None else {}
    generation = details.get("generation")
    return FleetEntry(name=info.name, base=base, adapter_id=adapter_id_for(info.name, info.version),
                      adapter_uri=version_uri(info.name, info.version), profile=judged_profile(profile, spec),
                      version=info.version, registered_model=info.name, action=action,
                      kind=spec.kind if spec is not None else None,
                      system_prompt=details.get("system_prompt") or None,
                      chat_template=details.get("chat_template") or None,
                      generation=generation if isinstance(generation, dict) else None)


async def preload(nc: object, kv: object, entry: FleetEntry, target: FleetTarget, how: Preload) -> PreloadResult:
    """Stage the entry, wait for the workers of its base; PromotionError (staged key removed) when a promotion's
    workers do not all confirm in time."""
    say = how.progress or log.info
    try:
        result = await wait_preloaded(nc, entry.base, entry.adapter_id, timeout_s=how.timeout_s,
                                      heartbeat_s=target.heartbeat_s, progress=say,
                                      started=lambda: put_staged(kv, entry))
    except Exception as exc:
        with contextlib.suppress(Exception):
            await delete_staged(kv, entry.name)
        raise FleetStateError(f"staging {entry.adapter_id} for preload failed, nothing changed: {exc}") from exc
    if not result.workers:
        say(f"no live worker of base {entry.base} heard: nothing to preload")
    elif result.complete:
        say(f"preloaded {entry.adapter_id} on {len(result.workers)} worker(s) in {result.seconds:.1f}s")
    else:
        why = (f"{len(result.missing)} of {len(result.workers)} worker(s) of base {entry.base} did not confirm "
               f"loading {entry.adapter_id} within {how.timeout_s:g}s: {', '.join(result.missing)}")
        if entry.action == "promote":
            with contextlib.suppress(Exception):
                await delete_staged(kv, entry.name)
            raise PromotionError(f"{why}; nothing changed. Their logs say why (download or load failure); "
                                 "raise --preload-timeout, or pass --no-preload to switch without waiting")
        say(f"{why}; switching anyway (a rollback does not wait): their first requests load it on demand")
    return result


async def served_entry(info: VersionInfo, bases: list[str], action: Literal["promote", "rollback"],
                       error: type[Exception], hint: str = "") -> FleetEntry:
    """The entry of `info` from its bundle.yaml; `error` (with `hint` added) when the fleet does not serve its base."""
    _, spec = await in_thread(store.bundle_spec, info.name, info.version)
    if spec.base.name not in bases:
        raise error(f"{info.name} v{info.version} runs on base {spec.base.name!r}, which this fleet does not serve "
                    f"(it serves: {', '.join(bases)}){hint}")
    return version_entry(info, spec.base.name, spec.profile, action, spec)


@contextlib.asynccontextmanager
async def staged(nc: Any, kv: Any, entry: FleetEntry, target: FleetTarget, how: Preload
                 ) -> AsyncIterator[PreloadResult | None]:
    """`entry` preloaded (when `how` enables it; else None) for the block, its staged key removed after it."""
    preloaded = await preload(nc, kv, entry, target, how) if how.enabled else None
    try:
        yield preloaded
    finally:
        if preloaded is not None:
            with contextlib.suppress(Exception):  # workers ignore a stale one: the adapter is loaded
                await delete_staged(kv, entry.name)


__all__ = ["Preload", "preload", "served_entry", "staged", "version_entry"]
