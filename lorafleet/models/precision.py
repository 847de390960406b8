"""Precision as a serving dimension: which number formats a device computes natively, and the quality guard
that `precision: auto` serves by.

A base is served at one precision (`BaseModelSpec.precision`): `fp32`, `bf16`, `fp16` (CUDA) or `int8`
(dynamic quantisation of the Linear layers, CPU). A runtime declares which of them it can run on a device
(`Runtime.precisions(device)`); an explicit precision it cannot run is a ConfigError when the fleet is loaded,
never a silent fallback. `auto` serves what was judged (issue 39): each served model's tuned verdict, fp32
(the precision of every gated number) without one, one precision for the base that all of them passed
(`served_precision`). A runtime that can probe (sentence-transformers) judges a model without a verdict itself:
each faster candidate against fp32 with the model's adapter loaded, on statute-length passages and short
queries (`PROBE_PASSAGES`, `PROBE_SENTENCES`), the first whose every vector keeps a cosine of at least
`GUARD_MIN_COSINE` to fp32's (`choose_auto`); the verdict is cached per (model, adapter, device) under
LORAFLEET_HOME so a later start skips the probe.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal, get_args

import numpy as np

from lorafleet.core.config import ConfigError

log = logging.getLogger(__name__)

Precision = Literal["fp32", "bf16", "fp16", "int8"]
PRECISIONS: Final[tuple[str, ...]] = get_args(Precision)
AUTO: Final = "auto"
FP32: Final = "fp32"
# A candidate passes when its worst probe vector keeps this cosine to fp32's (tune's quality checks use it too).
GUARD_MIN_COSINE: Final = 0.999
# Faster first: `auto` serves the first candidate that passes (on CPU int8's dynamic quantisation measured about
# as fast as bf16 where bf16 is native, and far slower elsewhere than native bf16; fp16 exists only on CUDA).
SPEED_ORDER: Final[tuple[str, ...]] = ("fp16", "bf16", "int8")
CACHE_FILE: Final = "precision.json"
# Pins what `auto` resolves to on this host, without the guard (explicit precisions are unaffected): for runs
# that compare served vectors with fp32 references more tightly than the guard does (the test suite sets fp32).
AUTO_ENV: Final = "LORAFLEET_AUTO_PRECISION"
# The probe: short and long, German (what the fleet serves) and English, statute-like and plain.
PROBE_SENTENCES: Final[tuple[str, ...]] = (
    "Der Käufer ist verpflichtet, dem Verkäufer den vereinbarten Kaufpreis zu zahlen und die gekaufte Sache "
    "abzunehmen.",
    "Wer vorsätzlich oder fahrlässig das Leben, den Körper, die Gesundheit, die Freiheit, das Eigentum oder ein "
    "sonstiges Recht eines anderen widerrechtlich verletzt, ist dem anderen zum Ersatz des daraus entstehenden "
    "Schadens verpflichtet.",
    "Die Kündigung bedarf der Schriftform.",
    "Mietvertrag",
    "Kann ich meine Wohnung fristlos kündigen, wenn die Heizung im Winter ausfällt?",
    "Das Grundgesetz schützt die Würde des Menschen.",
    "Der Arbeitgeber hat dem Arbeitnehmer ein schriftliches Zeugnis zu erteilen.",
    "The buyer must pay the agreed purchase price and take delivery of the goods.",
    "How long does the landlord have to return my security deposit?",
    "A contract concluded under duress may be contested within one year.",
    "Weather tomorrow: sunny, 24 degrees.",
    "Embeddings map sentences to vectors so that similar meanings lie close together.",
)


# The precision every gated number is computed at (research scores in float32): what a model with no tuned verdict
# was judged at, so what a base serves it at under `auto` unless a verdict with its adapter says otherwise.
GATED: Final = FP32


@dataclass(frozen=True, slots=True)
class ServedPrecision:
    """What a base serves at and why: the fleet file's explicit precision (the operator's override) or, under
    `auto`, what its served models were judged at."""

    precision: str
    reason: str
    override: bool = False  # the fleet file names a precision that differs from some served model's judged one


@dataclass(frozen=True, slots=True)
class JudgedModel:
    """A model served on a base, as `Runtime.use_judged` sees it: its tuned verdict (None: none recorded) and where
    its adapter is (a URI or folder, for a runtime that probes a model without a verdict)."""

    judged: str | None
    adapter: str | None = None
    adapter_id: str | None = None


def judged_precision(tuned: str | None) -> str:
    """The precision a model was judged at: its tune guard's verdict (a bundle's `precision`), else fp32, the
    precision of every gated number."""
    return tuned if tuned in PRECISIONS else GATED


def served_precision(declared: str, judged: Iterable[str | None], supported: Iterable[str]) -> ServedPrecision:
    """The precision a base serves at. One base holds one copy of its weights for every adapter on it, so under
    `auto` it serves the precision all its models were judged at (`judged`: each served model's tuned verdict,
    None where it has none and so was judged at fp32 only); fp32 where they differ, where none is known, or where
    the device cannot run the judged one. An explicit `declared` precision is served as is, and is an override
    where some model was judged at another."""
    verdicts = sorted({judged_precision(j) for j in judged})
    if declared != AUTO:
        others = [v for v in verdicts if v != declared]
        reason = f"the fleet file sets precision {declared}" + (
            f" (an override: judged at {', '.join(others)})" if others else "")
        return ServedPrecision(declared, reason, bool(others))
    if not verdicts:
        return ServedPrecision(GATED, f"auto: no served model judged yet, {GATED} (the gated precision)")
    if len(verdicts) > 1:
        return ServedPrecision(GATED, f"auto: its models were judged at {', '.join(verdicts)}; {GATED}, the "
                               "precision all of them were scored at")
    (only,) = verdicts
    if only not in set(supported) | {GATED}:
        return ServedPrecision(GATED, f"auto: judged at {only}, which this device cannot run; {GATED}")
    return ServedPrecision(only, f"auto: every served model was judged at {only}")


# What `auto` probes a served model without a tuned verdict on (issue 39): statute-length passages, as a legal
# fleet's corpus chunks are (a few hundred tokens, enumerations, cross-references), then the short probe sentences,
# which stand for queries. Twelve short sentences alone passed models that longer inputs tell apart.
PROBE_PASSAGES: Final[tuple[str, ...]] = (
    "(1) Durch den Kaufvertrag wird der Verkäufer einer Sache verpflichtet, dem Käufer die Sache zu übergeben und "
    "das Eigentum an der Sache zu verschaffen. Der Verkäufer hat dem Käufer die Sache frei von Sach- und "
    "Rechtsmängeln zu verschaffen. (2) Der Käufer ist verpflichtet, dem Verkäufer den vereinbarten Kaufpreis zu "
    "zahlen und die gekaufte Sache abzunehmen. (3) Die Vorschriften über den Kauf von Sachen finden auf den Kauf "
    "von Rechten und sonstigen Gegenständen entsprechende Anwendung.",
    "Der Mieter kann das Mietverhältnis aus wichtigem Grund außerordentlich fristlos kündigen. Ein wichtiger Grund "
    "liegt insbesondere vor, wenn dem Mieter der vertragsgemäße Gebrauch der Mietsache ganz oder zum Teil nicht "
    "rechtzeitig gewährt oder wieder entzogen wird, etwa weil die Heizung in den Wintermonaten über mehrere Wochen "
    "ausfällt. Die Kündigung ist erst zulässig, nachdem der Vermieter eine ihm gesetzte angemessene Frist zur "
    "Abhilfe hat verstreichen lassen; der Fristsetzung bedarf es nicht, wenn sie offensichtlich keinen Erfolg "
    "verspricht.",
    "(1) Ist die Leistung unmöglich, so ist der Schuldner von der Pflicht zur Leistung befreit. (2) Der Schuldner "
    "kann die Leistung verweigern, soweit diese einen Aufwand erfordert, der unter Beachtung des Inhalts des "
    "Schuldverhältnisses und der Gebote von Treu und Glauben in einem groben Missverhältnis zu dem "
    "Leistungsinteresse des Gläubigers steht. Bei der Bestimmung der dem Schuldner zuzumutenden Anstrengungen ist "
    "auch zu berücksichtigen, ob er das Leistungshindernis zu vertreten hat. (3) Die Rechte des Gläubigers "
    "bestimmen sich nach den §§ 280, 283 bis 285, 311a und 326.",
    "Wer in einem Arbeitsverhältnis steht, hat bei dessen Beendigung Anspruch auf ein schriftliches Zeugnis. Das "
    "Zeugnis muss mindestens Angaben zu Art und Dauer der Tätigkeit enthalten. Der Arbeitnehmer kann verlangen, "
    "dass sich die Angaben darüber hinaus auf Leistung und Verhalten im Arbeitsverhältnis erstrecken. Das Zeugnis "
    "muss klar und verständlich formuliert sein und darf keine Merkmale oder Formulierungen enthalten, die den "
    "Zweck haben, eine andere als aus der äußeren Form oder aus dem Wortlaut ersichtliche Aussage über den "
    "Arbeitnehmer zu treffen.",
    "(1) Eine Willenserklärung, die einem anderen gegenüber abzugeben ist, wird, wenn sie in dessen Abwesenheit "
    "abgegeben wird, in dem Zeitpunkt wirksam, in welchem sie ihm zugeht. Sie wird nicht wirksam, wenn dem anderen "
    "vorher oder gleichzeitig ein Widerruf zugeht. (2) Auf die Wirksamkeit der Willenserklärung ist es ohne "
    "Einfluss, wenn der Erklärende nach der Abgabe stirbt oder geschäftsunfähig wird.",
    "Der Vermieter hat die Mietsicherheit getrennt von seinem Vermögen bei einem Kreditinstitut zu dem für "
    "Spareinlagen mit dreimonatiger Kündigungsfrist üblichen Zinssatz anzulegen. Die Vertragsparteien können eine "
    "andere Anlageform vereinbaren. In beiden Fällen muss die Anlage vom Vermögen des Vermieters getrennt erfolgen, "
    "und die Erträge stehen dem Mieter zu; sie erhöhen die Sicherheit. Nach Beendigung des Mietverhältnisses und "
    "Ablauf einer angemessenen Prüfungsfrist ist die Kaution nebst Zinsen zurückzuzahlen.",
    "(1) Die Würde des Menschen ist unantastbar. Sie zu achten und zu schützen ist Verpflichtung aller staatlichen "
    "Gewalt. (2) Das Deutsche Volk bekennt sich darum zu unverletzlichen und unveräußerlichen Menschenrechten als "
    "Grundlage jeder menschlichen Gemeinschaft, des Friedens und der Gerechtigkeit in der Welt. (3) Die nachfolgenden "
    "Grundrechte binden Gesetzgebung, vollziehende Gewalt und Rechtsprechung als unmittelbar geltendes Recht.",
    "Ist für die Leistung eine Zeit nach dem Kalender bestimmt, so kommt der Schuldner ohne Mahnung in Verzug, wenn "
    "er nicht zur bestimmten Zeit leistet. Der Schuldner einer Entgeltforderung kommt spätestens in Verzug, wenn er "
    "nicht innerhalb von 30 Tagen nach Fälligkeit und Zugang einer Rechnung oder gleichwertigen Zahlungsaufstellung "
    "leistet; dies gilt gegenüber einem Schuldner, der Verbraucher ist, nur, wenn auf diese Folgen in der Rechnung "
    "besonders hingewiesen worden ist. Während des Verzugs ist eine Geldschuld mit fünf Prozentpunkten über dem "
    "Basiszinssatz zu verzinsen.",
)


def native_cpu_precisions(cpuinfo: str) -> frozenset[str]:
    """Reduced precisions the CPU described by `/proc/cpuinfo` text computes natively: bf16 on x86 with
    AVX512_BF16 or AMX_BF16 (`flags`), on ARM with BF16 (`Features`). fp32 is not listed (always there)."""
    found: set[str] = set()
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if not sep or key.strip().lower() not in ("flags", "features"):
            continue
        flags = set(value.lower().split())
        if flags & {"avx512_bf16", "amx_bf16", "bf16"}:
            found.add("bf16")
    return frozenset(found)


def read_cpuinfo() -> str:
    """`/proc/cpuinfo`, or "" where there is none (macOS, Windows: then no reduced precision counts as native)."""
    try:
        return Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return ""


def int8_available() -> bool:
    """Whether torch has a quantised engine for dynamic int8 Linear layers on this CPU."""
    import torch

    return bool(set(torch.backends.quantized.supported_engines) & {"x86", "fbgemm", "onednn", "qnnpack"})


def supported_precisions(device: str, cpuinfo: str | None = None) -> frozenset[str]:
    """What a device computes well: CPU fp32, bf16 where native, int8 (dynamic) where torch can;
    CUDA fp32, fp16, and bf16 where the GPU supports it. `cpuinfo` defaults to this host's."""
    if device.startswith("cuda"):
        import torch

        bf16 = {"bf16"} if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else set()
        return frozenset({FP32, "fp16", *bf16})
    native = native_cpu_precisions(read_cpuinfo() if cpuinfo is None else cpuinfo)
    return frozenset({FP32, *native, *(("int8",) if int8_available() else ())})


