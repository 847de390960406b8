"""The `models:` adapter source: `models:/NAME/3`, `models:/NAME/v3`, `models:/NAME@champion`.

Registered as a plugin (entry-point group `lorafleet.adapter_sources`, name `models`), so a worker
resolves registry URIs through the core adapter-source contract without importing this stage.
The bundle is downloaded once into LORAFLEET_HOME/bundles/NAME/vN, every sha256 checked, and
reused afterwards. Permanent problems (unknown version, tampered bundle) raise AdapterUnavailable
so the task is answered at once; an unreachable store stays a plain error, which the worker retries.
"""

from __future__ import annotations

from pathlib import Path

from lorafleet.core.adapters import AdapterUnavailable
from lorafleet.core.refs import parse_models_uri
from lorafleet.registry.bundle import BundleError
from lorafleet.registry.store import RegistryError, StoreUnreachable, fetch_adapter


def resolve_models_uri(uri: str) -> Path:
    """Local adapter folder of the bundle a models:/ URI names (downloaded and verified once)."""
    try:
        ref = parse_models_uri(uri)
        adapter_dir, _, _ = fetch_adapter(ref.name, ref.ref)
    except (ValueError, BundleError) as exc:
        raise AdapterUnavailable(str(exc)) from exc
    except StoreUnreachable:
        raise  # transient: the worker retries the task
    except RegistryError as exc:
        raise AdapterUnavailable(str(exc)) from exc
    return adapter_dir
