"""The quality gate of a promotion: the margin it uses, the task kind's verdict, and the refusal.

The gate is the task kind's (`lorafleet.core.tasks.judge`, the same one research's verdict uses): the
version's headline metric (test nDCG@10 for retrieval) must beat, strictly, what its kind compares with
(the base model's, or the kind's best baseline and rivals) by a relative margin, and must not fall
behind the current champion's. The margin is the one research judged the version by (recorded in its
bundle), unless `--margin` or LORAFLEET_PROMOTE_MARGIN gives another. Every refused promotion, canary or
shadow raises PromotionError (defined here: the gate is the first thing each of them checks).
"""

from __future__ import annotations

import dataclasses
import os

from lorafleet.core.tasks import DEFAULT_MARGIN, GateResult, get_task_kind
from lorafleet.registry import store
from lorafleet.registry.bundle import MARGIN_TAG
from lorafleet.registry.store import CANDIDATE, CHAMPION, VersionInfo

MARGIN_ENV = "LORAFLEET_PROMOTE_MARGIN"


class PromotionError(RuntimeError):
    """Promotion or rollback refused; nothing was changed. The message says why and what to do."""


def default_margin() -> float | None:
    """The operator's margin from LORAFLEET_PROMOTE_MARGIN (0.02 = 2 %); None when it is not set, and the gate then
    uses the margin the version records (`gate_margin`)."""
    raw = os.environ.get(MARGIN_ENV)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError as exc:
        raise PromotionError(f"{MARGIN_ENV}={raw!r} is not a number") from exc
    if not value >= 0:
        raise PromotionError(f"{MARGIN_ENV}={raw!r} must be a relative margin ≥ 0 (0.02 = 2 %)")
    return value


def gate_margin(candidate: VersionInfo, margin: float | None) -> tuple[float, str]:
    """The margin the gate uses and where it came from: the one given (`--margin`, LORAFLEET_PROMOTE_MARGIN), else
    the one research judged the version by (recorded in its bundle and tag), else DEFAULT_MARGIN (research's
    default, for versions registered without one)."""
    if margin is not None:
        return margin, "given"
    raw = candidate.tags.get(MARGIN_TAG)
    if raw is not None:
        try:
            return float(raw), "recorded by research"
        except ValueError:
            pass
    return DEFAULT_MARGIN, "default"


def check_gate(candidate: VersionInfo, champion: VersionInfo | None, margin: float | None = None) -> GateResult:
    """Pure apart from the plugin lookup: the candidate's task kind judges it against base and champion.

    `margin` None: the one research recorded for the version (gate_margin). Beating means strictly better by the
    margin (a tie is no win). Test numbers measured on different datasets say nothing about each other: when both
    versions record their dataset digest and the digests differ, the comparison with the champion is refused (the
    gate fails; the base comparison, made on the candidate's own test set, still counts). A version without a
    digest (older registries) is compared as before."""
    margin, source = gate_margin(candidate, margin)
    return dataclasses.replace(_judge(candidate, champion, margin), margin_source=source)


def _judge(candidate: VersionInfo, champion: VersionInfo | None, margin: float) -> GateResult:
    kind = get_task_kind(candidate.task)
    mine = candidate.dataset_digest
    theirs = champion.dataset_digest if champion is not None else None
    if champion is not None and champion.version != candidate.version and mine and theirs and mine != theirs:
        alone = kind.gate(candidate.metrics(), None, margin, candidate_label=f"version {candidate.version}")
        why = (f"v{candidate.version} was scored on dataset {mine[:12]}, the champion v{champion.version} on dataset "
               f"{theirs[:12]}: their {alone.metric} numbers are not comparable. Re-evaluate the champion on "
               f"v{candidate.version}'s dataset (train it again on that data) or promote with --force")
        return dataclasses.replace(alone, ok=False, reasons=[*alone.reasons, why])
    return kind.gate(candidate.metrics(), champion.metrics() if champion is not None else None, margin,
                     candidate_label=f"version {candidate.version}",
                     champion_label=f"the champion v{champion.version}" if champion is not None else "the champion")


def gate_or_refuse(info: VersionInfo, champion: str | None, margin: float | None, force: bool) -> GateResult:
    gate = check_gate(info, store.get_version(info.name, champion) if champion is not None else None, margin)
    if not gate.ok and not force:
        raise PromotionError(f"{info.name} v{info.version} fails the quality gate: " + "; ".join(gate.reasons)
                             + " (use --force to promote anyway)")
    return gate


def gated_candidate(name: str, version: str | int | None, margin: float | None, force: bool
                    ) -> tuple[VersionInfo, float | None]:
    """The version to promote (default: the `candidate` alias, else the newest) once it passed the gate against
    today's champion, and the margin that gate used (None: the one research recorded, see `gate_margin`)."""
    margin = default_margin() if margin is None else margin
    if version is None:
        version = store.alias_version(name, CANDIDATE)
    info = store.get_version(name, version)
    gate_or_refuse(info, store.alias_version(name, CHAMPION), margin, force)
    return info, margin


__all__ = ["MARGIN_ENV", "PromotionError", "check_gate", "default_margin", "gate_margin", "gate_or_refuse",
           "gated_candidate"]
