"""What the gateway knows of each base model before any worker answers: its tokenizer and its vector size.

Loaded once per base, off the request path and off the event loop (tokenizer files are read from
disk), by `load_bases`, which the gateway runs in a thread at start.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lorafleet.config import FleetConfig
from lorafleet.models import resolve_model_source
from lorafleet.serve.tokens import TokenCounter


def native_dim(source: str) -> int | None:
    """The output size of a local sentence-transformers folder (Pooling, no Dense), if it says so."""
    path = Path(resolve_model_source(source))
    try:
        modules = json.loads((path / "modules.json").read_text())
        if any("Dense" in m.get("type", "") for m in modules):
            return None
        pooling = next((m["path"] for m in modules if m.get("type", "").endswith("Pooling")), None)
        if pooling is None:
            return None
        dim = json.loads((path / pooling / "config.json").read_text()).get("word_embedding_dimension")
        return int(dim) if dim else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass
class BaseInfo:
    tokens: TokenCounter
    dim: int | None  # None until a result tells (a hub id, a model with a Dense head)


def load_bases(fleet: FleetConfig) -> dict[str, BaseInfo]:
    return {b.name: BaseInfo(TokenCounter.for_source(b.source), native_dim(b.source)) for b in fleet.bases}
