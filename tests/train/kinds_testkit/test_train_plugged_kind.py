"""A fourth kind plugs in through its folder and an entry point alone: `lorafleet train` runs it in the one loop, and
tune's one sweep driver runs its tune strategy (`toykind/tune.py`).

The kind (`toykind/`, next to this file) uses only the public plugin interface; it is registered the way an
installed package registers one: a `*.dist-info/entry_points.txt` on sys.path, written here into a temp folder.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

KIT = Path(__file__).parent


@pytest.fixture
def toy_kind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    from lorafleet.core import plugins

    dist = tmp_path / "site" / "lorafleet_toykind-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: lorafleet-toykind\nVersion: 0.1\n")
    # The toy package registers its train kind and its tune strategy, as an installed kind would.
    (dist / "entry_points.txt").write_text("[lorafleet.tasks]\ntoy-pairs = toykind:ToyKind\n\n"
                                           "[lorafleet.tune_kinds]\ntoy-pairs = toykind.tune:ToyTune\n")
    monkeypatch.syspath_prepend(str(KIT))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    plugins._entries.cache_clear()
    module = importlib.import_module("toykind")
    module.LOOKED.clear()
    yield module
    plugins._entries.cache_clear()


def test_a_new_kind_trains_in_the_one_loop_through_its_entry_point_alone(toy_kind: object, tmp_path: Path) -> None:
    from lorafleet.cli import app
    from lorafleet.core.tasks import get_task_kind, task_kind_names
    from lorafleet.testing import build_tiny_model

    assert "toy-pairs" in task_kind_names()
    assert type(get_task_kind("toy-pairs")).__module__ == "toykind"
    words = toy_kind.WORDS  # type: ignore[attr-defined]
    model = build_tiny_model(tmp_path / "tiny", corpus=[" ".join(words)] * 4, vocab_size=120)
    config = tmp_path / "toy.yaml"
    config.write_text(f"task: toy-pairs\ntrain:\n  base_model: {model}\n  epochs: 2\n")

    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", str(config), "--no-mlflow", "--out", str(out)])

    assert result.exit_code == 0, result.output
    saved = json.loads((out / "metrics.json").read_text())
    assert [e["epoch"] for e in saved["epochs"]] == [1.0, 2.0]  # trained two epochs
    assert all("dev_top1" in e and e["train_loss"] == e["train_loss"] for e in saved["epochs"])  # dev scored each
    assert toy_kind.LOOKED == [("dev", 1), ("dev", 2), ("test", 0)]  # type: ignore[attr-defined]  # test once
    m = saved["metrics"]
    assert {"dev_top1", "test_top1", "base_dev_top1", "base_test_top1", "train_loss", "trainable_params"} <= set(m)
    assert (out / "adapter" / "adapter_config.json").is_file() and (out / "report.md").is_file()


def test_research_drives_the_new_kind_and_looks_at_test_once(toy_kind: object, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import yaml

    from lorafleet.research.config import load_config
    from lorafleet.research.runner import run_research
    from lorafleet.testing import build_tiny_model

    # Trials may run in processes of their own: they find the kind through the same path.
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path / 'site'}:{KIT}")
    words = toy_kind.WORDS  # type: ignore[attr-defined]
    model = build_tiny_model(tmp_path / "tiny", corpus=[" ".join(words)] * 4, vocab_size=120)
    cfg = {"task": "toy-pairs", "train": {"base_model": str(model), "epochs": 2},
           "research": {"study": "toy", "n_trials": 2, "budget_minutes": 5, "trial_timeout_minutes": 2,
                        "sampler": {"kind": "random", "seed": 1}, "pruner": {"kind": "none"}, "reseed": False,
                        "min_margin": 0.0, "heartbeat_s": 1, "grace_s": 30,
                        "space": {"learning_rate": {"type": "float", "low": 1e-3, "high": 1e-2, "log": True}}}}
    path = tmp_path / "research.yaml"
    path.write_text(yaml.safe_dump(cfg))

    result = run_research(load_config(path), progress_live=False)

    assert result.finalized and result.task == "toy-pairs" and result.trials.get("complete") == 2
    assert {"base_dev_top1", "base_test_top1"} <= set(result.baseline)
    assert "test_top1" in result.winner_metrics
    looks = [(split, epoch) for split, epoch in toy_kind.LOOKED if split == "test"]  # type: ignore[attr-defined]
    assert looks == [("test", -1)]  # trials see dev only; research scores its winner on test once


def test_a_new_kind_tunes_in_the_one_driver_through_its_entry_point_alone(toy_kind: object, tmp_path: Path) -> None:
    import yaml

    from lorafleet.tune.config import TuneConfig
    from lorafleet.tune.kind import kind_for, tune_kind_names
    from lorafleet.tune.source import TuneSource
    from lorafleet.tune.sweep import run_tune

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"task_type": "TOY_PAIRS"}))
    source = TuneSource(adapter, "/models/toy", "toy", None, "toy")
    assert "toy-pairs" in tune_kind_names() and type(kind_for(source)).__module__ == "toykind.tune"

    lines: list[str] = []
    out = tmp_path / "out"
    toy_tune = importlib.import_module("toykind.tune")
    toy_tune.STARTS.clear()
    result = run_tune(source, TuneConfig(), out, say=lines.append)

    assert toy_tune.STARTS == [{"batch": 1}]  # type: ignore[attr-defined]  # started once, at the baseline
    assert [(r.phase, r.candidate["batch"]) for r in result["results"]] == \
        [("baseline", 1), ("batch", 2), ("batch", 4), ("batch", 8), ("batch", 16)]  # 4 measured once
    assert result["best"] == {"batch": 8} and yaml.safe_load((out / "profile.yaml").read_text()) == {"batch": 8}
    assert [q.precision for q in result["quality"]] == ["fp32"]  # the default guard: fp32, nothing judged
    assert lines[0] == "tune (toy pairs): toy" and sum(ln.startswith("  profile ") for ln in lines) == 5
    assert not (out / ".work").exists()
