"""References to registered models, one grammar for every command and every adapter URI.

    NAME/3, NAME/v3, NAME@champion            (the CLI: tune, download)
    models:/NAME/3, models:/NAME@champion     (adapter URIs in tasks and in the fleet state)

NAME is a served name: it becomes a NATS KV key and a subject token, so it takes the narrower of
both alphabets.
"""

from __future__ import annotations

import re
from typing import NamedTuple

NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]*"
NAME_RE = re.compile(f"^{NAME_PATTERN}$")
_REF_RE = re.compile(rf"^(?P<name>{NAME_PATTERN})(?:/(?P<version>v?\d+)|@(?P<alias>[A-Za-z0-9_-]+))/?$")
MODELS_SCHEME = "models:/"


class ModelRef(NamedTuple):
    name: str
    version: str | None  # digits only
    alias: str | None

    @property
    def ref(self) -> str:
        """The version number or the alias, as the registry's lookups take it."""
        return self.version if self.version is not None else str(self.alias)

    def uri(self) -> str:
        if self.version is not None:
            return f"{MODELS_SCHEME}{self.name}/{self.version}"
        return f"{MODELS_SCHEME}{self.name}@{self.alias}"


def parse_ref(text: str) -> ModelRef | None:
    """NAME/N, NAME/vN or NAME@alias; None when `text` is not one (e.g. a path or a run id)."""
    m = _REF_RE.match(text)
    if not m:
        return None
    version = m.group("version")
    return ModelRef(m.group("name"), version.lstrip("v") if version else None, m.group("alias"))


def parse_models_uri(uri: str) -> ModelRef:
    """A `models:/…` adapter URI; ValueError naming the accepted forms."""
    ref = parse_ref(uri[len(MODELS_SCHEME):]) if uri.startswith(MODELS_SCHEME) else None
    if ref is None:
        raise ValueError(f"{uri!r} is not a registry URI; use models:/NAME/VERSION or models:/NAME@ALIAS")
    return ref


def version_uri(name: str, version: str | int) -> str:
    return f"{MODELS_SCHEME}{name}/{version}"


# A pinned served name (the HTTP API, `lorafleet embed -m`): NAME@N asks for exactly version N of NAME, where the
# plain NAME follows the champion. Only digits after the @: `NAME@champion` is the registry's alias syntax, and
# the served alias is the plain name.
PINNED_SYNTAX = "NAME@N (a served name, @, a version number: e.g. german-legal@4)"


class PinnedNameError(ValueError):
    """`NAME@…` that is not NAME@N."""


def parse_pinned(text: str) -> tuple[str, str] | None:
    """(NAME, N) of a pinned name `NAME@N`; None for a name without @; PinnedNameError naming the syntax for a
    malformed one (`NAME@`, `NAME@x`, `@3`)."""
    if "@" not in text:
        return None
    name, _, version = text.rpartition("@")
    if not NAME_RE.match(name) or not version.isdigit() or "@" in name:
        raise PinnedNameError(f"{text!r} is not a pinned model name; use {PINNED_SYNTAX}, or the plain NAME for the "
                              "current version")
    return name, str(int(version))  # NAME@04 is NAME@4, as the registry numbers it


def pinned_name(name: str, version: str | int) -> str:
    """What a client types to reach exactly this version, and what every response of it names."""
    return f"{name}@{version}"
