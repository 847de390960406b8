"""The ship step at the end of a research run: tune the winner's serving profile, register the bundle,
point the alias `candidate` at it.

Called from `lorafleet research run` once the winner is known; usable on its own with any
research result (or anything shaped like one).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorafleet.config import PACKAGED_MINILM, ServingProfile
from lorafleet.registry.store import CANDIDATE, BundleRef, register_bundle

Say = Callable[[str], None]
TAG_PARENT = "research.parent_run_id"


@dataclass
class Shipped:
    ref: BundleRef
    profile: ServingProfile
    profile_source: str
    tune_dir: Path | None


def _dataset_digest(run_id: str | None) -> str | None:
    """The dataset digest research tagged on its parent run (lorafleet.dataset_digest)."""
    if not run_id:
        return None
    try:
        from lorafleet.registry.store import client

        return client().get_run(run_id).data.tags.get("lorafleet.dataset_digest") or None
    except Exception:
        return None


def _already_shipped(name: str, parent_run_id: str | None, trial: object) -> Any:
    """The version registered earlier for this very winner (a resumed or second finalizing process)."""
    if not parent_run_id:
        return None
    from lorafleet.registry.store import RegistryError, versions

    try:
        known = versions(name)
    except RegistryError:
        return None
    for info in known:
        if info.tags.get(TAG_PARENT) == parent_run_id and info.tags.get("research.winner_trial") == str(trial):
            return info
    return None


def ship_research_result(result: Any, *, name: str | None = None, tune: bool = True, tune_quick: bool = False,
                         tune_config: Any = None, require_candidate: bool = True,
                         say: Say | None = None) -> Shipped | None:
    """Tune (unless `tune` is False) and register the winner of `result` as `candidate`; None if not shippable.

    `result` is a research.ResearchResult: winner_adapter_dir, winner_config, winner_metrics, baseline,
    parent_run_id, report_path, study, candidate.
    """
    say = say or (lambda text: print(text, file=sys.stderr, flush=True))
    if require_candidate and not getattr(result, "candidate", False):
        say("[ship] the winner is not a candidate: nothing tuned or registered")
        return None
    adapter_dir = getattr(result, "winner_adapter_dir", None)
    if not adapter_dir or not Path(adapter_dir).is_dir():
        say(f"[ship] no winner adapter folder ({adapter_dir!r}): nothing tuned or registered")
        return None
    name = name or result.study
    done = _already_shipped(name, getattr(result, "parent_run_id", None), getattr(result, "winner_trial", None))
    if done is not None:
        from lorafleet.registry.store import bundle_spec

        say(f"[ship] this winner is already registered as {name} v{done.version}; nothing to do")
        _, spec = bundle_spec(name, done.version)
        return Shipped(BundleRef(name, done.version), spec.profile, spec.profile_source, None)
    config = dict(getattr(result, "winner_config", None) or {})
    base_source = str(config.get("base_model") or PACKAGED_MINILM)
    max_seq_length = config.get("max_seq_length")
    profile, profile_source, tune_dir = None, "default", None
    reports = [Path(p) for p in [getattr(result, "report_path", None)] if p and Path(p).is_file()]
    if tune:
        from lorafleet.registry.bundle import base_name_for
        from lorafleet.tune.run import TuneConfig, TuneSource, run_tune

        cfg = tune_config or (TuneConfig.quick_preset() if tune_quick else TuneConfig())
        say(f"[ship] tuning the serving profile of the winner ({'quick' if cfg.quick else 'full'} sweep)")
        source = TuneSource(Path(adapter_dir), base_source, base_name_for(base_source), None, name)
        tuned = run_tune(source, cfg, say=say)
        profile, profile_source, tune_dir = tuned.profile, "tuned", tuned.out_dir
        reports += [p for p in tuned.files.values() if p.is_file()]
    metrics = {**(getattr(result, "baseline", None) or {}), **(getattr(result, "winner_metrics", None) or {})}
    ref = register_bundle(
        name, adapter_dir, base_source=base_source, profile=profile, profile_source=profile_source,
        metrics=metrics, dataset_digest=_dataset_digest(getattr(result, "parent_run_id", None)),
        report_paths=reports, max_seq_length=max_seq_length, run_id=getattr(result, "parent_run_id", None),
        alias=CANDIDATE, description=getattr(result, "verdict", None) or None,
        extra_tags={"research.study": str(result.study), "research.winner_trial": str(result.winner_trial),
                    TAG_PARENT: str(getattr(result, "parent_run_id", ""))},
    )
    say(f"[ship] registered {ref.name} v{ref.version} as '{CANDIDATE}'; promote it with: lorafleet promote {ref.name}")
    return Shipped(ref, profile or ServingProfile(), profile_source, tune_dir)
