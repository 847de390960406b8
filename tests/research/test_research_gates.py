"""Issue 39 as pure logic: a tie is no win, the rerank gate's own and best first stage, one margin from research to
promotion, objectives that are scores, baselines keyed by what they depend on, and what the report says."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lorafleet.core.config import ConfigError
from lorafleet.core.tasks import beats, get_task_kind, judge
from lorafleet.registry.bundle import MARGIN_TAG, build_bundle
from lorafleet.registry.promote import check_gate
from lorafleet.registry.store import VersionInfo
from lorafleet.research.config import MAX_VARIANTS, CategoricalParam, from_raw, space_variants
from lorafleet.research.finalize import _verdict
from lorafleet.research.report import columns, render_markdown
from lorafleet.research.result import ResearchResult

# The measured case of the issue: a hybrid pipeline at 0.41 over BM25's best 0.3924, below its own hybrid first
# stage alone (0.4229).
HYBRID = {"test_ndcg@10": 0.41, "base_test_ndcg@10": 0.30, "first_test_ndcg@10": 0.4229,
          "best_test_ndcg@10": 0.4229, "bestfirst_test_ndcg@10": 0.4229}


def test_a_tie_is_no_win() -> None:
    assert not beats(0.40, 0.40, 0.0, "maximize") and not beats(1.0, 1.0, 0.0, "minimize")
    assert beats(0.4001, 0.40, 0.0, "maximize") and beats(0.42, 0.40, 0.05, "maximize")  # the margin, reached
    gate = judge(get_task_kind("retrieval").metrics, {"test_ndcg@10": 0.4, "base_test_ndcg@10": 0.4}, None, 0.0)
    assert not gate.ok and gate.reasons == ["test_ndcg@10 0.4000 ties the base model's 0.4000: a tie is no win "
                                            "(relative margin 0.0%)"]
    # The champion may be tied (promoting the champion again, or an equal retrain): not behind is enough there.
    assert judge(get_task_kind("retrieval").metrics, {"test_ndcg@10": 0.5, "base_test_ndcg@10": 0.4},
                 {"test_ndcg@10": 0.5}, 0.0).ok


def test_the_rerank_gate_compares_with_its_own_and_the_best_first_stage() -> None:
    kind = get_task_kind("rerank")
    assert [p for p, _ in kind.metrics.gates] == ["best", "bestfirst"]
    gate = kind.gate(HYBRID, None, 0.02)
    assert not gate.ok and gate.base_score == 0.4229 and gate.rivals == {"bestfirst": 0.4229}
    assert "its own first stage alone" in gate.reasons[0] and "best first stage alone" in gate.reasons[1]
    # Beating its own first stage is not enough when another first stage of the space alone does better.
    own_only = kind.gate({**HYBRID, "test_ndcg@10": 0.45, "bestfirst_test_ndcg@10": 0.47}, None, 0.02)
    assert not own_only.ok and len(own_only.reasons) == 1 and "best first stage" in own_only.reasons[0]
    assert kind.gate({**HYBRID, "test_ndcg@10": 0.45}, None, 0.02).ok
    # A version that records no best first stage cannot show it beats one.
    old = {k: v for k, v in HYBRID.items() if not k.startswith("bestfirst_")}
    assert any("no bestfirst_test_ndcg@10 recorded" in r for r in kind.gate({**old, "test_ndcg@10": 0.45}, None,
                                                                              0.02).reasons)
    # Research's verdict compares the same, on dev and test.
    result = ResearchResult(study="s", storage="", experiment="", parent_run_id="", objective="dev_ndcg@10",
                            task="rerank", winner_trial=0,
                            winner_metrics={"dev_ndcg@10": 0.41, "test_ndcg@10": 0.41})
    baseline = {**HYBRID, **{k.replace("test_", "dev_"): v for k, v in HYBRID.items()}}
    ok, text = _verdict(0.02, "dev_ndcg@10", "maximize", baseline, result, kind.metrics.gates)
    assert not ok and "its own first stage alone and the base reranker on it (dev 0.4229, test 0.4229)" in text


def _version(score: float, base: float, margin: str | None) -> VersionInfo:
    tags = {"test_ndcg_at_10": str(score), "base_test_ndcg_at_10": str(base)}
    if margin is not None:
        tags[MARGIN_TAG] = margin
    return VersionInfo(name="legal", version="1", source="file:///x", run_id=None, tags=tags)


def test_promotion_gates_at_the_margin_research_recorded() -> None:
    recorded = check_gate(_version(0.405, 0.40, "0.02"), None)  # +1.25 %: research's 2 % says no
    assert not recorded.ok and recorded.margin == 0.02 and recorded.margin_source == "recorded by research"
    given = check_gate(_version(0.405, 0.40, "0.02"), None, 0.0)  # the operator's --margin overrides it
    assert given.ok and given.margin == 0.0 and given.margin_source == "given"
    default = check_gate(_version(0.405, 0.40, None), None)  # registered without one: research's default
    assert not default.ok and default.margin == 0.02 and default.margin_source == "default"
    assert not check_gate(_version(0.40, 0.40, "0"), None).ok  # a tie with the base is no win


def test_the_bundle_records_the_margin(tmp_path: Path, tiny_model_dir: Path) -> None:
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    (adapter / "adapter_model.safetensors").write_bytes(b"x")
    spec = build_bundle(tmp_path / "bundle", name="legal", adapter_dir=adapter, base_source=str(tiny_model_dir),
                        metrics={"test_ndcg@10": 0.5}, margin=0.03)
    assert spec.margin == 0.03 and "margin: 0.03" in (tmp_path / "bundle" / "bundle.yaml").read_text()


SPACE = {"lr": {"type": "float", "low": 1e-4, "high": 1e-3}}


@pytest.mark.parametrize(("task", "objective"), [("rerank", "dev_recall@depth"), ("rerank", "dev_recall@100"),
                                                 ("generation", "dev_pred_words"), ("retrieval", "dev_banana")])
def test_an_objective_that_is_no_score_is_refused(task: str, objective: str) -> None:
    with pytest.raises(ConfigError, match=rf"objective '{objective}' is not an objective of the {task} kind.*"
                                          r"allowed: dev_\w+@?\w* \(maximize\)"):
        from_raw({}, {"space": SPACE, "objective": objective}, "x.yaml", task)


def test_objectives_carry_their_direction() -> None:
    for task, objective in [("retrieval", "dev_mrr@10"), ("rerank", "dev_mrr@10"), ("generation", "dev_chrf")]:
        assert get_task_kind(task).metrics.direction_of(objective) == "maximize"
    assert "dev_recall@depth" not in get_task_kind("rerank").metrics.objective_directions()


def test_baselines_are_keyed_by_what_they_depend_on() -> None:
    retrieval, rerank = get_task_kind("retrieval"), get_task_kind("rerank")
    cfg = retrieval.parse_config({})
    same = retrieval.parse_config({"data": {"num_negatives": 3, "hard_negatives": False}})  # training pairs only
    assert retrieval.baseline_key(cfg) == retrieval.baseline_key(same)
    for other in ({"data": {"max_eval_queries": 5}}, {"base_model": "x/y"}, {"max_seq_length": 64}):
        assert retrieval.baseline_key(retrieval.parse_config(other)) != retrieval.baseline_key(cfg), other
    r = rerank.parse_config({})
    for other in ({"first_stage": {"kind": "dense"}}, {"first_stage": {"depth": 30}}, {"max_pair_length": 256},
                  {"data": {"laws": ["agg"]}}):
        assert rerank.baseline_key(rerank.parse_config(other)) != rerank.baseline_key(r), other
    assert rerank.baseline_key(rerank.parse_config({"lora": {"r": 4}, "loss": "bce"})) == rerank.baseline_key(r)


def test_space_variants_hold_every_choice() -> None:
    rerank = get_task_kind("rerank")
    space: dict[str, Any] = {
        "first_stage.kind": CategoricalParam(type="categorical", choices=["bm25", "dense", "hybrid"]),
        "first_stage.depth": CategoricalParam(type="categorical", choices=[10, 20]),
    }
    variants = space_variants(space, {}, {"first_stage.kind": "bm25"}, rerank.config_model)
    assert sorted((v.first_stage.kind, v.first_stage.depth) for v in variants) == sorted(
        (k, d) for k in ("bm25", "dense", "hybrid") for d in (10, 20))
    # Past MAX_VARIANTS combinations, one parameter at a time (invalid values are left out: depth ≤ 100).
    wide = {"first_stage.kind": space["first_stage.kind"],
            "first_stage.depth": CategoricalParam(type="categorical", choices=list(range(2, 2 + MAX_VARIANTS)))}
    assert len(space_variants(wide, {}, {}, rerank.config_model)) == 3 + 99


def test_the_report_says_what_the_gate_compares_and_that_relevance_is_binary() -> None:
    def report(task: str) -> str:
        result = ResearchResult(study="s", storage="", experiment="", parent_run_id="", objective="dev_ndcg@10",
                                task=task, margin=0.02, dataset_digest="ab" * 32)
        return render_markdown(result, [], {}, [])

    for task in ("retrieval", "rerank"):
        text = report(task)
        assert "Relevance is binary" in text and "not MTEB's nDCG over graded judgements" in text
        assert "relative margin of 2.0%, strictly" in text and "`abababababab`" in text
    assert "the best first stage alone (of those the search space holds)" in report("rerank")
    result = ResearchResult(study="s", storage="", experiment="", parent_run_id="", objective="dev_ndcg@10",
                            task="rerank")
    assert columns(result) == ["metric", "base model", "first stage alone", "best baseline (gate)",
                               "best first stage alone", "winner", "winner, seed 2"]


def test_a_winner_on_other_data_is_judged_by_baselines_on_its_own_data(research_yaml: Any,
                                                                       _isolated_home: Path) -> None:
    """The space changes the evaluation data (`data.max_eval_queries`): the winner's baselines are measured on the
    winner's dataset, not the `train:` section's (issue 39, item 8)."""
    from lorafleet.research.config import load_config
    from lorafleet.research.runner import run_research

    space = {"data.max_eval_queries": {"type": "categorical", "choices": [3]}}
    result = run_research(load_config(research_yaml("own-data", n_trials=1, reseed=False, space=space)),
                          progress_live=False)
    kind = get_task_kind("retrieval")
    cfg = kind.parse_config(result.winner_config)
    dataset = kind.build_dataset(cfg)
    assert cfg.data.max_eval_queries == 3 and dataset.digest == result.dataset_digest
    own = kind.baselines(cfg, dataset)
    for key in ("base_dev_ndcg@10", "base_test_ndcg@10", "bm25_dev_ndcg@10", "bm25_test_ndcg@10"):
        assert result.baseline[key] == pytest.approx(own[key]), key
    study = kind.parse_config(load_config(research_yaml("own-data")).train_raw)
    assert kind.baselines(study, kind.build_dataset(study))["bm25_dev_ndcg@10"] != pytest.approx(
        own["bm25_dev_ndcg@10"]), "the test needs data on which the two baselines differ"
