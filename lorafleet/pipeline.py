"""The pipeline: research → tune → register → promote, typed on `ResearchResult` and callable from Python.

    from lorafleet import pipeline
    from lorafleet.research import load_config

    out = pipeline.run(load_config("configs/german-legal.yaml"), n_trials=4)   # research, then ship
    out.shipped.ref                          # ("german-legal", "3"), alias "candidate"
    pipeline.promote("german-legal")         # the task kind's gate → "champion" → live on the fleet

This layer sits above the stages and is the only place that joins them: research produces a
winner, tune measures its serving profile, the registry stores the bundle, promotion publishes it.
The CLI (`lorafleet research run`, `lorafleet tune`) is a thin wrapper over these functions.
"""

from __future__ import annotations

import random
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorafleet.core import settings, wire
from lorafleet.core.config import ServingProfile
from lorafleet.core.refs import parse_ref
from lorafleet.core.tasks import get_task_kind
from lorafleet.registry import store
from lorafleet.registry.bundle import ADAPTER_DIR, BUNDLE_FILE, read_spec
from lorafleet.registry.promote import Outcome, promote, rollback
from lorafleet.registry.store import CANDIDATE, BundleRef, RegistryError, register_bundle
from lorafleet.research.config import LoadedConfig
from lorafleet.research.result import ResearchResult
from lorafleet.research.runner import loaded_from_study, run_research
from lorafleet.tune.config import TuneConfig, TuneError
from lorafleet.tune.generation_guard import GenerationDev
from lorafleet.tune.precision import DevSet
from lorafleet.tune.source import TuneSource, from_adapter_dir
from lorafleet.tune.sweep import run_tune

# `promote` and `rollback` are the registry's (gate → alias → fleet state), offered here as pipeline verbs.
__all__ = ["Outcome", "PipelineResult", "ShipError", "Shipped", "dev_set_for", "promote", "resolve_tune_source",
           "resume", "rollback", "run", "ship", "tune", "winner_tune_source"]

Say = Callable[[str], None]
TAG_PARENT = "research.parent_run_id"
TAG_TRIAL = "research.winner_trial"
# bundle.yaml `details` key holding the winner's `train:` section: what rebuilds its dev set for `lorafleet tune`.
TRAIN_CONFIG = "train_config"
# bundle.yaml `details` key: the tuned precision's quality verdict (nDCG@10 loss vs fp32, min cosine, the reason).
PRECISION_QUALITY = "precision_quality"
# The precision guard's dev set, capped so that encoding it at each precision costs ~10 s on 2 CPUs (all-MiniLM-L6,
# 128 tokens: 800 long texts took 15 s on a loaded 2-core machine; queries are short): a seeded
# sample of dev queries, the documents they need, and a seeded sample of the rest up to DEV_MAX_DOCUMENTS.
DEV_MAX_QUERIES = 200
GENERATION_DEV_MAX = 64  # dev prompts the generative guard answers at each precision (greedy, through the engine)
DEV_MAX_DOCUMENTS = 400


class ShipError(RuntimeError):
    """Research finished (its result stands) but tuning or registering the winner failed."""


@dataclass
class Shipped:
    ref: BundleRef
    profile: ServingProfile
    profile_source: str
    tune_dir: Path | None


@dataclass
class PipelineResult:
    research: ResearchResult
    shipped: Shipped | None


def _say(say: Say | None) -> Say:
    return say or (lambda text: print(text, file=sys.stderr, flush=True))


# -- research → ship --------------------------------------------------------------------------------

def run(loaded: LoadedConfig, *, n_trials: int | None = None, budget_minutes: float | None = None,
        storage: str | None = None, worker_only: bool = False, progress_live: bool | None = None,
        ship_winner: bool = True, tune_quick: bool = False, tune_config: TuneConfig | None = None,
        on_researched: Callable[[ResearchResult], None] | None = None, say: Say | None = None) -> PipelineResult:
    """Research the config's study, then (unless `ship_winner` is False) tune and register a candidate winner.

    `on_researched(result)` runs between the two (the CLI prints the verdict there, before minutes of tuning).
    """
    result = run_research(loaded, n_trials=n_trials, budget_minutes=budget_minutes, storage=storage,
                          worker_only=worker_only, progress_live=progress_live)
    if on_researched is not None:
        on_researched(result)
    shipped = None
    if ship_winner and result.finalized and result.candidate:
        shipped = _ship_or_raise(result, tune_quick=tune_quick, tune_config=tune_config, say=say)
    return PipelineResult(result, shipped)


def _ship_or_raise(result: ResearchResult, **kwargs: Any) -> Shipped | None:
    try:
        return ship(result, **kwargs)
    except Exception as exc:
        raise ShipError(f"shipping the winner failed: {type(exc).__name__}: {exc}") from exc


