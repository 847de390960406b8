"""lorafleet.registry: bundles in MLflow (register, alias, verified download) and live promotion.

Public API (imported lazily so `import lorafleet.registry` stays cheap):
    register_bundle(name, adapter_dir, base_source=…, …) -> BundleRef(name, version)
    set_alias(name, alias, version), alias_version(name, alias), get_version(name, ref), versions(name)
    download_bundle(name, version|alias, dest) -> Path     (every sha256 checked)
    promote(name, version=None, force=False, …) / rollback(name, …) -> Outcome
    ship_research_result(research_result, …) -> Shipped   (tune + register as 'candidate')
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "BundleError": "lorafleet.registry.bundle",
    "BundleIntegrityError": "lorafleet.registry.bundle",
    "BundleSpec": "lorafleet.registry.bundle",
    "build_bundle": "lorafleet.registry.bundle",
    "verify_bundle": "lorafleet.registry.bundle",
    "BundleRef": "lorafleet.registry.store",
    "RegistryError": "lorafleet.registry.store",
    "StoreUnreachable": "lorafleet.registry.store",
    "VersionInfo": "lorafleet.registry.store",
    "register_bundle": "lorafleet.registry.store",
    "set_alias": "lorafleet.registry.store",
    "alias_version": "lorafleet.registry.store",
    "get_version": "lorafleet.registry.store",
    "versions": "lorafleet.registry.store",
    "list_models": "lorafleet.registry.store",
    "download_bundle": "lorafleet.registry.store",
    "fetch_adapter": "lorafleet.registry.store",
    "CANDIDATE": "lorafleet.registry.store",
    "CHAMPION": "lorafleet.registry.store",
    "FleetEntry": "lorafleet.registry.fleet_state",
    "FleetWatcher": "lorafleet.registry.fleet_state",
    "FleetStateError": "lorafleet.registry.fleet_state",
    "ensure_fleet_bucket": "lorafleet.registry.fleet_state",
    "served_models": "lorafleet.registry.fleet_state",
    "PromotionError": "lorafleet.registry.promote",
    "promote": "lorafleet.registry.promote",
    "rollback": "lorafleet.registry.promote",
    "check_gate": "lorafleet.registry.promote",
    "ship_research_result": "lorafleet.registry.ship",
    "install_sidecar_scheme": "lorafleet.registry.uri",
    "resolve_models_uri": "lorafleet.registry.uri",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(name)
    import importlib

    return getattr(importlib.import_module(module), name)
