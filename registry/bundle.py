"""The bundle: what one MLflow model version holds, written and checked on local disk.

Layout of a bundle folder:

    bundle.yaml          base model reference, runtime, pooling/normalisation, max sequence length,
                         the tuned serving profile, headline metrics, dataset digest, sha256 of every file
    adapter/             the peft adapter (adapter_config.json, adapter_model.safetensors, …)
    report.md            the evaluation report (optional, any name under report/ is kept)
    dataset_digest.txt   the content hash of the dataset the adapter was trained and evaluated on

Pure file logic (no MLflow), so it is tested directly and reused by the download check.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field

from lorafleet.core import adapters
from lorafleet.core.config import ServingProfile, StrictModel
from lorafleet.core.model_source import base_name_for, resolve_model_source
from lorafleet.core.refs import NAME_RE

BUNDLE_FILE = "bundle.yaml"
ADAPTER_DIR = "adapter"
DIGEST_FILE = "dataset_digest.txt"
REPORT_DIR = "report"
BUNDLE_FORMAT = 1
# A bundle name becomes a served name and a NATS KV key (lorafleet.core.refs).
KEY_NAME_RE = NAME_RE
DEFAULT_TASK = "retrieval"  # bundles from before task kinds were recorded
MARGIN_TAG = "lorafleet.gate_margin"  # model-version tag: the bundle's `margin`, what promotion gates at


class BundleError(ValueError):
    """A bundle that cannot be built or used; the message says what is wrong."""


class BundleIntegrityError(BundleError):
    """A bundle whose files do not match the sha256 recorded in its bundle.yaml (tampered or incomplete)."""


class BaseRef(StrictModel):
    """Which base model the adapter belongs to; `name` is the served base name in a fleet."""

    name: str
    source: str = Field(description="What loaders take: the packaged name, a hub id or a folder.")
    revision: str | None = None


class BundleSpec(StrictModel):
    """The contents of bundle.yaml."""

    format: int = BUNDLE_FORMAT
    name: str
    base: BaseRef
    task: str = Field(DEFAULT_TASK, description="The task kind that trained it (lorafleet.core.tasks).")
    kind: str = Field("sentence-transformers", description="Bundle kind: sentence-transformers, causal-lm, …")
    runtime: str = "sentence-transformers"
    pooling: str | None = Field(None, description="Pooling mode of the base model (mean, cls, …).")
    normalize: bool | None = None
    max_seq_length: int | None = None
    profile: ServingProfile = Field(default_factory=ServingProfile)
    profile_source: str = Field("default", description="'tuned' when `lorafleet tune` measured it.")
    precision: str | None = Field(None, description="The precision tune's quality guard judged this adapter at "
                                  "(its dev metric within the guard of fp32's, the adapter loaded): what a base under "
                                  "`precision: auto` serves it at. None: no tuned verdict; its gated numbers are fp32.")
    metrics: dict[str, float] = Field(default_factory=dict)
    margin: float | None = Field(None, ge=0, description="The relative margin research judged the adapter by "
                                 "(research.min_margin); promotion gates at it unless told another.")
    dataset_digest: str | None = None
    created: float = Field(default_factory=time.time)
    details: dict[str, Any] = Field(default_factory=dict, description="What the task kind records beside the "
                                    "adapter (chat template, system prompt, generation defaults, GGUF digest, …).")
    files: dict[str, str] = Field(default_factory=dict, description="Relative path → sha256, every file but this.")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _listed_files(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): sha256_file(p)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.relative_to(root).as_posix() != BUNDLE_FILE
    }


def describe_base(source: str) -> dict[str, Any]:
    """Pooling mode, normalisation and max sequence length read from a local sentence-transformers folder."""
    path = Path(resolve_model_source(source))
    out: dict[str, Any] = {"pooling": None, "normalize": None, "max_seq_length": None}
    try:
        modules = json.loads((path / "modules.json").read_text())
    except (OSError, ValueError):
        return out
    out["normalize"] = any("Normalize" in m.get("type", "") for m in modules)
    for m in modules:
        if m.get("type", "").endswith("Pooling"):
            try:
                cfg = json.loads((path / m["path"] / "config.json").read_text())
            except (OSError, ValueError, KeyError):
                continue
            if isinstance(cfg.get("pooling_mode"), str):  # sentence-transformers ≥ 6
                out["pooling"] = cfg["pooling_mode"]
                continue
            modes = [k.removeprefix("pooling_mode_").removesuffix("_tokens") for k, v in cfg.items()
                     if k.startswith("pooling_mode_") and v is True]
            out["pooling"] = ",".join(modes) or None
    # sentence-transformers < 6 keeps it in sentence_bert_config.json; ≥ 6 leaves it to the tokenizer.
    for file, key in (("sentence_bert_config.json", "max_seq_length"), ("tokenizer_config.json", "model_max_length")):
        try:
            value = json.loads((path / file).read_text()).get(key)
        except (OSError, ValueError):
            continue
        if isinstance(value, int) and 0 < value < 1_000_000:
            out["max_seq_length"] = value
            break
    return out


def check_adapter_dir(adapter_dir: Path) -> None:
    """BundleError unless `adapter_dir` is a peft adapter folder (the check workers make, lorafleet.core.adapters)."""
    try:
        adapters.check_adapter_dir(adapter_dir)
    except adapters.AdapterUnavailable as exc:
        raise BundleError(str(exc)) from exc


def build_bundle(out_dir: Path, *, name: str, adapter_dir: Path, base_source: str, base_name: str | None = None,
                 base_revision: str | None = None, profile: ServingProfile | None = None,
                 profile_source: str = "default", metrics: dict[str, float] | None = None,
                 dataset_digest: str | None = None, report_paths: list[Path] | None = None,
                 max_seq_length: int | None = None, task: str = DEFAULT_TASK, kind: str = "sentence-transformers",
                 runtime: str = "sentence-transformers", details: dict[str, Any] | None = None,
                 margin: float | None = None) -> BundleSpec:
    """Write a complete bundle folder at `out_dir` (must not exist or be empty) and return its spec."""
    adapter_dir = Path(adapter_dir)
    check_adapter_dir(adapter_dir)
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise BundleError(f"bundle folder {out_dir} is not empty")
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copytree(adapter_dir, out_dir / ADAPTER_DIR,
                    ignore=shutil.ignore_patterns("checkpoint-*", "__pycache__", "*.tmp"))
    for report in report_paths or []:
        report = Path(report)
        if not report.is_file():
            raise BundleError(f"evaluation report {report} does not exist")
        (out_dir / REPORT_DIR).mkdir(exist_ok=True)
        shutil.copy2(report, out_dir / REPORT_DIR / report.name)
    if dataset_digest:
        (out_dir / DIGEST_FILE).write_text(dataset_digest + "\n")
    # Pooling and normalisation are facts of a sentence-transformers folder; other kinds bring `details`.
    described = describe_base(base_source) if kind == "sentence-transformers" else {}
    spec = BundleSpec(
        name=name,
        task=task,
        kind=kind,
        runtime=runtime,
        details=dict(details or {}),
        base=BaseRef(name=base_name or base_name_for(base_source), source=base_source, revision=base_revision),
        pooling=described.get("pooling"),
        normalize=described.get("normalize"),
        max_seq_length=max_seq_length or described.get("max_seq_length"),
        profile=profile or ServingProfile(),
        profile_source=profile_source,
        precision=judged_at(profile, profile_source),
        metrics={k: float(v) for k, v in (metrics or {}).items() if _is_number(v)},
        margin=margin,
        dataset_digest=dataset_digest,
    )
    spec.files = _listed_files(out_dir)
    write_spec(out_dir, spec)
    return spec


def judged_at(profile: ServingProfile | None, profile_source: str) -> str | None:
    """The precision a tuned profile was judged at (tune records only precisions its quality guard qualified);
    None for an untuned profile, whose precision, if any, no guard measured."""
    if profile_source != "tuned" or profile is None or profile.precision in (None, "auto"):
        return None
    return profile.precision


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def write_spec(bundle_dir: Path, spec: BundleSpec) -> None:
    text = "# lorafleet bundle: every file below is checked against its sha256 on download.\n"
    text += yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False)
    (Path(bundle_dir) / BUNDLE_FILE).write_text(text)


def read_spec(bundle_dir: Path) -> BundleSpec:
    path = Path(bundle_dir) / BUNDLE_FILE
    if not path.is_file():
        raise BundleIntegrityError(f"{bundle_dir} has no {BUNDLE_FILE}: incomplete bundle")
    try:
        raw = yaml.safe_load(path.read_text())
        return BundleSpec.model_validate(raw)
    except Exception as exc:  # yaml and pydantic errors alike mean the same thing here
        raise BundleIntegrityError(f"{path} is not a valid bundle spec: {exc}") from exc


def verify_bundle(bundle_dir: Path, expected_spec_sha256: str | None = None) -> BundleSpec:
    """Check every file against bundle.yaml; raise BundleIntegrityError naming each mismatch.

    `expected_spec_sha256` (kept as a model-version tag) also pins bundle.yaml itself, so an edited
    spec with matching edited hashes is caught too.
    """
    bundle_dir = Path(bundle_dir)
    if not bundle_dir.is_dir():
        raise BundleIntegrityError(f"bundle folder {bundle_dir} does not exist")
    if expected_spec_sha256 is not None and (bundle_dir / BUNDLE_FILE).is_file():
        got = sha256_file(bundle_dir / BUNDLE_FILE)
        if got != expected_spec_sha256:
            raise BundleIntegrityError(
                f"{bundle_dir / BUNDLE_FILE} was changed after registration (sha256 {got[:12]}…, "
                f"registered {expected_spec_sha256[:12]}…)"
            )
    spec = read_spec(bundle_dir)
    if not spec.files:
        raise BundleIntegrityError(f"{bundle_dir / BUNDLE_FILE} lists no files")
    actual = _listed_files(bundle_dir)
    problems = []
    for rel, digest in spec.files.items():
        if rel not in actual:
            problems.append(f"missing {rel}")
        elif actual[rel] != digest:
            problems.append(f"sha256 mismatch in {rel} (got {actual[rel][:12]}…, expected {digest[:12]}…)")
    problems += [f"unexpected file {rel}" for rel in actual if rel not in spec.files]
    if problems:
        raise BundleIntegrityError(f"bundle {spec.name} at {bundle_dir} failed its integrity check: "
                                   + "; ".join(problems))
    check_adapter_dir(bundle_dir / ADAPTER_DIR)
    return spec