def resume(name: str, *, n_trials: int | None = None, budget_minutes: float | None = None,
           storage: str | None = None, progress_live: bool | None = None, ship_winner: bool = True,
           tune_quick: bool = False, on_researched: Callable[[ResearchResult], None] | None = None,
           say: Say | None = None) -> PipelineResult:
    """Continue study `name` after a crash (its config is stored in the study), then ship as `run` does."""
    loaded = loaded_from_study(name, storage)
    result = run_research(loaded, n_trials=n_trials, budget_minutes=budget_minutes, storage=storage, resume=True,
                          progress_live=progress_live)
    if on_researched is not None:
        on_researched(result)
    shipped = None
    if ship_winner and result.candidate and result.winner_adapter_dir:
        shipped = _ship_or_raise(result, tune_quick=tune_quick, say=say)
    return PipelineResult(result, shipped)


def _already_shipped(name: str, parent_run_id: str | None, trial: object) -> Any:
    """The version registered earlier for this very winner (a resumed or second finalizing process)."""
    if not parent_run_id:
        return None
    try:
        known = store.versions(name)
    except RegistryError:
        return None
    for info in known:
        if info.tags.get(TAG_PARENT) == parent_run_id and info.tags.get(TAG_TRIAL) == str(trial):
            return info
    return None


def ship(result: ResearchResult, *, name: str | None = None, tune: bool = True, tune_quick: bool = False,
         tune_config: TuneConfig | None = None, require_candidate: bool = True, say: Say | None = None
         ) -> Shipped | None:
    """Tune (unless `tune` is False) and register the winner of `result` as `candidate`; None if not shippable.

    Idempotent: the same winner (parent run + trial) shipped twice registers one version.
    """
    say = _say(say)
    if require_candidate and not result.candidate:
        say("[ship] the winner is not a candidate: nothing tuned or registered")
        return None
    adapter_dir = result.winner_adapter_dir
    if not adapter_dir or not Path(adapter_dir).is_dir():
        say(f"[ship] no winner adapter folder ({adapter_dir!r}): nothing tuned or registered")
        return None
    name = name or result.study
    done = _already_shipped(name, result.parent_run_id, result.winner_trial)
    if done is not None:
        say(f"[ship] this winner is already registered as {name} v{done.version}; nothing to do")
        _, spec = store.bundle_spec(name, done.version)
        return Shipped(BundleRef(name, done.version), spec.profile, spec.profile_source, None)
    kind = get_task_kind(result.task)
    cfg = kind.parse_config(result.winner_config, source="the winner's configuration")
    base_source = kind.base_source(cfg)
    profile, profile_source, tune_dir, quality = None, "default", None, None
    reports = [Path(p) for p in [result.report_path] if p and Path(p).is_file()]
    if tune:
        tcfg = tune_config or (TuneConfig.quick_preset() if tune_quick else TuneConfig())
        say(f"[ship] tuning the serving profile of the winner ({'quick' if tcfg.quick else 'full'} sweep)")
        tuned = run_tune(winner_tune_source(result, name, say=say), tcfg, say=say)
        profile, profile_source, tune_dir = tuned.profile, "tuned", tuned.out_dir
        quality = precision_quality(tuned.quality, tuned.profile.precision)
        reports += [p for p in tuned.files.values() if p.is_file()]
    details = {**kind.bundle_details(cfg), TRAIN_CONFIG: dict(result.winner_config)}
    if quality is not None:
        details[PRECISION_QUALITY] = quality
    ref = register_bundle(
        name, adapter_dir, base_source=base_source, base_name=kind.base_name(cfg), profile=profile,
        profile_source=profile_source,
        # `baseline` is what the winner was judged against (its own config's baselines and the kind's rivals), and
        # `margin` the margin it was judged by: promotion gates against the same numbers at the same margin.
        metrics={**result.baseline, **result.winner_metrics}, dataset_digest=result.dataset_digest,
        margin=result.margin,
        report_paths=reports, max_seq_length=details.pop("max_seq_length", None), run_id=result.parent_run_id,
        alias=CANDIDATE, description=result.verdict or None, task=kind.name, kind=kind.bundle_kind,
        runtime=kind.default_runtime,
        details=details,
        extra_tags={"research.study": str(result.study), TAG_TRIAL: str(result.winner_trial),
                    TAG_PARENT: str(result.parent_run_id)},
    )
    say(f"[ship] registered {ref.name} v{ref.version} as '{CANDIDATE}'; promote it with: lorafleet promote {ref.name}")
    return Shipped(ref, profile or ServingProfile(), profile_source, tune_dir)


