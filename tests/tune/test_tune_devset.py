"""The pipeline hands the winner's dev set to tune's precision guard (issue 27): rebuilt from the research config
through the task kind, capped, and for `lorafleet tune BUNDLE` only when the bundle records how to rebuild it."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from lorafleet import pipeline
from lorafleet.research.result import ResearchResult
from lorafleet.tune.precision import DevSet

WORDS = ["Kündigung", "Arbeitnehmer", "Frist", "Haftung", "Produkt", "Schaden", "Betrieb", "Rat", "Lohn", "Urlaub"]


def _config(tiny_model_dir: Path, root: Path, n: int = 60) -> dict:
    """A tiny retrieval `train:` section over a pairs file of `n` synthetic question/answer rows."""
    root.mkdir(parents=True, exist_ok=True)
    with (root / "pairs.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["question", "answer"])
        for i in range(n):
            a, b = WORDS[i % len(WORDS)], WORDS[(i * 3 + 1) % len(WORDS)]
            w.writerow([f"Was gilt für {a} und {b} Nr. {i}?", f"§ {i}: {a} {b} richtet sich nach Absatz {i}."])
    from lorafleet.train import TrainConfig

    cfg = TrainConfig(base_model=str(tiny_model_dir), max_seq_length=64, device="cpu", data={
        "layout": "pairs", "pairs": str(root / "pairs.csv"), "columns": {"query": "question", "positive": "answer"},
        "hard_negatives": False, "dev_fraction": 0.3, "test_fraction": 0.2})
    return cfg.model_dump(mode="json")


def _result(config: dict, adapter: Path) -> ResearchResult:
    return ResearchResult(study="legal", storage="", experiment="e", parent_run_id="p", objective="dev_ndcg@10",
                          task="retrieval", winner_config=config, winner_adapter_dir=str(adapter))


@pytest.fixture(scope="module")
def adapter(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lorafleet.testing import make_random_adapter

    return make_random_adapter(tiny_model_dir, tmp_path_factory.mktemp("a") / "lora", seed=3)


def _consistent(dev: DevSet) -> None:
    assert dev.queries and dev.corpus
    assert set(dev.qrels) == set(dev.queries)
    for rel in dev.qrels.values():
        assert rel and set(rel) <= set(dev.corpus)  # every relevant document is in the corpus it is ranked in


def test_ship_tunes_with_the_winners_dev_set(tiny_model_dir: Path, adapter: Path, tmp_path: Path) -> None:
    config = _config(tiny_model_dir, tmp_path / "data")
    source = pipeline.winner_tune_source(_result(config, adapter))
    assert isinstance(source.dev, DevSet), "the pipeline handed tune no dev set"
    _consistent(source.dev)
    assert source.adapter_dir == adapter and source.base_source == str(tiny_model_dir) and source.label == "legal"
    # the dev split only: the same queries the kind's dataset holds as dev
    from lorafleet.core.tasks import get_task_kind

    kind = get_task_kind("retrieval")
    dataset = kind.build_dataset(kind.parse_config(config))
    assert set(source.dev.queries) == set(dataset.queries["dev"])


def test_the_dev_set_is_capped(tiny_model_dir: Path, tmp_path: Path) -> None:
    from lorafleet.core.tasks import get_task_kind

    kind = get_task_kind("retrieval")
    dataset = kind.build_dataset(kind.parse_config(_config(tiny_model_dir, tmp_path / "data", n=120)))
    dev = pipeline._retrieval_dev(dataset, max_queries=5, max_documents=12)
    assert dev is not None
    _consistent(dev)
    assert len(dev.queries) == 5 and len(dev.corpus) == 12  # the 5 queries' documents plus a sample of others
    assert dev == pipeline._retrieval_dev(dataset, max_queries=5, max_documents=12)  # seeded: the same every time


def test_tune_of_a_bundle_rebuilds_its_dev_set_only_when_it_can(tiny_model_dir: Path, adapter: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    from lorafleet.core.tasks import get_task_kind
    from lorafleet.registry.bundle import build_bundle

    config = _config(tiny_model_dir, tmp_path / "data")
    kind = get_task_kind("retrieval")
    digest = kind.build_dataset(kind.parse_config(config)).digest
    common = dict(name="legal", adapter_dir=adapter, base_source=str(tiny_model_dir))
    build_bundle(tmp_path / "b1", **common, dataset_digest=digest, details={pipeline.TRAIN_CONFIG: config})
    dev = pipeline.resolve_tune_source(str(tmp_path / "b1")).dev
    assert isinstance(dev, DevSet)
    _consistent(dev)

    build_bundle(tmp_path / "b2", **common, dataset_digest=digest)  # an older bundle: no training config recorded
    assert pipeline.resolve_tune_source(str(tmp_path / "b2")).dev is None
    assert "records no training config" in capsys.readouterr().err

    build_bundle(tmp_path / "b3", **common, dataset_digest="0" * 16, details={pipeline.TRAIN_CONFIG: config})
    assert pipeline.resolve_tune_source(str(tmp_path / "b3")).dev is None  # the data changed since training
    assert "the data changed since training" in capsys.readouterr().err
