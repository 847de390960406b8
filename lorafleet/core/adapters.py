"""The adapter-source contract: how an adapter URI becomes a local peft folder, and how that fails.

An adapter URI is a plain path, `file://…`, or `<scheme>:…` for a scheme that a plugin provides
(the registry provides `models:`, which downloads a bundle and checks its sha256). Schemes are
entry points in the group `lorafleet.adapter_sources`; each names a function `uri -> Path`.
Workers only ever call `resolve_adapter_uri`, so the sidecar never imports the registry.

Workers accept only an allow-list (`AdapterPolicy`): registry references through an allowed plugin
scheme (`models:/NAME/N`, downloaded and verified by digest) and folders under configured local
roots. Any other URI — a forged task's, a tampered fleet entry's — is refused with one message
whatever it names, so a refusal never tells whether a path exists.

Failures are of two kinds on purpose: `AdapterUnavailable` means the adapter cannot exist for this
worker (unknown scheme, no such folder, not a peft adapter, a tampered bundle) and retrying will
not help; any other exception (store unreachable, I/O error) is transient and the task is retried.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from urllib.parse import unquote, urlsplit

from lorafleet.core import plugins

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


def local_path_of(uri: str) -> Path | None:
    """The local path a plain path or `file://` URI names (unresolved); None for a plugin scheme."""
    m = _SCHEME_RE.match(uri)
    if m and m.group(1).lower() != "file":
        return None
    return (file_uri(uri) if m else Path(uri)).expanduser()


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


class AdapterPolicy:
    """The adapter URIs one worker accepts: `schemes` (plugin sources that verify what they fetch, default
    the registry's `models:`) and local folders under `roots`. Paths are compared after resolving `..`
    and symbolic links, so neither leads out of a root."""

    def __init__(self, roots: Iterable[str | Path] = (), schemes: Iterable[str] = ("models",)) -> None:
        self.roots = tuple(dict.fromkeys(Path(r).expanduser().resolve() for r in roots))
        self.schemes = frozenset(s.lower() for s in schemes)

    def _refuse(self, uri: str) -> AdapterUnavailable:
        allowed = ", ".join(f"{s}:…" for s in sorted(self.schemes)) or "no registry scheme"
        return AdapterUnavailable(f"adapter URI {_clip(uri)!r} is not allowed on this worker: it loads adapters "
                                  f"only from {allowed} references or folders under its adapter roots "
                                  "(worker.adapter_roots)")

    def local_path(self, uri: str) -> Path | None:
        """The resolved local folder a plain path or file:// URI names, if it lies under a root; else None."""
        try:
            path = local_path_of(uri)
            if path is None:
                return None
            resolved = path.resolve()  # a relative path is taken from the working folder, `..` and links followed
        except (OSError, RuntimeError, ValueError):  # a symlink loop, an embedded NUL
            return None
        return resolved if any(resolved.is_relative_to(root) for root in self.roots) else None

    def resolve(self, uri: str) -> Path:
        """Like `resolve_adapter_uri`, limited to the allow-list; a refusal never depends on what exists."""
        if not uri:
            raise AdapterUnavailable("empty adapter URI")
        m = _SCHEME_RE.match(uri)
        if m and m.group(1).lower() != "file":
            if m.group(1).lower() not in self.schemes:
                raise self._refuse(uri)
            return resolve_adapter_uri(uri)
        path = self.local_path(uri)
        if path is None:
            raise self._refuse(uri)
        try:
            check_adapter_dir(path)
        except AdapterUnavailable:
            raise AdapterUnavailable(f"no usable peft adapter at {_clip(uri)!r}") from None
        return path


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
