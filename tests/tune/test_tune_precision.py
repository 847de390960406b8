"""Precision as a sweep axis: the quality guard judges each precision once (nDCG@10 loss on the dev set, min cosine to
fp32), disqualified precisions stay in the report with their reason, the recommendation is the fastest qualifying
precision, and the profile records it."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import yaml

from lorafleet.core.config import ServingProfile
from lorafleet.core.metrics import ndcg_at_k
from lorafleet.tune import precision as tp
from lorafleet.tune import sweep
from lorafleet.tune.analysis import ProfileResult
from lorafleet.tune.config import TuneConfig
from lorafleet.tune.kinds.retrieval import kind as retrieval
from lorafleet.tune.source import TuneSource

WORDS = ["kauf", "miete", "arbeit", "erbe", "ehe", "steuer", "straf", "bau", "haft", "zins", "pacht", "lohn"]


def _dev(n: int = 12) -> tp.DevSet:
    """Query i is about topic i; document i is its one relevant document."""
    queries = {f"q{i}": f"frage zu {WORDS[i]}" for i in range(n)}
    corpus = {f"d{i}": f"das recht der {WORDS[i]} regelt {WORDS[i]}" for i in range(n)}
    return tp.DevSet(queries, corpus, {f"q{i}": {f"d{i}": 1.0} for i in range(n)})


def _fake_encoders(dev: tp.DevSet, noise: dict[str, float], broken: set[str] = frozenset()) -> tp.EncoderFactory:
    """fp32: one-hot topic vectors (a perfect ranking); another precision adds Gaussian noise of its scale; a
    precision in `broken` cannot run (as int8 with an adapter)."""
    rng = np.random.default_rng(0)
    texts = [*dev.queries.values(), *dev.corpus.values()]
    exact = np.array([[1.0 if w in t else 0.0 for w in WORDS] for t in texts]) + 0.01

    def at(precision: str) -> tp.Encode:
        if precision in broken:
            raise RuntimeError(f"{precision} takes no adapters")
        scale = noise.get(precision, 0.0)
        return lambda batch: exact + rng.normal(0.0, scale, exact.shape)

    return at


def test_ndcg_at_k() -> None:
    qrels = {"a": {"x": 1.0}, "b": {"y": 2.0, "z": 1.0}, "c": {}}
    assert ndcg_at_k({"a": ["x"], "b": ["y", "z"]}, qrels) == 1.0  # "c" has nothing relevant: skipped
    assert ndcg_at_k({"a": ["w", "x"], "b": []}, qrels) == pytest.approx((1 / math.log2(3)) / 2)


def test_judge_budget() -> None:
    ok = tp.judge("bf16", ref_ndcg=0.80, ndcg=0.797, min_cos=0.9995, mean_cos=0.9999, max_loss=0.005,
                  min_cosine=0.999)
    assert ok.qualified and ok.loss == pytest.approx(0.00375) and "≤" in ok.reason
    lossy = tp.judge("bf16", ref_ndcg=0.80, ndcg=0.79, min_cos=0.9995, mean_cos=0.9999, max_loss=0.005,
                     min_cosine=0.999)
    assert not lossy.qualified and "nDCG@10 loss 1.25% > 0.50%" in lossy.reason
    # A gain in nDCG does not excuse vectors that moved: the cosine check is independent.
    moved = tp.judge("int8", ref_ndcg=0.80, ndcg=0.81, min_cos=0.95, mean_cos=0.99, max_loss=0.005, min_cosine=0.999)
    assert not moved.qualified and moved.reason == "min cosine 0.95000 < 0.999"
    no_dev = tp.judge("bf16", ref_ndcg=None, ndcg=None, min_cos=0.9999, mean_cos=1.0, max_loss=0.005,
                      min_cosine=0.999)
    assert no_dev.qualified and no_dev.loss is None and no_dev.reason.startswith("no dev set")


def test_candidates_auto_and_unsupported() -> None:
    measure, rejected = tp.candidate_precisions("auto", {"fp32", "bf16", "int8"})
    assert measure == ["fp32", "bf16", "int8"] and rejected == []
    measure, rejected = tp.candidate_precisions(["fp16", "int8"], {"fp32", "int8"})
    assert measure == ["fp32", "int8"]
    assert [(q.precision, q.qualified) for q in rejected] == [("fp16", False)]
    assert "not supported" in rejected[0].reason


def test_guard_rejects_a_noisy_precision_and_keeps_a_faithful_one() -> None:
    dev = _dev()
    verdicts = tp.guard(["fp32", "bf16", "int8", "fp16"],
                        _fake_encoders(dev, {"bf16": 1e-4, "int8": 0.3}, broken={"fp16"}), dev,
                        max_loss=0.005, min_cosine=0.999)
    by = {v.precision: v for v in verdicts}
    assert list(by) == ["fp32", "bf16", "int8", "fp16"]
    assert by["fp32"].qualified and by["fp32"].ndcg == pytest.approx(1.0)
    assert by["bf16"].qualified and by["bf16"].min_cosine is not None and by["bf16"].min_cosine > 0.999
    assert not by["int8"].qualified and "min cosine" in by["int8"].reason
    assert by["int8"].mean_cosine is not None and by["int8"].mean_cosine < 0.999
    assert not by["fp16"].qualified and "takes no adapters" in by["fp16"].reason


class _FakeSweeper:
    """The cluster replaced by a throughput model: larger batches and lower precisions are faster."""

    speed: ClassVar[dict[str, float]] = {"fp32": 1.0, "bf16": 1.6, "int8": 2.0}

    def __init__(self, source: TuneSource, cfg: TuneConfig, work_dir: Path, say: object) -> None:
        self.baseline_rps, self.open_rates = 10.0, [5.0]

    def start(self, profile: ServingProfile) -> None: ...

    def apply(self, profile: ServingProfile) -> float:
        return 0.0

    def stop(self) -> None: ...

    def measure(self, profile: ServingProfile, phase: str, restart_s: float) -> ProfileResult:
        rps = (10.0 + profile.max_batch_items) * self.speed[profile.precision or "fp32"]
        return ProfileResult(profile=profile, phase=phase, throughput_rps=rps, p50_ms=5.0, p99_ms=10.0,
                             peak_rss_mb=100.0, points=[{"level": 5.0}])


def test_sweep_recommends_the_fastest_qualifying_precision_and_reports_all(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lorafleet.registry.bundle import build_bundle, read_spec
    from lorafleet.testing import make_random_adapter

    dev = _dev()
    # int8 would be the fastest, but its vectors are noisy: it must be neither measured nor recommended.
    encoders = _fake_encoders(dev, {"bf16": 1e-4, "int8": 0.3})

    def fake_guard(source: TuneSource, cfg: TuneConfig, say: object) -> list[tp.PrecisionQuality]:
        measure, rejected = tp.candidate_precisions(cfg.precisions, {"fp32", "bf16", "int8"})
        return [*tp.guard(measure, encoders, dev, max_loss=cfg.precision_max_loss,
                          min_cosine=cfg.precision_min_cosine), *rejected]

    monkeypatch.setattr(retrieval, "Sweeper", _FakeSweeper)
    monkeypatch.setattr(retrieval, "run_guard", fake_guard)
    cfg = TuneConfig(items_grid=[1, 8], wait_grid=[], inflight_grid=[], tokens_per_item_grid=[], warmup_s=0,
                     precisions=["fp32", "bf16", "int8", "fp16"], precision_profiles=2)
    adapter = make_random_adapter(tiny_model_dir, tmp_path / "adapter", seed=3)
    source = TuneSource(adapter, str(tiny_model_dir), "tiny", None, "x", dev=dev)
    out = tmp_path / "out"
    result = sweep.run_tune(source, cfg, out, say=lambda _: None)

    measured = [(r.profile.precision, r.profile.max_batch_items) for r in result.results]
    assert measured[:3] == [("fp32", 32), ("fp32", 1), ("fp32", 8)]
    assert sorted(measured[3:]) == [("bf16", 8), ("bf16", 32)]  # the two best fp32 profiles, at bf16
    assert result.profile.precision == "bf16" and result.profile.max_batch_items == 32

    profile = ServingProfile.model_validate(yaml.safe_load((out / "profile.yaml").read_text()))
    assert profile.precision == "bf16"
    assert "precision bf16: nDCG@10 loss" in (out / "profile.yaml").read_text()
    with open(out / "precisions.csv") as fh:
        table = {row["precision"]: row for row in csv.DictReader(fh)}
    assert list(table) == ["fp32", "bf16", "int8", "fp16"]
    assert table["int8"]["qualified"] == "False" and "min cosine" in table["int8"]["quality_reason"]
    assert table["int8"]["best_throughput_rps"] == ""  # disqualified: never measured
    assert table["fp16"]["qualified"] == "False" and "not supported" in table["fp16"]["quality_reason"]
    assert table["bf16"]["qualified"] == "True" and float(table["bf16"]["min_cosine"]) >= 0.999
    with open(out / "results.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert {r["precision"] for r in rows} == {"fp32", "bf16"}
    assert all(r["dev_ndcg@10"] and r["min_cosine"] and r["quality_reason"] for r in rows)
    data = json.loads((out / "results.json").read_text())
    assert data["recommended"]["precision"] == "bf16"
    assert data["recommended"]["quality"]["quality_loss"] is not None
    assert [p["precision"] for p in data["precisions"]] == ["fp32", "bf16", "int8", "fp16"]
    assert result.files["precisions"] == out / "precisions.csv"
    # What ship registers: the tuned profile (its precision) and the sweep's files as the bundle's report.
    spec = build_bundle(tmp_path / "bundle", name="x", adapter_dir=adapter, base_source=str(tiny_model_dir),
                        profile=result.profile, profile_source="tuned",
                        report_paths=[p for p in result.files.values() if p.is_file()])
    assert spec.profile.precision == "bf16" and read_spec(tmp_path / "bundle").profile.precision == "bf16"
    recorded = list(csv.DictReader((tmp_path / "bundle" / "report" / "precisions.csv").open()))
    assert [(r["precision"], r["qualified"]) for r in recorded][:2] == [("fp32", "True"), ("bf16", "True")]


@pytest.mark.integration
def test_guard_through_the_real_runtime(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The guard on the sentence-transformers runtime, tiny BERT and a LoRA adapter: fp32 is the reference, int8 is
    disqualified because its quantised Linear layers take no adapter, an unsupported precision is named as such."""
    from lorafleet.models.precision import supported_precisions
    from lorafleet.testing import make_random_adapter

    adapter = make_random_adapter(tiny_model_dir, tmp_path / "lora", seed=7)
    dev = _dev()
    source = TuneSource(adapter, str(tiny_model_dir), "tiny", None, "tiny-lora", dev=dev)
    lines: list[str] = []
    verdicts = {q.precision: q for q in tp.run_guard(source, TuneConfig(device="cpu"), lines.append)}
    supported = supported_precisions("cpu")
    assert set(verdicts) == set(supported)
    assert verdicts["fp32"].qualified and verdicts["fp32"].ndcg is not None
    if "int8" in supported:
        assert not verdicts["int8"].qualified and "no LoRA adapters" in verdicts["int8"].reason
    if "bf16" in supported:  # measured against fp32 (whether the tiny random model passes is its own business)
        assert verdicts["bf16"].min_cosine is not None and verdicts["bf16"].ndcg is not None
    assert any("precision guard on cpu" in ln for ln in lines)
    explicit = tp.run_guard(source, TuneConfig(device="cpu", precisions=["fp16"]), lines.append)
    assert [(q.precision, q.qualified) for q in explicit] == [("fp32", True), ("fp16", False)]