def candidates(supported: Iterable[str]) -> list[str]:
    """What `auto` tries, fastest first (fp32, the reference, is the fallback, not a candidate)."""
    have = set(supported)
    return [p for p in SPEED_ORDER if p in have]


def check_precision(base: str, runtime: str, precision: str, supported: Iterable[str], device: str) -> None:
    """ConfigError when `precision` is explicit and not among what the runtime runs on `device`."""
    have = sorted(supported)
    if precision != AUTO and precision not in have:
        raise ConfigError(f"bases.{base}.precision is {precision!r}, but runtime {runtime!r} on {device} supports "
                          f"{', '.join(have)} (or 'auto', the fastest of those that keeps fp32's quality)")


def pinned_auto(supported: Iterable[str]) -> str | None:
    """The precision LORAFLEET_AUTO_PRECISION pins `auto` to (None: unset); ConfigError when it is not supported."""
    raw = os.environ.get(AUTO_ENV, "").strip()
    if not raw or raw == AUTO:
        return None
    have = sorted(supported)
    if raw not in have:
        raise ConfigError(f"{AUTO_ENV}={raw!r}: not among the precisions supported here ({', '.join(have)})")
    return raw


def check_fleet_precisions(fleet: Any, device: str | None = None) -> None:
    """ConfigError for any base whose explicit precision its runtime cannot run on the worker device (`device`,
    default the fleet's `worker.device` resolved on this host). Only loads torch when some base names one."""
    explicit = [b for b in fleet.bases if b.precision != AUTO]
    if not explicit:
        return
    from lorafleet.core import plugins
    from lorafleet.models.device import resolve_device

    device = device or resolve_device(fleet.worker.device)
    for base in explicit:
        declared = getattr(plugins.load(plugins.RUNTIMES, base.runtime), "precisions", None)
        supported = declared(device) if declared is not None else frozenset({FP32})
        check_precision(base.name, base.runtime, base.precision, supported, device)
        if base.precision == "int8" and any(m.base == base.name for m in fleet.models):
            served = sorted(m.name for m in fleet.models if m.base == base.name)
            raise ConfigError(f"bases.{base.name}.precision is 'int8', but the fleet serves adapters on it "
                              f"({', '.join(served)}): dynamic int8 quantisation replaces the Linear layers LoRA "
                              "attaches to; use fp32 or bf16 (or 'auto')")


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    """The smallest row-wise cosine between two (n, dim) arrays."""
    a64, b64 = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    num = (a64 * b64).sum(axis=1)
    den = np.linalg.norm(a64, axis=1) * np.linalg.norm(b64, axis=1)
    return float(np.min(num / np.maximum(den, 1e-12)))


