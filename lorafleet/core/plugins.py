"""Entry-point plugins: the one door through which runtimes, task kinds and adapter sources are found.

Built-ins register in lorafleet's own `pyproject.toml` exactly like third-party packages do, so a
new runtime or task kind is a new module (or package) plus an entry point, never an edit of a
factory. Only the plugin that is asked for is imported. An unknown name, a duplicate name (two
distributions registering it) or a plugin that fails to import is an error, never a warning.

Entry points live in installed metadata: after editing them, run `pip install -e .` again.
"""

from __future__ import annotations

import importlib.metadata
from functools import cache
from typing import Any, Final

RUNTIMES: Final = "lorafleet.runtimes"
TASK_KINDS: Final = "lorafleet.tasks"
ADAPTER_SOURCES: Final = "lorafleet.adapter_sources"
_NOUNS = {RUNTIMES: "runtime", TASK_KINDS: "task kind", ADAPTER_SOURCES: "adapter source"}


class PluginError(RuntimeError):
    """A plugin cannot be found or loaded; the message names what exists."""


@cache
def _entries(group: str) -> dict[str, importlib.metadata.EntryPoint]:
    found: dict[str, importlib.metadata.EntryPoint] = {}
    for ep in importlib.metadata.entry_points(group=group):
        other = found.get(ep.name)
        if other is not None and other.value != ep.value:
            raise PluginError(f"{group}: {ep.name!r} is registered twice ({other.value} and {ep.value}); "
                              "uninstall one of the packages")
        found[ep.name] = ep
    return found


def names(group: str) -> list[str]:
    """The registered names of `group`, sorted (nothing is imported)."""
    return sorted(_entries(group))


def load(group: str, name: str) -> Any:
    """The object registered as `name` in `group`; PluginError naming the known ones otherwise."""
    ep = _entries(group).get(name)
    if ep is None:
        known = ", ".join(names(group)) or "none"
        raise PluginError(f"unknown {_NOUNS.get(group, 'plugin')} {name!r}; known: {known} "
                          f"(a plugin registers under the entry-point group '{group}')")
    try:
        return ep.load()
    except Exception as exc:
        raise PluginError(f"{group}: plugin {name!r} ({ep.value}) failed to load: {type(exc).__name__}: {exc}") \
            from exc
