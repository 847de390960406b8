"""lorafleet.registry: bundles in MLflow (register, alias, verified download) and live promotion.

A bundle is one MLflow model version: the peft adapter, bundle.yaml (base reference, task kind,
bundle kind, serving profile, metrics, sha256 of every file), the evaluation report and the
dataset digest. Promotion runs the task kind's quality gate, moves the alias `champion` and
publishes the desired fleet state (lorafleet.core.fleet_state), which gateways and workers apply live.

Public API (loaded on first use, so `import lorafleet.registry` stays cheap):
    register_bundle(name, adapter_dir, base_source=…, task=…, …) -> BundleRef(name, version)
    versions(name), get_version(name, ref), alias_version(name, alias), set_alias(name, alias, version)
    list_models(), download_bundle(name, ref, dest) -> Path, fetch_adapter(name, ref), bundle_spec(name, ref)
    promote.promote(name, version=None, force=False, …) -> Outcome, rollback(name, …) -> Outcome, check_gate(…)
    (`lorafleet.registry.promote` is the module; `lorafleet.pipeline.promote` the same verb one layer up)
    build_bundle(out_dir, …), verify_bundle(dir), read_spec(dir)       (the bundle folder, no MLflow)
    resolve_models_uri(uri) -> Path     (the `models:` adapter source, registered as a plugin)
"""

from __future__ import annotations

from typing import Any

_STORE = {"BundleRef", "RegistryError", "StoreUnreachable", "VersionInfo", "register_bundle", "set_alias",
          "alias_version", "get_version", "versions", "list_models", "download_bundle", "fetch_adapter",
          "bundle_spec", "CANDIDATE", "CHAMPION"}
_BUNDLE = {"BundleError", "BundleIntegrityError", "BundleSpec", "build_bundle", "verify_bundle", "read_spec"}
_PROMOTE = {"PromotionError", "rollback", "check_gate"}

__all__ = sorted(_STORE | _BUNDLE | _PROMOTE | {"resolve_models_uri"})


def __getattr__(name: str) -> Any:
    if name in _STORE:
        from lorafleet.registry import store as home
    elif name in _BUNDLE:
        from lorafleet.registry import bundle as home
    elif name in _PROMOTE:
        from lorafleet.registry import promote as home
    elif name == "resolve_models_uri":
        from lorafleet.registry import uri as home
    else:
        raise AttributeError(name)
    return getattr(home, name)