@dataclass(frozen=True, slots=True)
class Verdict:
    """What `auto` chose and why: the precision served and each candidate's min cosine to fp32."""

    precision: str
    cosines: dict[str, float]
    cached: bool = False

    def reason(self) -> str:
        tried = ", ".join(f"{p} min cosine {c:.5f} {'≥' if c >= GUARD_MIN_COSINE else '<'} {GUARD_MIN_COSINE}"
                          for p, c in self.cosines.items()) or "no faster precision on this device"
        return f"{tried}{' (cached)' if self.cached else ''}"


def cache_path() -> Path:
    from lorafleet.core import settings

    return settings.home() / CACHE_FILE


def cache_key(runtime: str, source: str, revision: str | None, device: str, supported: Iterable[str]) -> str:
    """One entry per model (source and revision), runtime and device; the supported set is part of it so a home
    shared by different CPUs does not reuse a verdict where a candidate is missing."""
    return f"{runtime}|{source}@{revision or '-'}|{device}|{'+'.join(sorted(supported))}"


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(path: Path, key: str, verdict: Verdict) -> None:
    # Read-modify-write under an exclusive lock (workers of one host start together, each adding its own key), and
    # through a temporary file and a rename, so a reader never sees half a file.
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            data = _read_cache(path)
            data[key] = {"precision": verdict.precision, "cosines": verdict.cosines}
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".precision-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=2, sort_keys=True)
            os.replace(tmp, path)
    except OSError as exc:  # a read-only home: the next start probes again
        log.warning("could not cache the precision verdict in %s: %s", path, exc)


def choose_auto(key: str, tries: list[str], embed_at: Callable[[str], np.ndarray],
                path: Path | None = None) -> Verdict:
    """The precision `auto` serves: the cached verdict for `key`, else the first of `tries` (fastest first)
    whose probe vectors (`embed_at(precision)`: the served model's vectors of the probe texts) keep
    GUARD_MIN_COSINE to fp32's; fp32 when none does. The verdict is cached in `path` (default
    LORAFLEET_HOME/precision.json)."""
    path = path or cache_path()
    hit = _read_cache(path).get(key)
    if isinstance(hit, dict) and hit.get("precision") in (FP32, *tries):
        return Verdict(str(hit["precision"]), {str(k): float(v) for k, v in (hit.get("cosines") or {}).items()},
                       cached=True)
    cosines: dict[str, float] = {}
    chosen = FP32
    if tries:
        reference = embed_at(FP32)
        for p in tries:
            cosines[p] = round(min_cosine(embed_at(p), reference), 6)
            if cosines[p] >= GUARD_MIN_COSINE:
                chosen = p
                break
    verdict = Verdict(chosen, cosines)
    _write_cache(path, key, verdict)
    return verdict
