"""What the gateway knows of each base model before any worker answers: what it does (embed, generate, score),
its tokenizer, and its vector size (embed) or its chat template and context (generate).

Loaded once per base, off the request path and off the event loop (tokenizer files are read from
disk), by `load_bases`, which the gateway runs in a thread at start. What a base does is what its
runtime plugin declares (`capabilities`, read through the core plugin door). A score base whose checkpoint has no
score head (lorafleet/models/checkpoints.py: the loader draws one, which ranks at chance) is a `rerank-base`: only the
specialists on it answer; the bare name is refused (serve/rerank.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lorafleet.core import plugins
from lorafleet.core.config import BaseModelSpec, FleetConfig
from lorafleet.core.model_source import resolve_model_source
from lorafleet.core.wire import EMBED, GENERATE, SCORE
from lorafleet.models.checkpoints import head_in_checkpoint
from lorafleet.serve.prompts import CausalPrompts
from lorafleet.serve.tokens import TokenCounter

RERANK_BASE = "rerank-base"  # /v1/models kind of a score base whose head was drawn at load


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
    tokens: TokenCounter | None  # embed
    dim: int | None  # None until a result tells (a hub id, a model with a Dense head)
    capability: str = EMBED
    prompts: CausalPrompts | None = None  # generate
    max_length: int | None = None  # score: the longest (query, document) pair the model reads; longer is truncated
    # score: whether the checkpoint ships its score head (False: drawn at load, the bare base is refused; None: its
    # weights are not readable here, e.g. a hub id not in the cache: served, and the worker decides)
    trained_head: bool | None = None

    @property
    def untrained(self) -> bool:
        """A score base whose head was drawn at load: served only for the specialists that attach to it."""
        return self.capability == SCORE and self.trained_head is False

    @property
    def kind(self) -> str:
        """What /v1/models says the bare base is."""
        if self.untrained:
            return RERANK_BASE
        return {GENERATE: "causal-lm", SCORE: "reranker"}.get(self.capability, "embedding")

    def kind_of(self, adapter: str | None) -> str:
        """What /v1/models says a served name on this base is: a specialist on a rerank base is a reranker (its
        head travels in its adapter)."""
        return "reranker" if adapter is not None and self.capability == SCORE else self.kind

    def model_fields(self, adapter: str | None) -> dict[str, bool | None]:
        """Extra /v1/models fields of a served name on this base: `trained_head` for rerankers."""
        if self.capability != SCORE:
            return {}
        return {"trained_head": True if adapter is not None else self.trained_head}


def capability_of(spec: BaseModelSpec) -> str:
    """`generate` (or `score`) when the base's runtime declares it and not `embed`, else `embed`."""
    declared = getattr(plugins.load(plugins.RUNTIMES, spec.runtime), "capabilities", frozenset())
    if EMBED in declared:
        return EMBED
    return GENERATE if GENERATE in declared else SCORE if SCORE in declared else EMBED


def pair_max_length(spec: BaseModelSpec) -> int | None:
    """The length a cross-encoder truncates pairs to, as sentence-transformers' CrossEncoder finds it: the spec's
    max_seq_length, else the tokenizer's model_max_length, else the model's max_position_embeddings."""
    if spec.max_seq_length is not None:
        return spec.max_seq_length
    path = Path(resolve_model_source(spec.source))
    for name, key in (("tokenizer_config.json", "model_max_length"), ("config.json", "max_position_embeddings")):
        try:
            value = json.loads((path / name).read_text()).get(key)
        except (OSError, ValueError):
            continue
        if isinstance(value, int) and 0 < value < 1_000_000:  # transformers' "no limit" is a huge int
            return value
    return None


def load_base(spec: BaseModelSpec) -> BaseInfo:
    capability = capability_of(spec)
    if capability == GENERATE:
        return BaseInfo(None, None, GENERATE, CausalPrompts(spec.source, spec.options, spec.revision))
    if capability == SCORE:
        return BaseInfo(TokenCounter.for_source(spec.source), None, SCORE, max_length=pair_max_length(spec),
                        trained_head=head_in_checkpoint(spec.source, spec.revision))
    return BaseInfo(TokenCounter.for_source(spec.source), native_dim(spec.source))


def load_bases(fleet: FleetConfig) -> dict[str, BaseInfo]:
    return {b.name: load_base(b) for b in fleet.bases}
