"""The adapter-source contract: how an adapter URI becomes a local peft folder, and how that fails.

An adapter URI is a plain path, `file://…`, or `<scheme>:…` for a scheme that a plugin provides
(the registry provides `models:`, which downloads a bundle and checks its sha256). Schemes are
entry points in the group `lorafleet.adapter_sources`; each names a function `uri -> Path`.
Workers only ever call `resolve_adapter_uri`, so the sidecar never imports the registry.

Failures are of two kinds on purpose: `AdapterUnavailable` means the adapter cannot exist for this
worker (unknown scheme, no such folder, not a peft adapter, a tampered bundle) and retrying will
not help; any other exception (store unreachable, I/O error) is transient and the task is retried.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from urllib.parse import unquote, urlsplit

from lorafleet import plugins

AdapterResolver = Callable[[str], Path]
ADAPTER_FILES = ("adapter_config.json",)
_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):")
_REGISTERED: dict[str, AdapterResolver] = {}


class AdapterUnavailable(RuntimeError):
    """The adapter cannot be used by this worker, and retrying will not change that."""


def register_adapter_scheme(scheme: str, resolver: AdapterResolver) -> None:
    """Add a scheme in this process (tests, embedding applications); plugins use the entry-point group."""
    scheme = scheme.lower()
    if scheme in _REGISTERED and _REGISTERED[scheme] is not resolver:
        raise ValueError(f"adapter URI scheme {scheme!r} is already registered")
    _REGISTERED[scheme] = resolver


def file_uri(uri: str) -> Path:
    """`file:///path` → /path (the built-in scheme, registered like any plugin)."""
    return Path(unquote(urlsplit(uri).path))


def _resolver(scheme: str, uri: str) -> AdapterResolver:
    if scheme in _REGISTERED:
        return _REGISTERED[scheme]
    if scheme in plugins.names(plugins.ADAPTER_SOURCES):
        resolver = plugins.load(plugins.ADAPTER_SOURCES, scheme)
        _REGISTERED[scheme] = resolver
        return resolver
    known = sorted({*plugins.names(plugins.ADAPTER_SOURCES), *_REGISTERED})
    raise AdapterUnavailable(f"no resolver for adapter URI scheme '{scheme}:' ({uri}); known: {known} "
                             f"(a plugin adds one under the entry-point group '{plugins.ADAPTER_SOURCES}')")


def resolve_adapter_uri(uri: str) -> Path:
    """A local directory holding a peft adapter; AdapterUnavailable (a permanent failure) otherwise."""
    if not uri:
        raise AdapterUnavailable("empty adapter URI")
    m = _SCHEME_RE.match(uri)
    path = _resolver(m.group(1).lower(), uri)(uri) if m else Path(uri)
    path = path.expanduser()
    check_adapter_dir(path, uri)
    return path.resolve()


def check_adapter_dir(path: Path, origin: str | None = None) -> None:
    """AdapterUnavailable unless `path` is a folder with the peft adapter files."""
    where = f" (from {origin})" if origin and origin != str(path) else ""
    if not path.is_dir():
        raise AdapterUnavailable(f"adapter directory {path} does not exist{where}")
    for name in ADAPTER_FILES:
        if not (path / name).is_file():
            raise AdapterUnavailable(f"adapter directory {path} has no {name} (not a peft adapter){where}")


def recorded_base(adapter_dir: Path) -> str | None:
    """The base model the adapter recorded when it was trained (often an absolute path elsewhere).

    Informational only: loaders put an adapter on the base they were configured with.
    """
    try:
        return json.loads((Path(adapter_dir) / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except (OSError, ValueError):
        return None
