"""The generation kind's metrics: ROUGE-L F1 (the headline), chrF β=2 and β=1 on hand-computed pairs, and the
gate that follows from them (a metric the kind does not report is refused; the best baseline is the bar)."""

from __future__ import annotations

import pytest

from lorafleet.core.config import ConfigError
from lorafleet.core.tasks import get_task_kind, judge
from lorafleet.train.kinds.generation.baselines import best_baseline, best_label
from lorafleet.train.kinds.generation.evaluate import chrf, exact_match_reach, text_metrics

TRUTH = "Gemeinschaftliche Verwaltung"  # BGB § 744
LEAD = "Die Verwaltung des gemeinschaftlichen Gegenstands steht den Teilhabern gemeinschaftlich zu"


def _chrf_by_hand(p: list[float], r: list[float], beta: float) -> float:
    """chrF as sacrebleu defines it: F_β of the precision and the recall averaged over character orders, × 100."""
    b2, prec, rec = beta * beta, sum(p) / len(p), sum(r) / len(r)
    return 100 * (1 + b2) * prec * rec / (b2 * prec + rec)


def test_rouge_l_f1_on_known_pairs() -> None:
    m = text_metrics(["Verwaltung", TRUTH, "Gemeinschaft", "Haftung des Herstellers"],
                     [TRUTH, TRUTH, TRUTH, "Haftung des Verkäufers"], "test")
    # LCS 1 of 1 predicted and 2 true words: P 1, R 1/2, F 2/3; exact 1; none; LCS 2 of 3 and 3: F 2/3.
    assert m["test_rouge_l"] == pytest.approx((2 / 3 + 1 + 0 + 2 / 3) / 4)
    assert m["test_exact_match"] == pytest.approx(1 / 4)
    assert m["test_pred_words"] == pytest.approx((1 + 2 + 1 + 3) / 4)


def test_exact_match_reach_counts_what_copying_could_match() -> None:
    refs = ["Verjährung", TRUTH, "Haftung des Herstellers", "Anwendungsbereich"]
    inputs = ["Der Anspruch unterliegt der Verjährung.",  # in train and in its input
              LEAD,  # "gemeinschaftlichen Gegenstands", not the heading's words in a row: neither
              "(1) Die Haftung des Herstellers ist ausgeschlossen.",  # in its input only (casefolded words)
              "Dieses Gesetz gilt für Verträge."]
    train = ["  verjährung.", "Anwendungsbereich", "Haftung des Verkäufers"]  # normalised as exact match is
    reach = exact_match_reach(refs, inputs, train)
    assert reach == {"reach_train": 2 / 4, "reach_input": 2 / 4, "reach": 3 / 4}
    assert exact_match_reach([], [], train) == {"reach_train": 0.0, "reach_input": 0.0, "reach": 0.0}
    with pytest.raises(ValueError):
        exact_match_reach(refs, inputs[:2], train)


def test_chrf_beta_2_and_beta_1_by_hand() -> None:
    # "abcdefgh" holds every character n-gram of "abcdef": order n has 9 - n predicted, 7 - n true, 7 - n matching.
    p = [(7 - n) / (9 - n) for n in range(1, 7)]
    r = [1.0] * 6
    assert chrf(["abcdefgh"], ["abcdef"], beta=2) == pytest.approx(_chrf_by_hand(p, r, 2), abs=1e-6)
    assert chrf(["abcdefgh"], ["abcdef"], beta=1) == pytest.approx(_chrf_by_hand(p, r, 1), abs=1e-6)
    m = text_metrics(["abcdefgh"], ["abcdef"], "dev")
    assert m["dev_chrf"] == pytest.approx(_chrf_by_hand(p, r, 2), abs=1e-6)
    assert m["dev_chrf1"] == pytest.approx(_chrf_by_hand(p, r, 1), abs=1e-6)
    assert m["dev_chrf"] > m["dev_chrf1"]  # β = 2 forgives the 2 extra characters: recall is perfect


def test_chrf_beta_2_prefers_a_copy_of_the_opening_rouge_l_does_not() -> None:
    """The example docs/benchmarks.md shows: chrF β=2 ranks a copied opening above a correct short answer."""
    short, wrong, copy = (text_metrics([p], [TRUTH], "test") for p in ("Verwaltung", "Gemeinschaft", LEAD))
    assert copy["test_chrf"] > wrong["test_chrf"] > short["test_chrf"]
    assert short["test_rouge_l"] > copy["test_rouge_l"] > wrong["test_rouge_l"] == 0.0
    assert (round(short["test_rouge_l"], 2), round(copy["test_rouge_l"], 2)) == (0.67, 0.17)
    assert (round(short["test_chrf"], 1), round(wrong["test_chrf"], 1), round(copy["test_chrf"], 1)) == (
        35.2, 43.9, 64.4)  # chrF of the normalised (casefolded) texts: "gemeinschaftlichen" shares the "G…" n-grams
    assert (round(short["test_chrf1"], 1), round(wrong["test_chrf1"], 1), round(copy["test_chrf1"], 1)) == (
        46.5, 55.6, 44.2)


def test_the_generation_kind_gates_on_rouge_l_against_the_best_baseline() -> None:
    spec = get_task_kind("generation").metrics
    assert (spec.objective, spec.headline, spec.direction) == ("dev_rouge_l", "test_rouge_l", "maximize")
    assert {"test_chrf", "test_chrf1", "test_exact_match", "test_pred_words", "best_test_rouge_l"} <= set(
        spec.headline_set)
    baselines = {"lead_test_rouge_l": 0.30, "base_test_rouge_l": 0.10, "kshot_test_rouge_l": 0.35,
                 "other_kshot_test_rouge_l": 0.20, "lead_test_chrf": 60.0, "kshot_test_chrf": 30.0}
    best = best_baseline(baselines, ["lead", "base", "kshot", "other_kshot"], ("test",))
    assert best == {"best_test_rouge_l": 0.35, "best_test_chrf": 60.0}
    assert best_label(baselines, ["lead", "base", "kshot", "other_kshot"]) == "kshot"
    # Beating the base by far is not enough: the k-shot prompt is the bar (2 % margin → 0.357).
    verdict = judge(spec, {"test_rouge_l": 0.355, **baselines, **best}, None, 0.02)
    assert not verdict.ok and "best baseline" in verdict.reasons[0]
    assert judge(spec, {"test_rouge_l": 0.36, **baselines, **best}, None, 0.02).ok


@pytest.mark.parametrize("objective", ["dev_bleu", "dev_ndcg@10"])
def test_an_objective_the_kind_does_not_report_is_refused_at_config_time(objective: str) -> None:
    from lorafleet.research.config import from_raw

    research = {"objective": objective, "space": {"learning_rate": {"type": "float", "low": 1e-4, "high": 1e-3}}}
    with pytest.raises(ConfigError, match=rf"objective '{objective}' is not an objective of the generation kind.*"
                                          r"dev_rouge_l"):
        from_raw({}, research, "test.yaml", task="generation")
    ok = from_raw({}, {**research, "objective": "dev_chrf1"}, "test.yaml", task="generation")
    assert ok.objective == "dev_chrf1"
    assert from_raw({}, {"space": research["space"]}, "test.yaml", task="generation").objective == "dev_rouge_l"
