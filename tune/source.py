"""What a sweep tunes: an adapter folder on a base model.

Registry references, bundle folders and MLflow run ids are resolved to a TuneSource by the
pipeline (lorafleet.pipeline.resolve_tune_source); this stage only needs a folder and a base.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lorafleet.core.adapters import recorded_base
from lorafleet.core.config import ServingProfile
from lorafleet.core.model_source import base_name_for, resolve_model_source
from lorafleet.tune.config import TuneError
from lorafleet.tune.generation_guard import GenerationDev
from lorafleet.tune.precision import DevSet


@dataclass
class TuneSource:
    """What is tuned: an adapter folder on a base model."""

    adapter_dir: Path
    base_source: str
    base_name: str
    base_revision: str | None
    label: str
    profile: ServingProfile | None = None  # the bundle's current profile, if it came from one
    dev: DevSet | None = None  # the bundle's dev set: the precision guard scores nDCG@10 on it (else probe sentences)
    generation: GenerationDev | None = None  # a generative bundle's dev prompts: the guard scores ROUGE-L on them


def from_adapter_dir(path: Path, base: str | None = None, label: str | None = None,
                     profile: ServingProfile | None = None) -> TuneSource:
    """A TuneSource for a peft adapter folder; the base is `base`, else the one the adapter recorded."""
    path = Path(path)
    if not (path / "adapter_config.json").is_file():
        raise TuneError(f"{path} is not a peft adapter folder (no adapter_config.json)")
    source = base or recorded_base(path)
    if not source:
        raise TuneError(f"{path}/adapter_config.json names no base model; pass --base")
    resolved = resolve_model_source(source)
    if source.startswith("/") and not Path(resolved).exists():
        raise TuneError(f"the adapter's base model {source} is not on this machine; pass --base")
    return TuneSource(path, source, base_name_for(source), None, label or path.name, profile)