def precision_quality(quality: list[Any], precision: str | None) -> dict[str, Any] | None:
    """The quality guard's row for the chosen precision (what the bundle records beside its profile's precision)."""
    chosen = precision or "fp32"
    return next((q.row() for q in quality if q.precision == chosen), None)


def winner_tune_source(result: ResearchResult, name: str | None = None, *, say: Say | None = None) -> TuneSource:
    """What `ship` tunes: the winner's adapter on its base, with the dev set of its config for the precision guard."""
    kind = get_task_kind(result.task)
    cfg = kind.parse_config(result.winner_config, source="the winner's configuration")
    return TuneSource(Path(str(result.winner_adapter_dir)), kind.base_source(cfg), kind.base_name(cfg), None,
                      name or result.study, dev=dev_set_for(result.task, result.winner_config, say=say),
                      generation=generation_dev_for(result.task, result.winner_config, say=say))


def _rebuilt_dataset(task: str, train_config: dict[str, Any] | None, capability: str, digest: str | None,
                     say: Say, fallback: str) -> tuple[Any, Any] | None:
    """(parsed config, dataset) of a bundle's `train:` section, rebuilt through its task kind, for a guard's dev
    set; None, said with what the guard does instead (`fallback`), for a kind of another capability, data that
    cannot be rebuilt here, or data whose digest no longer matches `digest` (the bundle's)."""
    if not train_config:
        return None
    try:
        kind = get_task_kind(task)
        if kind.capability != capability:
            return None
        cfg = kind.parse_config(train_config, source="the bundle's training configuration")
        dataset = kind.build_dataset(cfg)
    except Exception as exc:  # the guard still runs without it: a dev set is a better judge, not a requirement
        say(f"[tune] the dev set could not be rebuilt ({type(exc).__name__}: {exc}); {fallback}")
        return None
    if digest and getattr(dataset, "digest", None) != digest:
        say(f"[tune] the data changed since training (digest {getattr(dataset, 'digest', None)} ≠ {digest}); "
            f"{fallback}")
        return None
    return cfg, dataset


def generation_dev_for(task: str, train_config: dict[str, Any] | None, *, digest: str | None = None,
                       say: Say | None = None, limit: int = GENERATION_DEV_MAX) -> GenerationDev | None:
    """The generative guard's dev set (issue 39): the first `limit` dev prompts of the config's dataset, their
    references, the answer budget, and the gate's scorer (mean ROUGE-L of cleaned answers); None for a kind that
    does not generate, or data that cannot be rebuilt here or changed since training (the guard keeps fp32)."""
    rebuilt = _rebuilt_dataset(task, train_config, wire.GENERATE, digest, _say(say), "the precision guard keeps fp32")
    if rebuilt is None:
        return None
    cfg, dataset = rebuilt
    from lorafleet.train.kinds.generation.evaluate import clean_answer, rouge_l  # rouge-score: loaded when a guard runs

    def score(answers: Any, references: Any) -> float:
        values = rouge_l([clean_answer(a) for a in answers], list(references))
        return sum(values) / max(len(values), 1)

    prompts, refs = dataset.prompts("dev")[:limit], dataset.references("dev")[:limit]
    if not prompts:
        return None
    return GenerationDev(tuple(prompts), tuple(refs), int(cfg.max_new_tokens), score)


def dev_set_for(task: str, train_config: dict[str, Any] | None, *, digest: str | None = None,
                say: Say | None = None) -> DevSet | None:
    """The precision guard's dev set, rebuilt from a `train:` section through the task kind; None (the guard then
    compares cosines on probe sentences only) for a kind that does not embed, a config that cannot rebuild its
    data here, or data whose digest no longer matches `digest` (the bundle's)."""
    rebuilt = _rebuilt_dataset(task, train_config, wire.EMBED, digest, _say(say),
                               "the precision guard compares cosines on probe sentences only")
    return None if rebuilt is None else _retrieval_dev(rebuilt[1])


def _retrieval_dev(dataset: Any, max_queries: int = DEV_MAX_QUERIES, max_documents: int = DEV_MAX_DOCUMENTS
                   ) -> DevSet | None:
    """A retrieval dataset's dev split as tune's DevSet: one document per section (its first chunk, the text the
    section leads with), since relevance is judged per section; None if it has no dev queries."""
    queries: dict[str, str] = dict(getattr(dataset, "queries", {}).get("dev") or {})
    qrels: dict[str, dict[str, int]] = dict(getattr(dataset, "qrels", {}).get("dev") or {})
    first: dict[str, tuple[int, str]] = {}
    for chunk in getattr(dataset, "corpus", {}).values():
        if chunk.section_id not in first or chunk.index < first[chunk.section_id][0]:
            first[chunk.section_id] = (chunk.index, chunk.text)
    qids = sorted(q for q in queries if any(d in first for d in qrels.get(q, {})))
    if not qids:
        return None
    rng = random.Random(0)
    qids = sorted(rng.sample(qids, max_queries)) if len(qids) > max_queries else qids
    needed = sorted({d for q in qids for d in qrels[q] if d in first})
    rest = sorted(set(first) - set(needed))
    docs = needed + sorted(rng.sample(rest, min(len(rest), max(max_documents - len(needed), 0))))
    return DevSet(queries={q: queries[q] for q in qids}, corpus={d: first[d][1] for d in docs},
                  qrels={q: {d: float(g) for d, g in qrels[q].items() if d in first} for q in qids})


