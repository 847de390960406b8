"""Bundles in MLflow: register a bundle folder as a model version, aliases, listing, verified download.

A bundle is a plain artifact folder (not an MLflow flavour): it is logged under a run and registered
with `MlflowClient.create_model_version(name, source=<artifact uri>, run_id=…)`. What a version
carries (tags, description) and reads back as (VersionInfo) is registry/version_record.py, re-exported here.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from lorafleet.core import settings
from lorafleet.core.config import ServingProfile
from lorafleet.core.metrics import mlflow_key
from lorafleet.core.refs import NAME_RE
from lorafleet.core.tasks import get_task_kind
from lorafleet.registry import bundle_cache
from lorafleet.registry.bundle import (
    ADAPTER_DIR,
    BUNDLE_FILE,
    DEFAULT_TASK,
    MARGIN_TAG,
    BundleError,
    BundleIntegrityError,
    BundleSpec,
    build_bundle,
    read_spec,
    sha256_file,
    verify_bundle,
)
from lorafleet.registry.bundle_cache import bundle_cache_dir
from lorafleet.registry.version_record import (
    CANDIDATE,
    CHAMPION,
    TAG_BASE,
    TAG_DIGEST,
    TAG_HISTORY,
    TAG_SPEC_SHA,
    TAG_TASK,
    BundleRef,
    RegistryError,
    StoreUnreachable,
    VersionInfo,
    model_description,
    version_description,
    version_tags,
)

os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

BUNDLE_EXPERIMENT = "lorafleet-bundles"


def tracking_uri() -> str:
    return settings.mlflow_tracking_uri()


def client() -> Any:
    """An MlflowClient on the lorafleet store, checked to answer; RegistryError if it cannot be reached."""
    from mlflow import MlflowClient

    uri = tracking_uri()
    c = MlflowClient(tracking_uri=uri, registry_uri=uri)
    try:
        c.search_registered_models(max_results=1)
    except Exception as exc:  # sqlalchemy, requests and MlflowException alike
        raise StoreUnreachable(f"cannot reach the MLflow store at {uri}: {type(exc).__name__}: {exc}") from exc
    return c


def _is_not_found(exc: Exception) -> bool:
    return getattr(exc, "error_code", "") in ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND", "INVALID_PARAMETER_VALUE")


def _bundle_experiment(c: Any) -> str:
    exp = c.get_experiment_by_name(BUNDLE_EXPERIMENT)
    if exp is not None:
        return exp.experiment_id
    try:
        return c.create_experiment(BUNDLE_EXPERIMENT, artifact_location=settings.mlflow_artifact_root("bundles"),
                                   tags={"mlflow.experimentKind": "custom_model_development",
                                         "mlflow.note.content": "Bundles registered without a research run "
                                                                "(`register_bundle` with no run id): one run each."})
    except Exception:  # created concurrently
        return c.get_experiment_by_name(BUNDLE_EXPERIMENT).experiment_id


def register_bundle(name: str, adapter_dir: str | Path, *, base_source: str, base_name: str | None = None,
                    base_revision: str | None = None, profile: ServingProfile | None = None,
                    profile_source: str = "default", metrics: dict[str, float] | None = None,
                    dataset_digest: str | None = None, report_paths: list[Path] | None = None,
                    max_seq_length: int | None = None, run_id: str | None = None, alias: str | None = None,
                    description: str | None = None, extra_tags: dict[str, str] | None = None,
                    task: str = DEFAULT_TASK, kind: str = "sentence-transformers",
                    runtime: str = "sentence-transformers", details: dict[str, Any] | None = None,
                    margin: float | None = None) -> BundleRef:
    """Build the bundle, log it under `run_id` (or a new run in the bundles experiment), register a version.

    Returns (name, version). With `alias`, points it at the new version (research uses 'candidate').
    """
    from mlflow.entities import RunStatus

    if not NAME_RE.match(name):
        raise RegistryError(f"bundle name {name!r} must match {NAME_RE.pattern} (it becomes a served name)")
    c = client()
    with tempfile.TemporaryDirectory(prefix="lorafleet-bundle-") as tmp:
        bundle_dir = Path(tmp) / "bundle"
        spec = build_bundle(bundle_dir, name=name, adapter_dir=Path(adapter_dir), base_source=base_source,
                            base_name=base_name, base_revision=base_revision, profile=profile,
                            profile_source=profile_source, metrics=metrics, dataset_digest=dataset_digest,
                            report_paths=report_paths, max_seq_length=max_seq_length, task=task, kind=kind,
                            runtime=runtime, details=details, margin=margin)
        spec_sha = sha256_file(bundle_dir / BUNDLE_FILE)
        own_run = run_id is None
        if own_run:
            run = c.create_run(_bundle_experiment(c), run_name=f"bundle {name}",
                               tags={"lorafleet.kind": "bundle", TAG_BASE: spec.base.name})
            run_id = run.info.run_id
        else:
            try:
                run = c.get_run(run_id)
            except Exception as exc:
                raise RegistryError(f"MLflow run {run_id} does not exist in {tracking_uri()}") from exc
        artifact_path = f"bundle-{name}"
        try:
            c.log_artifacts(run_id, str(bundle_dir), artifact_path)
            if own_run:  # the headline only, as research and training runs log it
                for k in get_task_kind(task).metrics.headline_set:
                    if k in spec.metrics:
                        c.log_metric(run_id, mlflow_key(k), spec.metrics[k])
        finally:
            if own_run:
                c.set_terminated(run_id, RunStatus.to_string(RunStatus.FINISHED))
    source = f"{run.info.artifact_uri.rstrip('/')}/{artifact_path}"
    metric_spec = get_task_kind(task).metrics
    with contextlib.suppress(Exception):  # already exists
        c.create_registered_model(name, description=model_description(task, metric_spec))
    tags = version_tags(metric_spec, spec.metrics)
    tags.update({TAG_BASE: spec.base.name})
    if dataset_digest:
        tags[TAG_DIGEST] = dataset_digest
    if spec.margin is not None:  # what promotion gates at (registry/promote.py check_gate)
        tags[MARGIN_TAG] = f"{spec.margin:g}"
    tags.update({"profile_source": spec.profile_source, TAG_SPEC_SHA: spec_sha, TAG_TASK: task})
    tags.update(extra_tags or {})
    mv = c.create_model_version(name, source, run_id=run_id, tags=tags,
                                description=version_description(metric_spec, spec.metrics, spec.base.name,
                                                                dataset_digest, description))
    version = str(mv.version)
    if alias:
        c.set_registered_model_alias(name, alias, version)
    return BundleRef(name, version)


def _registered(c: Any, name: str) -> Any:
    try:
        return c.get_registered_model(name)
    except Exception as exc:
        if not _is_not_found(exc):
            raise RegistryError(f"MLflow store {tracking_uri()}: {exc}") from exc
        known = sorted(m.name for m in c.search_registered_models())
        raise RegistryError(f"no registered model named {name!r} (known: {', '.join(known) or 'none'})") from exc


def _info(mv: Any, aliases: list[str]) -> VersionInfo:
    return VersionInfo(name=mv.name, version=str(mv.version), source=mv.source, run_id=mv.run_id,
                       aliases=aliases, tags=dict(mv.tags or {}))


def versions(name: str) -> list[VersionInfo]:
    """All versions of `name`, oldest first; RegistryError if the name is unknown."""
    c = client()
    rm = _registered(c, name)
    by_version: dict[str, list[str]] = {}
    for alias, v in (rm.aliases or {}).items():
        by_version.setdefault(str(v), []).append(alias)
    mvs = c.search_model_versions(f"name = '{name}'")
    return sorted((_info(mv, sorted(by_version.get(str(mv.version), []))) for mv in mvs),
                  key=lambda i: int(i.version))


def get_version(name: str, ref: str | int | None) -> VersionInfo:
    """`ref`: a version number, 'vN', an alias, or None for the newest version."""
    all_versions = versions(name)
    if not all_versions:
        raise RegistryError(f"registered model {name!r} has no versions")
    if ref is None:
        return all_versions[-1]
    ref = str(ref)
    digits = ref[1:] if ref[:1] in ("v", "V") and ref[1:].isdigit() else ref
    if digits.isdigit():
        for info in all_versions:
            if info.version == digits:
                return info
        raise RegistryError(f"model {name!r} has no version {ref} (versions: "
                            f"{', '.join(i.version for i in all_versions)})")
    for info in all_versions:
        if ref in info.aliases:
            return info
    aliases = sorted({a for i in all_versions for a in i.aliases})
    raise RegistryError(f"model {name!r} has no alias {ref!r} (aliases: {', '.join(aliases) or 'none'})")


def alias_version(name: str, alias: str) -> str | None:
    c = client()
    rm = _registered(c, name)
    v = (rm.aliases or {}).get(alias)
    return str(v) if v is not None else None


def set_alias(name: str, alias: str, version: str | int) -> None:
    info = get_version(name, version)
    client().set_registered_model_alias(name, alias, info.version)


def delete_alias(name: str, alias: str) -> None:
    with contextlib.suppress(Exception):
        client().delete_registered_model_alias(name, alias)


def champion_history(name: str) -> list[str]:
    rm = _registered(client(), name)
    raw = (rm.tags or {}).get(TAG_HISTORY, "")
    return [v for v in raw.split(",") if v]


def set_champion_history(name: str, history: list[str]) -> None:
    client().set_registered_model_tag(name, TAG_HISTORY, ",".join(history[-50:]))


def list_models() -> list[tuple[str, list[VersionInfo]]]:
    c = client()
    return [(rm.name, versions(rm.name)) for rm in sorted(c.search_registered_models(), key=lambda m: m.name)]


def download_bundle(name: str, ref: str | int | None, dest: str | Path, *, reuse: bool = True) -> Path:
    """Download version `ref` (number or alias) of bundle `name` into `dest`, verifying every sha256.

    `dest` must not exist, be empty, or (with `reuse`) already hold this very bundle, verified again.
    A tampered or incomplete bundle raises BundleIntegrityError and leaves nothing at `dest`."""
    from mlflow.artifacts import download_artifacts

    info = get_version(name, ref)
    expected = info.tags.get(TAG_SPEC_SHA)
    dest = Path(dest)
    if dest.exists() and any(dest.iterdir()):
        if reuse and (dest / BUNDLE_FILE).is_file():
            verify_bundle(dest, expected)
            return dest
        raise BundleError(f"destination {dest} is not empty")
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
    try:
        try:
            download_artifacts(artifact_uri=info.source, dst_path=str(partial), tracking_uri=tracking_uri())
        except Exception as exc:
            raise BundleIntegrityError(f"cannot download bundle {name} v{info.version} from {info.source}: {exc}") \
                from exc
        root = partial
        # download_artifacts of a folder URI lands its contents directly or inside a same-named folder.
        if not (root / BUNDLE_FILE).is_file():
            subdirs = [p for p in root.iterdir() if p.is_dir()]
            if len(subdirs) == 1 and (subdirs[0] / BUNDLE_FILE).is_file():
                root = subdirs[0]
        verify_bundle(root, expected)
        try:
            if dest.exists():
                dest.rmdir()  # an empty leftover; not empty when another worker renamed its copy there meanwhile
            os.replace(root, dest)
        except OSError:
            # Another process (a second worker) put the same bundle there first; use it if it verifies.
            verify_bundle(dest, expected)
        return dest
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def bundle_spec(name: str, ref: str | int | None) -> tuple[VersionInfo, BundleSpec]:
    """The version and its bundle.yaml, read from the store (downloads only bundle.yaml)."""
    from mlflow.artifacts import download_artifacts

    info = get_version(name, ref)
    with tempfile.TemporaryDirectory(prefix="lorafleet-spec-") as tmp:
        try:
            download_artifacts(artifact_uri=f"{info.source}/{BUNDLE_FILE}", dst_path=tmp,
                               tracking_uri=tracking_uri())
        except Exception as exc:
            raise BundleIntegrityError(f"bundle {name} v{info.version} has no readable {BUNDLE_FILE} at "
                                       f"{info.source}: {exc}") from exc
        expected = info.tags.get(TAG_SPEC_SHA)
        if expected and sha256_file(Path(tmp) / BUNDLE_FILE) != expected:
            raise BundleIntegrityError(f"{BUNDLE_FILE} of {name} v{info.version} was changed after registration")
        return info, read_spec(Path(tmp))


def fetch_adapter(name: str, ref: str | int | None) -> tuple[Path, BundleSpec, VersionInfo]:
    """Download (cached under LORAFLEET_HOME/bundles, bounded by LORAFLEET_BUNDLE_CACHE_BYTES: least recently used
    bundles go after a download, see `bundle_cache`) and verify a bundle; its adapter dir, spec and version."""
    info = get_version(name, ref)
    limit = bundle_cache.cache_limit()  # a bad setting fails before the download
    dest = bundle_cache_dir(name, info.version)
    fresh = not (dest / BUNDLE_FILE).is_file()
    path = download_bundle(name, info.version, dest)
    bundle_cache.touch(path)
    if fresh:
        bundle_cache.prune(bundle_cache.cache_root(), limit, keep=path)
    return path / ADAPTER_DIR, read_spec(path), info


__all__ = [
    "CANDIDATE",
    "CHAMPION",
    "BundleIntegrityError",
    "BundleRef",
    "RegistryError",
    "StoreUnreachable",
    "VersionInfo",
    "alias_version",
    "bundle_spec",
    "download_bundle",
    "fetch_adapter",
    "get_version",
    "list_models",
    "register_bundle",
    "set_alias",
    "versions",
]
