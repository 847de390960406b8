"""Config, search space, verdict and bad-input handling: fast, no training."""

from __future__ import annotations

import io
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import optuna
import pytest
import yaml
from typer.testing import CliRunner

from lorafleet.cli import app
from lorafleet.core.config import ConfigError
from lorafleet.research.config import (
    ResearchConfig,
    apply_params,
    config_point,
    from_raw,
    load_config,
    space_fingerprint,
)
from lorafleet.research.finalize import _verdict
from lorafleet.research.progress import Progress
from lorafleet.research.result import ResearchResult
from lorafleet.research.study import _worker_alive, counted_trials, open_study, suggest, worker_id
from lorafleet.train import TrainConfig

SPACE = {"lora.r": {"type": "int", "low": 2, "high": 8}}


def _research(**kw: object) -> dict[str, object]:
    return {"study": "s", "space": SPACE, **kw}


def test_repo_config_loads() -> None:
    loaded = load_config(Path(__file__).resolve().parents[2] / "configs" / "german-legal.yaml")
    assert loaded.research.study == "german-legal"
    assert "lora.target_modules" in loaded.research.space


@pytest.mark.parametrize(("research", "message"), [
    (_research(space={}), "search space is empty"),
    (_research(space={"lora.rank": {"type": "int", "low": 1, "high": 4}}), "unknown parameter 'lora.rank'"),
    (_research(space={"optimizer": {"type": "int", "low": 1, "high": 4}}), "unknown parameter 'optimizer'"),
    (_research(space={"lora": {"type": "int", "low": 1, "high": 4}}), "'lora' is a section"),
    (_research(space={"lora.r": {"type": "int", "low": 0, "high": 4}}), "value 0 is not accepted"),
    (_research(space={"loss": {"type": "categorical", "choices": ["mnrl", "triplet"]}}), "'triplet' is not accepted"),
    (_research(budget_minutes=-5), "budget_minutes: Input should be greater than 0"),
    (_research(n_trials=0), "n_trials"),
    (_research(objective="test_ndcg@10"), "must be a dev metric"),
    (_research(space={"lora.r": {"type": "int", "low": 8, "high": 2}}), "must not exceed"),
    (_research(pruner={"kind": "threshold"}), "needs 'lower'"),
    (_research(colour="red"), "colour: unknown key"),
])
def test_bad_research_config_is_a_clear_error(research: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        from_raw({}, research, "cfg")


def test_nested_space_and_categorical_lists_round_trip() -> None:
    cfg = ResearchConfig.model_validate(
        {"space": {"lora": {"target_modules": {"type": "categorical", "choices": [["query"], ["query", "value"]]}},
                   "learning_rate": {"type": "float", "low": 1e-4, "high": 1e-3, "log": True}}})
    assert set(cfg.space) == {"lora.target_modules", "learning_rate"}
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    seen = set()
    for _ in range(12):
        params = suggest(study.ask(), cfg.space)
        train = apply_params({"lora": {"r": 4}}, params, TrainConfig)
        assert train.lora.target_modules == params["lora.target_modules"]
        assert train.lora.r == 4  # untouched keys of the train: section stay
        seen.add(tuple(params["lora.target_modules"]))
    assert seen == {("query",), ("query", "value")}


def test_config_point_is_the_train_section_in_optunas_terms() -> None:
    """The first trial of a new study replays the config: its values as Optuna stores them, or sampled when the
    space does not hold them."""
    cfg = ResearchConfig.model_validate({"space": {
        "lora.target_modules": {"type": "categorical", "choices": [["query"], ["query", "value"]]},
        "lora.r": {"type": "int", "low": 2, "high": 16, "step": 2},
        "learning_rate": {"type": "float", "low": 1e-4, "high": 1e-3, "log": True},
        "epochs": {"type": "categorical", "choices": [1, 2]},
    }})
    train = TrainConfig.model_validate({"lora": {"r": 4, "target_modules": ["query", "value"]},
                                        "learning_rate": 5e-4, "epochs": 2})
    point, outside = config_point(cfg.space, train)
    assert point == {"lora.target_modules": '["query", "value"]', "lora.r": 4, "learning_rate": 5e-4, "epochs": 2}
    assert outside == []
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    study.enqueue_trial(point)
    assert apply_params({}, suggest(study.ask(), cfg.space), TrainConfig) == train

    odd = TrainConfig.model_validate({"lora": {"r": 5, "target_modules": ["key"]}, "learning_rate": 5e-3})
    point, outside = config_point(cfg.space, odd)  # r off the step, modules not a choice, lr above the range
    assert point == {"epochs": 2} and outside == ["lora.target_modules", "lora.r", "learning_rate"]


def test_fingerprint_tracks_the_space_only() -> None:
    a = ResearchConfig.model_validate(_research())
    b = ResearchConfig.model_validate(_research(n_trials=99, budget_minutes=1))
    c = ResearchConfig.model_validate(_research(space={"lora.r": {"type": "int", "low": 2, "high": 16}}))
    assert space_fingerprint(a.space) == space_fingerprint(b.space) != space_fingerprint(c.space)


def _result(winner: dict[str, float], reseed: dict[str, float]) -> ResearchResult:
    return ResearchResult(study="s", storage="", experiment="", parent_run_id="", objective="dev_ndcg@10",
                          winner_trial=3, winner_metrics=winner, reseed_metrics=reseed)


@pytest.mark.parametrize(("winner", "reseed", "margin", "candidate"), [
    ({"dev_ndcg@10": 0.60, "test_ndcg@10": 0.60}, {"test_ndcg@10": 0.58}, 0.05, True),
    ({"dev_ndcg@10": 0.60, "test_ndcg@10": 0.60}, {"test_ndcg@10": 0.51}, 0.05, False),  # second seed too weak
    ({"dev_ndcg@10": 0.51, "test_ndcg@10": 0.60}, {"test_ndcg@10": 0.60}, 0.05, False),  # dev below the margin
    ({"dev_ndcg@10": 0.60, "test_ndcg@10": 0.52}, {}, 0.05, False),
    ({"dev_ndcg@10": 0.60, "test_ndcg@10": 0.53}, {}, 0.05, True),  # no reseed: the one seed decides
])
def test_verdict_needs_every_seed_over_the_margin(winner: dict[str, float], reseed: dict[str, float], margin: float,
                                                  candidate: bool) -> None:
    baseline = {"base_dev_ndcg@10": 0.5, "base_test_ndcg@10": 0.5}
    ok, text = _verdict(margin, "dev_ndcg@10", "maximize", baseline, _result(winner, reseed))
    assert ok is candidate
    assert text.startswith("candidate" if candidate else "no candidate")


def test_worker_liveness_detects_a_dead_process() -> None:
    assert _worker_alive(worker_id()) is True
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    import psutil

    me = f"{worker_id().split(':')[0]}:{proc.pid}:{psutil.Process(proc.pid).create_time():.2f}"
    assert _worker_alive(me) is True
    proc.kill()
    proc.wait()
    assert _worker_alive(me) is False
    assert _worker_alive(f"other-host:{proc.pid}:1.0") is None  # only heartbeats can tell


def test_plain_progress_lines() -> None:
    out = io.StringIO()
    with Progress("s", 4, time.monotonic() + 125, "dev_ndcg@10", stream=out) as p:
        p.trial_started(0, 1, {"lora.r": 4})
        p.epoch(0, 1, 0.25)
        p.trial_finished(0, "complete", 0.25, (0, 0.25))
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    assert "trial 1/4 (#0) started: lora.r=4" in lines[0]
    assert "best 0.2500 (trial #0)" in lines[2] and "2m0" in lines[2]


@pytest.fixture
def write_yaml(tmp_path: Path, tiny_model_dir: Path) -> Callable[..., Path]:
    def write(name: str, **research: object) -> Path:
        path = tmp_path / f"{name}.yaml"
        raw = {"train": {"base_model": str(tiny_model_dir), "data": {"laws": ["prodhaftg"]}},
               "research": {"study": "clash", "space": SPACE, **research}}
        path.write_text(yaml.safe_dump(raw))
        return path

    return write


def test_cli_bad_input_exits_non_zero(write_yaml: Callable[..., Path], tmp_path: Path) -> None:
    runner = CliRunner()
    good = write_yaml("good")
    cases = [
        (["research", "run", str(tmp_path / "missing.yaml")], "does not exist"),
        (["research", "run", str(good), "--budget-minutes", "-1"], "--budget-minutes must be positive"),
        (["research", "run", str(good), "--trials", "0"], "--trials must be at least 1"),
        (["research", "run", str(good), "--set", "research.space={}"], "search space is empty"),
        (["research", "run", str(good), "--set", "research.space.lora.rank={type: int, low: 1, high: 2}"],
         "unknown parameter 'lora.rank'"),
        (["research", "resume", "nope"], "no study named 'nope'"),
    ]
    for args, message in cases:
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output, (args, result.output)
    assert runner.invoke(app, ["research", "run", "--help"]).exit_code == 0
    assert runner.invoke(app, ["research", "resume", "--help"]).exit_code == 0


def test_existing_study_with_another_space_is_refused(write_yaml: Callable[..., Path], _isolated_home: Path) -> None:
    from lorafleet.research.study import make_storage, storage_url

    first = load_config(write_yaml("first"))
    storage = make_storage(storage_url(), first.research, None)
    study, created = open_study("clash", storage, first.research, {"train": {}, "research": {}})
    assert created
    assert counted_trials(study) == 0
    # Same space: loads (no error); another space: refused with both fingerprints named.
    assert open_study("clash", storage, first.research, {})[1] is False
    other = write_yaml("other", space={"lora.r": {"type": "int", "low": 2, "high": 32}})
    result = CliRunner().invoke(app, ["research", "run", str(other)])
    assert result.exit_code == 2
    assert "already exists with a different search space" in result.output


def test_live_progress_renders_on_a_terminal_like_stream() -> None:
    out = io.StringIO()
    with Progress("s", 2, time.monotonic() + 60, "dev_ndcg@10", stream=out, live=True) as p:
        p.trial_started(0, 1, {"lora.r": 4})
        p.trial_finished(0, "complete", 0.5, (0, 0.5))
        p.note("a note")
    text = out.getvalue()
    assert "lorafleet research" in text and "best 0.5000 (trial #0)" in text and "a note" in text