# -- tune ------------------------------------------------------------------------------------------

_RUN_ID_RE = re.compile(r"^[0-9a-f]{32}$")


def resolve_tune_source(ref: str, base: str | None = None) -> TuneSource:
    """What `lorafleet tune REF` measures: an adapter folder, a bundle folder, an MLflow run id, or a
    registered NAME@alias / NAME/N."""
    path = Path(ref).expanduser()
    if path.is_dir():
        if (path / BUNDLE_FILE).is_file():
            spec = read_spec(path)
            return TuneSource(path / ADAPTER_DIR, base or spec.base.source, spec.base.name, spec.base.revision,
                              spec.name, spec.profile, _bundle_dev(spec), _bundle_generation(spec))
        if (path / "adapter_config.json").is_file():
            return from_adapter_dir(path, base)
        raise TuneError(f"{path} is neither a peft adapter folder (adapter_config.json) nor a bundle (bundle.yaml)")
    if ref.startswith(("/", "./", "../", "~")):
        raise TuneError(f"adapter folder {path} does not exist")
    if _RUN_ID_RE.match(ref):
        return _from_run(ref, base)
    registered = parse_ref(ref)
    if registered is not None:
        adapter_dir, spec, info = store.fetch_adapter(registered.name, registered.ref)
        return TuneSource(adapter_dir, base or spec.base.source, spec.base.name, spec.base.revision,
                          f"{info.name}-v{info.version}", spec.profile, _bundle_dev(spec), _bundle_generation(spec))
    raise TuneError(f"{ref!r} is not an adapter folder, a bundle folder, an MLflow run id (32 hex digits), "
                    "or a registered NAME@alias / NAME/version")


def _bundle_dev(spec: Any) -> DevSet | None:
    """The dev set of a bundle that records its training config (bundles shipped by the pipeline do)."""
    try:
        if get_task_kind(spec.task).capability != wire.EMBED:
            return None  # the precision guard scores embeddings; other kinds have no dev set to hand it
    except Exception:
        return None
    config = spec.details.get(TRAIN_CONFIG)
    if not config:
        _say(None)(f"[tune] bundle {spec.name} records no training config to rebuild its dev set from; "
                   "the precision guard compares cosines on probe sentences only")
        return None
    return dev_set_for(spec.task, config, digest=spec.dataset_digest)


def _bundle_generation(spec: Any) -> GenerationDev | None:
    """The generative guard's dev set of a bundle that records its training config (issue 39)."""
    return generation_dev_for(spec.task, spec.details.get(TRAIN_CONFIG), digest=spec.dataset_digest)


def _from_run(run_id: str, base: str | None) -> TuneSource:
    from mlflow.artifacts import download_artifacts

    c = store.client()
    try:
        c.get_run(run_id)
    except Exception as exc:
        raise TuneError(f"MLflow run {run_id} does not exist in {store.tracking_uri()}") from exc

    def find(path: str = "", depth: int = 0) -> str | None:
        for item in c.list_artifacts(run_id, path or None):
            if not item.is_dir and item.path.endswith("adapter_config.json"):
                return path
        if depth < 3:
            for item in c.list_artifacts(run_id, path or None):
                if item.is_dir and (found := find(item.path, depth + 1)) is not None:
                    return found
        return None

    found = find()
    if found is None:
        raise TuneError(f"MLflow run {run_id} has no logged adapter (no adapter_config.json among its artifacts)")
    dest = settings.home() / "tune" / "runs" / run_id
    if dest.exists():
        shutil.rmtree(dest)
    local = Path(download_artifacts(run_id=run_id, artifact_path=found, dst_path=str(dest),
                                    tracking_uri=store.tracking_uri()))
    return from_adapter_dir(local, base, f"run-{run_id[:8]}")


def tune(ref: str, cfg: TuneConfig | None = None, *, out_dir: Path | None = None, base: str | None = None,
         say: Say | None = None) -> Any:
    """`lorafleet tune REF`: resolve what REF names, then sweep its serving profile."""
    return run_tune(resolve_tune_source(ref, base), cfg, out_dir=out_dir, say=say)

