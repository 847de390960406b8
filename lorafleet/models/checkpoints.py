"""Whether a checkpoint ships its own score head: what tells a reranker from a base that only adapters may use.

A cross-encoder base is loaded with one output (sidecar/ce_runtime.py); a checkpoint without a sequence
classification head (the packaged MiniLM, any plain BERT) gets one drawn at load, which ranks at chance.
Such a base is served so that rerank specialists (LoRAs that carry their own head) can attach to it, never
as a model by itself. The head counts as trained when the checkpoint holds its weights (top-level
`classifier.*` or `score.*` tensors, as transformers' sequence-classification models save them), never
because the loader produced one. Read from the weight files' headers only (no tensor is loaded): by the
gateway at start (serve/bases.py) and by the worker after loading (sidecar/ce_runtime.py), so both decide
alike.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from lorafleet.core.model_source import resolve_model_source

log = logging.getLogger(__name__)

HEAD_PREFIXES = ("classifier", "score")  # BERT/RoBERTa/XLM-R/DeBERTa/ModernBERT heads; decoder models' `score`
_MAX_HEADER = 100_000_000  # safetensors' own limit on a header
_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_SINGLE = ("model.safetensors", "pytorch_model.bin")
RERANK_DOC = "docs/ship.md"
TRAIN_COMMAND = "lorafleet research run configs/german-legal-rerank.yaml"
PROMOTE_COMMAND = "lorafleet promote german-legal-rerank"


def untrained_head_message(name: str) -> str:
    """What a request to a base whose head was drawn at load is told (the gateway's 409, the worker's refusal,
    `lorafleet rerank`): what it is, and what to do."""
    return (f"model {name!r} is a rerank base, not a reranker: its checkpoint has no score head, so the head it "
            "scores with was drawn at random when it was loaded and ranks documents at chance. It is served so "
            "that rerank specialists can attach to it. Train and promote one, then rerank with its name: "
            f"`{TRAIN_COMMAND}`, then `{PROMOTE_COMMAND}` ({RERANK_DOC}); or serve a cross-encoder checkpoint "
            "that ships its head as the base")


def _is_head(key: str) -> bool:
    return key.split(".", 1)[0] in HEAD_PREFIXES


def _safetensors_keys(path: Path) -> list[str]:
    with path.open("rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
        if not 0 < size <= _MAX_HEADER:
            raise ValueError(f"{path} has no safetensors header")
        header = json.loads(fh.read(size))
    return [k for k in header if k != "__metadata__"]


def _bin_keys(path: Path) -> list[str]:
    import torch

    # mmap + meta: the archive's index is read, not the tensors.
    state = torch.load(str(path), map_location="meta", weights_only=True, mmap=True)
    return list(state)


def _weights_folder(root: Path) -> Path | None:
    """The folder holding the transformer's weights: the root, else the first Transformer module of a
    sentence-transformers layout (modules.json)."""
    if any((root / n).is_file() for n in (*_INDEXES, *_SINGLE)):
        return root
    try:
        modules = json.loads((root / "modules.json").read_text())
    except (OSError, ValueError):
        return None
    for m in modules if isinstance(modules, list) else ():
        if isinstance(m, dict) and str(m.get("type", "")).endswith("Transformer") and m.get("path"):
            return root / str(m["path"])
    return None


def weight_keys(folder: Path) -> list[str] | None:
    """The tensor names of a local checkpoint folder (sharded or not), or None when it has no readable weights."""
    weights = _weights_folder(folder)
    if weights is None:
        return None
    for name in _INDEXES:
        if (weights / name).is_file():
            return list(json.loads((weights / name).read_text())["weight_map"])
    if (weights / "model.safetensors").is_file():
        return _safetensors_keys(weights / "model.safetensors")
    if (weights / "pytorch_model.bin").is_file():
        return _bin_keys(weights / "pytorch_model.bin")
    return None


def _local_folder(source: str, revision: str | None) -> Path | None:
    """A local folder for `source`: the packaged MiniLM or a path as such, a hub id only if it is in the hub cache
    (never downloaded here)."""
    resolved = Path(resolve_model_source(source))
    if resolved.is_dir():
        return resolved
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(source), revision=revision, local_files_only=True))
    except Exception:  # not cached, not a repo id: the hub library raises several types
        return None


def head_in_checkpoint(source: str, revision: str | None = None) -> bool | None:
    """True when the checkpoint of `source` holds a score head's weights, False when it has none (the loader
    would draw one), None when its weights cannot be read here (a hub id that is not in the cache)."""
    folder = _local_folder(source, revision)
    if folder is None:
        return None
    try:
        keys = weight_keys(folder)
    except Exception as exc:  # a broken file is the loader's to report; here it only means "cannot tell"
        log.warning("cannot read the weight names of %s: %r", folder, exc)
        return None
    return None if keys is None else any(_is_head(k) for k in keys)


__all__ = ["HEAD_PREFIXES", "head_in_checkpoint", "untrained_head_message", "weight_keys"]
