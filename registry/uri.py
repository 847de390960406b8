"""Adapter URIs that point into the registry: `models:/NAME/3`, `models:/NAME/v3`, `models:/NAME@champion`.

Workers call `resolve_models_uri` (via the sidecar's adapter-URI hook) to get a local adapter folder:
the bundle is downloaded once into LORAFLEET_HOME/bundles/NAME/vN, every sha256 checked, and reused
afterwards. Permanent problems (unknown version, tampered bundle) raise the sidecar's
AdapterUnavailable so the task is answered at once; an unreachable store stays a plain error,
which the worker retries.
"""

from __future__ import annotations

import re
from pathlib import Path

from lorafleet.registry.bundle import BundleError

MODELS_URI_RE = re.compile(r"^models:/(?P<name>[^/@]+)(?:/(?P<version>v?\d+)|@(?P<alias>[A-Za-z0-9_-]+))/?$")


def parse_models_uri(uri: str) -> tuple[str, str]:
    """(name, version-or-alias) of a models:/ URI; ValueError naming the accepted forms."""
    m = MODELS_URI_RE.match(uri)
    if not m:
        raise ValueError(f"{uri!r} is not a registry URI; use models:/NAME/VERSION or models:/NAME@ALIAS")
    ref = m.group("version") or m.group("alias")
    return m.group("name"), ref.lstrip("v") if m.group("version") else ref


def resolve_models_uri(uri: str) -> Path:
    """Local adapter folder of the bundle a models:/ URI names (downloaded and verified once)."""
    from lorafleet.registry.store import RegistryError, StoreUnreachable, fetch_adapter

    try:
        from lorafleet.sidecar.runtime import AdapterUnavailable
    except ImportError:  # pragma: no cover - the sidecar is part of the package
        AdapterUnavailable = RuntimeError  # type: ignore[misc,assignment]
    try:
        name, ref = parse_models_uri(uri)
        adapter_dir, _, _ = fetch_adapter(name, ref)
    except (ValueError, BundleError) as exc:
        raise AdapterUnavailable(str(exc)) from exc
    except StoreUnreachable:
        raise  # transient: the worker retries the task
    except RegistryError as exc:
        raise AdapterUnavailable(str(exc)) from exc
    return adapter_dir


def install_sidecar_scheme() -> None:
    """Teach the worker's adapter loader the `models:` scheme (called by the worker at start)."""
    from lorafleet.sidecar.adapters import register_adapter_scheme

    register_adapter_scheme("models", resolve_models_uri)
